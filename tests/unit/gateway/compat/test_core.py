"""The vendor adapters driven synchronously, like tests/unit/gateway/stream/test_session.py: frames in, actions out.

No socket, no engine, no clock: the engine's chunks are made here. What this
proves that the socket tests cannot time: a barge-in's `Cancel` actions for
every engine request of the context come back from the very call that
received it, so the engine drops them before its next step.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from engine.errors import EngineBusyError
from engine.types import AudioChunk, WordTiming
from gateway.compat.cartesia import CartesiaSession
from gateway.compat.core import CompatSession, VendorSend
from gateway.compat.deepgram import DeepgramSession
from gateway.compat.elevenlabs import ElevenLabsMultiSession, ElevenLabsSession, parse_output_format
from gateway.compat.formats import OutputFormat
from gateway.stream.actions import Action, Cancel, Close, Submit
from gateway.stream.messages import Limits, SessionOptions
from gateway.voices.catalog import VoiceCatalog

RATE = 22050


def _make(kind: type[CompatSession], output: OutputFormat) -> Any:
    session = kind("s1", catalog=VoiceCatalog({"joe"}), sample_rate=RATE, options=SessionOptions(voice="joe"),
                   limits=Limits(), output=output, admit=lambda key: None, release=lambda key: None)
    session.start(0.0)
    return session


def _frames(actions: list[Action]) -> list[dict[str, Any]]:
    return [json.loads(a.frame) for a in actions if isinstance(a, VendorSend) and isinstance(a.frame, str)]


def _chunk(submit: Submit, seconds: float, *, is_last: bool) -> AudioChunk:
    pcm = (np.sin(np.arange(int(RATE * seconds)) / 5.0) * 0.3).astype(np.float32)
    words = None
    if is_last:
        tokens = submit.request.text.split()
        step = 1000.0 * seconds / len(tokens)
        words = [WordTiming(t, i * step, (i + 1) * step) for i, t in enumerate(tokens)]
    return AudioChunk(submit.request.request_id, pcm, RATE, is_last=is_last, words=words)


def _submits(actions: list[Action]) -> list[Submit]:
    return [a for a in actions if isinstance(a, Submit)]


def test_close_context_mid_answer_cancels_every_engine_request_in_the_same_call() -> None:
    session = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"))
    text = "First sentence is here. Second one follows now. Third comes last. And more text"
    submits = _submits(session.receive_frame(json.dumps({"text": text, "context_id": "a"}), 0.0))
    assert len(submits) >= 2
    session.receive_audio(_chunk(submits[0], 0.2, is_last=False), 0.1)
    actions = session.receive_frame(json.dumps({"context_id": "a", "close_context": True}), 0.2)
    cancelled = {a.request_id for a in actions if isinstance(a, Cancel)}
    assert cancelled == {s.request.request_id for s in submits}
    assert _frames(actions)[-1] == {"isFinal": True, "contextId": "a", "context_id": "a"}
    # a chunk the engine had in flight finds nothing to speak for
    assert session.receive_audio(_chunk(submits[1], 0.5, is_last=True), 0.3) == []


def test_close_context_after_a_bare_flush_finishes_the_turn_with_its_alignment() -> None:
    session = _make(ElevenLabsMultiSession, parse_output_format("pcm_24000"))
    actions = session.receive_frame(json.dumps({"text": "Only this. ", "context_id": "a"}), 0.0)
    actions += session.receive_frame(json.dumps({"context_id": "a", "flush": True}), 0.0)
    actions += session.receive_frame(json.dumps({"context_id": "a", "close_context": True}), 0.0)
    assert not [a for a in actions if isinstance(a, Cancel)]
    (submit,) = _submits(actions)
    frames = _frames(session.receive_audio(_chunk(submit, 0.6, is_last=True), 0.5))
    assert frames[-1]["isFinal"] is True
    alignment = next(f["alignment"] for f in frames if f.get("alignment"))
    assert "".join(alignment["chars"]) == "Only this."
    assert alignment["charStartTimesMs"][-1] + alignment["charDurationsMs"][-1] == 600


def test_stream_input_ends_with_is_final_and_a_normal_close() -> None:
    session = _make(ElevenLabsSession, parse_output_format("ulaw_8000"))
    actions = session.receive_frame(json.dumps({"text": " ", "voice_settings": {"speed": 1.2}}), 0.0)
    actions += session.receive_frame(json.dumps({"text": "Bye now. "}), 0.0)
    actions += session.receive_frame(json.dumps({"text": ""}), 0.0)
    (submit,) = _submits(actions)
    assert submit.request.params.speed == 1.2
    out = session.receive_audio(_chunk(submit, 0.4, is_last=True), 0.1)
    assert _frames(out)[-1] == {"isFinal": True}
    assert any(isinstance(a, Close) and a.code == 1000 for a in out)


def test_cartesia_cancel_cancels_the_context_requests_and_sends_nothing_more() -> None:
    session = _make(CartesiaSession, OutputFormat("pcm_s16le", 24000))
    message = {"context_id": "c", "transcript": "One sentence here. Another one there. Still more to come",
               "continue": True, "voice": {"mode": "id", "id": "joe"},
               "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}
    submits = _submits(session.receive_frame(json.dumps(message), 0.0))
    actions = session.receive_frame(json.dumps({"context_id": "c", "cancel": True}), 0.1)
    assert {a.request_id for a in actions if isinstance(a, Cancel)} == {s.request.request_id for s in submits}
    assert _frames(actions) == []


def test_deepgram_clear_cancels_and_answers_cleared_in_the_same_call() -> None:
    session = _make(DeepgramSession, OutputFormat("pcm_s16le", 16000))
    submits = _submits(session.receive_frame(json.dumps({"type": "Speak", "text": "A first part. Then some"}),
                                             0.0))
    actions = session.receive_frame(json.dumps({"type": "Clear"}), 0.1)
    assert {a.request_id for a in actions if isinstance(a, Cancel)} == {s.request.request_id for s in submits}
    assert _frames(actions) == [{"type": "Cleared", "sequence_id": 0}]


def test_a_bad_frame_gets_each_vendors_error_shape() -> None:
    elevenlabs = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"))
    cartesia = _make(CartesiaSession, OutputFormat("pcm_s16le", 24000))
    deepgram = _make(DeepgramSession, OutputFormat("pcm_s16le", 16000))
    (el,) = _frames(elevenlabs.receive_frame("[1, 2]", 0.0))
    (ca,) = _frames(cartesia.receive_frame(json.dumps({"transcript": "no context id"}), 0.0))
    (dg,) = _frames(deepgram.receive_frame(json.dumps({"type": "Shout"}), 0.0))
    assert el["error"] == "bad_message" and el["code"] == 400 and "message" in el
    assert ca["type"] == "error" and ca["status_code"] == 400 and ca["title"] == "bad_message"
    assert dg["type"] == "Warning" and dg["warn_code"] == "bad_message"


def test_a_context_the_engine_refuses_gets_the_vendor_error_and_its_end() -> None:
    def full(key: str) -> None:
        raise EngineBusyError("the engine is full; try again later")

    session = ElevenLabsMultiSession("s1", catalog=VoiceCatalog({"joe"}), sample_rate=RATE,
                                     options=SessionOptions(voice="joe"), limits=Limits(),
                                     output=parse_output_format("pcm_16000"), admit=full,
                                     release=lambda key: None)
    session.start(0.0)
    actions = session.receive_frame(json.dumps({"text": "No room for me. ", "context_id": "a"}), 0.0)
    actions += session.receive_frame(json.dumps({"context_id": "a", "flush": True}), 0.0)
    actions += session.receive_frame(json.dumps({"context_id": "a", "close_context": True}), 0.0)
    frames = _frames(actions)
    assert not _submits(actions)
    assert frames[0]["error"] == "busy" and frames[0]["contextId"] == "a"
    assert frames[-1] == {"isFinal": True, "contextId": "a", "context_id": "a"}
    assert session.vendor_contexts == {}
