"""Pipecat's own ElevenLabs, Cartesia and Deepgram TTS services, pointed at voxgate by URL.

Unmodified `pipecat-ai` (the compat-test extra), driven by Pipecat's own test
runner (`pipecat.tests.utils.run_test`) against a real `voxgate serve` on
loopback (piper, joe): the audio frames come at the sample rate the pipeline
asked for, the text frames Pipecat builds (from our word timings for
ElevenLabs and Cartesia) read back the input, and an interruption mid-answer
stops the audio and cancels the engine's requests (the engine's counter in
/metrics).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

# Pipecat imports audioop, deprecated since Python 3.11; our warnings-as-errors would stop it.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from pipecat.frames.frames import (
        InterruptionFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        TTSAudioRawFrame,
        TTSTextFrame,
    )
    from pipecat.services.cartesia.tts import CartesiaTTSService
    from pipecat.services.deepgram.tts import DeepgramTTSService
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
    from pipecat.tests.utils import SleepFrame, run_test

from tests.support.server import ServerProcess, start_server

SENTENCES = ["Hello there, my good friend. ", "The weather is lovely today. ",
             "Shall we take a walk in the park? "]
LONG_ANSWER = [f"This is sentence number {n} of a rather long answer that goes on and on. "
               for n in range(1, 25)]


@pytest.fixture(scope="module")
def voxgate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("compat-pipecat"))
    yield proc
    proc.stop()


def _service(kind: str, server: ServerProcess, sample_rate: int) -> Any:
    ws_base = f"ws://127.0.0.1:{server.port}"
    if kind == "elevenlabs":
        return ElevenLabsTTSService(api_key="unused-key", url=ws_base, sample_rate=sample_rate,
                                    settings=ElevenLabsTTSService.Settings(voice="joe"))
    if kind == "cartesia":
        return CartesiaTTSService(api_key="unused-key", url=ws_base + "/tts/websocket",
                                  sample_rate=sample_rate,
                                  settings=CartesiaTTSService.Settings(voice="joe"))
    return DeepgramTTSService(api_key="unused-key", base_url=ws_base, sample_rate=sample_rate,
                              settings=DeepgramTTSService.Settings(voice="joe"))


def _words(text: str) -> list[str]:
    return text.split()


@pytest.mark.parametrize(("kind", "sample_rate"), [("elevenlabs", 16000), ("elevenlabs", 22050),
                                                   ("cartesia", 24000), ("deepgram", 16000)])
def test_pipecat_service_speaks_a_turn_at_the_requested_rate_with_matching_text(
        voxgate: ServerProcess, kind: str, sample_rate: int) -> None:
    frames = [LLMFullResponseStartFrame(), *[LLMTextFrame(s) for s in SENTENCES],
              LLMFullResponseEndFrame(), SleepFrame(sleep=3.0)]
    down, _ = asyncio.run(run_test(_service(kind, voxgate, sample_rate), frames_to_send=frames))
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio, "no audio frames"
    assert {f.sample_rate for f in audio} == {sample_rate}
    seconds = sum(len(f.audio) for f in audio) / 2 / sample_rate
    assert 3.0 < seconds < 15.0, seconds  # three short sentences of speech
    spoken = " ".join(f.text for f in down if isinstance(f, TTSTextFrame))
    assert _words(spoken) == _words("".join(SENTENCES))


@pytest.mark.parametrize("kind", ["elevenlabs", "cartesia", "deepgram"])
def test_an_interruption_mid_answer_stops_the_audio_and_cancels_the_engine_work(
        voxgate: ServerProcess, kind: str) -> None:
    cancelled_before = voxgate.metric("voxgate_engine_requests_cancelled_total")
    sent_before = voxgate.metric("voxgate_audio_sent_seconds_total")
    frames = [LLMFullResponseStartFrame(), *[LLMTextFrame(s) for s in LONG_ANSWER],
              SleepFrame(sleep=1.5), InterruptionFrame(), SleepFrame(sleep=1.5)]
    down, _ = asyncio.run(run_test(_service(kind, voxgate, 16000), frames_to_send=frames))
    index = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    assert any(isinstance(f, TTSAudioRawFrame) for f in down[:index]), "no audio before the interruption"
    assert not any(isinstance(f, TTSAudioRawFrame) for f in down[index:])
    # the server stopped too: its requests were cancelled and most of the answer never went out
    assert voxgate.metric("voxgate_engine_requests_cancelled_total") > cancelled_before
    full_answer_s = 4.0 * len(LONG_ANSWER)  # each sentence is about four seconds of speech
    assert voxgate.metric("voxgate_audio_sent_seconds_total") - sent_before < full_answer_s / 2

