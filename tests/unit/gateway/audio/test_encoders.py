"""The encoder factory: every output format opened by its `AudioFormat`, and counted."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.audio.codecs import StreamEncoder, decode_pcm16
from gateway.audio.containers import ContainerStreamEncoder
from gateway.audio.encoders import EncoderFactory
from gateway.audio.formats import AudioFormat

PIPER_RATE = 22050


def tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def level(pcm: np.ndarray, freq: float, rate: int) -> float:
    t = np.arange(len(pcm)) / rate
    return float(2 * np.abs(np.dot(pcm, np.exp(-2j * np.pi * freq * t))) / len(pcm))


@pytest.mark.parametrize(("fmt", "message"), [
    (AudioFormat("opus", 48000), None),
    (AudioFormat("pcm16", 44100), None),
    (AudioFormat("pcm16", 24000, 0), None),
    (AudioFormat("ogg_opus", 48000, 100), None),
    (("vorbis", 48000), "expected an audio kind in"),
    (("opus", 44100), r"expected sample_rate in \(48000, 24000, 16000, 8000\) for opus, got 44100"),
    (("alaw", 16000), r"expected sample_rate in \(8000,\) for alaw, got 16000"),
    (("mp3", 48000), "for mp3, got 48000"),
    (("opus", 48000, 0), r"expected frame_ms in \(20, 40, 60\), got 0"),
    (("opus", 48000, 20, 5), "expected bitrate within 6000-510000 bit/s, got 5"),
])
def test_a_format_is_checked_when_it_is_made(fmt: object, message: str | None) -> None:
    if message is None:
        assert isinstance(fmt, AudioFormat)
        return
    assert isinstance(fmt, tuple)
    with pytest.raises(ValueError, match=message):
        AudioFormat(*fmt)


def test_the_factory_opens_framed_kinds_as_frames_and_muxed_kinds_as_streams() -> None:
    factory = EncoderFactory()
    assert isinstance(factory.open(AudioFormat("pcm_f32", 32000), PIPER_RATE), StreamEncoder)
    assert isinstance(factory.open(AudioFormat("mp3", 44100), PIPER_RATE), ContainerStreamEncoder)
    assert factory.num_opened == {"pcm_f32": 1, "mp3": 1}


def test_the_factory_counts_one_encode_per_call_by_kind_and_flushes_apart() -> None:
    factory = EncoderFactory()
    framed = factory.open(AudioFormat("alaw", 8000), PIPER_RATE)
    muxed = factory.open(AudioFormat("ogg_opus", 48000), PIPER_RATE)
    pcm = tone(0.5, PIPER_RATE)
    for start in range(0, len(pcm), 2205):
        framed.encode(pcm[start:start + 2205])
        muxed.encode(pcm[start:start + 2205])
    framed.flush()
    muxed.flush()
    assert factory.num_encodes == {"alaw": 5, "ogg_opus": 5}


@pytest.mark.parametrize("rate", [22050, 32000, 44100])
def test_pcm16_at_a_rate_the_native_socket_does_not_offer_is_framed_and_keeps_the_tone(
        rate: int) -> None:
    encoder = EncoderFactory().open(AudioFormat("pcm16", rate), PIPER_RATE)
    frames = encoder.encode(tone(1.0, PIPER_RATE)) + encoder.flush()
    assert {len(f.data) for f in frames} == {2 * rate // 50}  # 20 ms frames of PCM16
    decoded = decode_pcm16(b"".join(f.data for f in frames))
    assert abs(len(decoded) - rate) <= rate // 50
    assert level(decoded[rate // 10:-rate // 10], 440, rate) == pytest.approx(0.3, abs=0.01)


def test_pcm_f32_is_float_samples_and_alaw_is_g711_at_8_khz() -> None:
    factory = EncoderFactory()
    f32 = factory.open(AudioFormat("pcm_f32", 16000), 16000)
    pcm = tone(0.1, 16000)
    data = b"".join(f.data for f in f32.encode(pcm) + f32.flush())
    np.testing.assert_allclose(np.frombuffer(data, "<f4")[:len(pcm)], pcm, atol=1e-6)
    alaw = factory.open(AudioFormat("alaw", 8000), 8000)
    silence = alaw.encode(np.zeros(100, np.float32)) + alaw.flush()
    assert [f.data for f in silence] == [b"\xd5" * 160]  # zero, and zero padding, in A-law
