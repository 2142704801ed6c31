"""Pipecat's own ElevenLabs, Cartesia and Deepgram TTS services, pointed at voxgate by URL.

Unmodified `pipecat-ai` (the compat-test extra), driven by Pipecat's own test
runner (`pipecat.tests.utils.run_test`) against a real `voxgate serve` on
loopback (piper, joe): the audio frames come at the sample rate the pipeline
asked for, the text frames Pipecat builds (from our word timings for
ElevenLabs and Cartesia) read back the input, and an interruption mid-answer
stops the audio and cancels the engine's requests (the engine's counter in
/metrics), and the server stops sending: after the interruption it sends a
small part of what it sent in as long before it (its sent-audio counter, read
at that moment).
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

# Pipecat imports audioop, deprecated since Python 3.11; our warnings-as-errors would stop it.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("pipecat", reason="the compat-test extra: pip install -e '.[compat-test]'")
    from pipecat.frames.frames import (
        InterruptionFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        TTSAudioRawFrame,
        TTSTextFrame,
    )
    from pipecat.observers.base_observer import BaseObserver, FrameProcessed, FramePushed
    from pipecat.services.cartesia.tts import CartesiaTTSService
    from pipecat.services.deepgram.tts import DeepgramTTSService
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
    from pipecat.tests.utils import SleepFrame, run_test

from tests.support.server import ServerProcess, start_server

SENTENCES = ["Hello there, my good friend. ", "The weather is lovely today. ",
             "Shall we take a walk in the park? "]
LONG_ANSWER = [f"This is sentence number {n} of a rather long answer that goes on and on. "
               for n in range(1, 61)]
SENTENCE_S = 4.0  # each sentence of it is about four seconds of speech


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


class _AtInterruption(BaseObserver):
    """When the TTS service pushed its first audio, and when the interruption reached it (it
    sends the vendor's barge-in then: close_context, cancel, Clear), with the server's
    sent-audio counter read at that moment."""

    def __init__(self, server: ServerProcess, service: Any) -> None:
        super().__init__()
        self._server, self._service = server, service
        self.first_audio_at: float | None = None
        self.at: float | None = None
        self.sent_s: float | None = None

    async def on_push_frame(self, data: FramePushed) -> None:
        if data.source is self._service and isinstance(data.frame, TTSAudioRawFrame) \
                and self.first_audio_at is None:
            self.first_audio_at = time.monotonic()

    async def on_process_frame(self, data: FrameProcessed) -> None:
        if data.processor is self._service and isinstance(data.frame, InterruptionFrame) \
                and self.at is None:
            self.at = time.monotonic()
            self.sent_s = await asyncio.to_thread(self._server.metric,
                                                  "voxgate_audio_sent_seconds_total")


@pytest.mark.parametrize("kind", ["elevenlabs", "cartesia", "deepgram"])
def test_an_interruption_mid_answer_stops_the_audio_and_cancels_the_engine_work(
        voxgate: ServerProcess, kind: str) -> None:
    cancelled_before = voxgate.metric("voxgate_engine_requests_cancelled_total")
    sent_before = voxgate.metric("voxgate_audio_sent_seconds_total")
    service = _service(kind, voxgate, 16000)
    seen = _AtInterruption(voxgate, service)
    frames = [LLMFullResponseStartFrame(), *[LLMTextFrame(s) for s in LONG_ANSWER],
              SleepFrame(sleep=1.5), InterruptionFrame(), SleepFrame(sleep=3.0)]
    down, _ = asyncio.run(run_test(service, frames_to_send=frames, observers=[seen]))
    index = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    assert any(isinstance(f, TTSAudioRawFrame) for f in down[:index]), \
        "no audio before the interruption"
    assert not any(isinstance(f, TTSAudioRawFrame) for f in down[index:])
    # the server stopped too: its requests were cancelled, and it sent little after. The answer
    # streams as fast as the box makes it, so what went out before is the box's pace, not a
    # bound: a server that went on would send at that pace after the interruption, until the
    # socket closed, and one that stopped sends what it had in flight, a fraction of it.
    assert voxgate.metric("voxgate_engine_requests_cancelled_total") > cancelled_before
    assert seen.at is not None and seen.first_audio_at is not None and seen.sent_s is not None
    sent_after_s = voxgate.metric("voxgate_audio_sent_seconds_total") - seen.sent_s
    window_s = time.monotonic() - seen.at  # the socket is closed by now
    sent_before_s = seen.sent_s - sent_before
    pace = sent_before_s / (seen.at - seen.first_audio_at)  # audio seconds a second, this box
    assert SENTENCE_S * len(LONG_ANSWER) - sent_before_s > 0.5 * pace * window_s, \
        f"{sent_before_s:.1f} s went out before the interruption: too little of the answer " \
        "was left for a server that went on to show (a longer LONG_ANSWER for a box this fast)"
    assert sent_after_s < 0.2 * pace * window_s, \
        f"{sent_after_s:.1f} s sent after the interruption " \
        f"({sent_before_s:.1f} s before, {pace:.1f} s/s)"

