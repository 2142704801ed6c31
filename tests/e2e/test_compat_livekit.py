"""LiveKit Agents' own ElevenLabs and Cartesia plugins, pointed at voxgate by `base_url`.

Unmodified `livekit-plugins-elevenlabs` and `livekit-plugins-cartesia` (the
compat-test extra) stream a turn through a real `voxgate serve` on loopback;
their own decoders (LiveKit's `AudioStreamDecoder` for MP3 and Ogg Opus) turn
the bytes into frames. The audio must last as long as the same turn does in
raw PCM (whose length the byte count gives), at the rate the plugin asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.server import ServerProcess, start_server

COMPAT_TEST = "the compat-test extra: pip install -e '.[compat-test]'"
cartesia = pytest.importorskip("livekit.plugins.cartesia", reason=COMPAT_TEST)
elevenlabs = pytest.importorskip("livekit.plugins.elevenlabs", reason=COMPAT_TEST)
aiohttp = pytest.importorskip("aiohttp", reason=COMPAT_TEST)

TEXT = "Hello there, my good friend. The weather is lovely today, so let us take a walk."


@pytest.fixture(scope="module")
def voxgate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("compat-livekit"))
    yield proc
    proc.stop()


async def _synthesize(tts: Any) -> tuple[int, float]:
    stream = tts.stream()
    stream.push_text(TEXT)
    stream.end_input()
    num_samples, rate = 0, 0
    async for event in stream:
        num_samples += event.frame.samples_per_channel
        rate = event.frame.sample_rate
    await stream.aclose()
    await tts.aclose()
    return rate, num_samples / rate


def _elevenlabs(port: int, encoding: str) -> tuple[int, float]:
    async def run() -> tuple[int, float]:
        async with aiohttp.ClientSession() as http:
            tts = elevenlabs.TTS(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused-key",
                                 voice_id="joe", encoding=encoding, http_session=http)  # type: ignore[arg-type]
            return await _synthesize(tts)
    return asyncio.run(run())


def _cartesia(port: int, rate: int) -> tuple[int, float]:
    async def run() -> tuple[int, float]:
        async with aiohttp.ClientSession() as http:
            tts = cartesia.TTS(base_url=f"http://127.0.0.1:{port}", api_key="unused-key",
                               voice="joe", sample_rate=rate, http_session=http)
            return await _synthesize(tts)
    return asyncio.run(run())


@pytest.fixture(scope="module")
def reference_s(voxgate: ServerProcess) -> float:
    """The turn's length in raw PCM through the same plugin: the bytes' length says it exactly."""
    rate, seconds = _elevenlabs(voxgate.port, "pcm_24000")
    assert rate == 24000
    assert 3.0 < seconds < 10.0, seconds  # two sentences of speech
    return seconds


#: piper samples its durations (a seeded stream per request), so the same turn runs a few
#: percent longer or shorter each time; a lost sentence or a doubled one is far outside this
DURATION_SLACK = 0.08


@pytest.mark.parametrize(("encoding", "rate"), [
    ("mp3_22050_32", 22050),   # LiveKit's default
    ("opus_48000_64", 48000),  # Ogg Opus
    ("pcm_16000", 16000),
])
def test_livekit_elevenlabs_plugin_streams_audio_of_the_expected_duration(
        voxgate: ServerProcess, reference_s: float, encoding: str, rate: int) -> None:
    got_rate, seconds = _elevenlabs(voxgate.port, encoding)
    assert got_rate == rate
    assert abs(seconds - reference_s) <= DURATION_SLACK * reference_s, (seconds, reference_s)


def test_livekit_cartesia_plugin_streams_audio_of_the_expected_duration(
        voxgate: ServerProcess) -> None:
    rate_24k, seconds_24k = _cartesia(voxgate.port, 24000)
    rate_44k, seconds_44k = _cartesia(voxgate.port, 44100)
    assert (rate_24k, rate_44k) == (24000, 44100)
    assert 3.0 < seconds_24k < 10.0, seconds_24k  # two sentences of speech
    # the same turn lasts as long at either rate: each stream's bytes are at its stated rate
    assert abs(seconds_44k - seconds_24k) <= DURATION_SLACK * seconds_24k, \
        (seconds_24k, seconds_44k)
