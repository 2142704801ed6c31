"""The vendor adapters driven synchronously, like tests/unit/gateway/stream/test_session.py: frames
in, actions out.

No socket, no engine, no clock: the engine's chunks are made here. What this
proves that the socket tests cannot time: a barge-in's `Cancel` actions for
every engine request of the context come back from the very call that
received it, so the engine drops them before its next step.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from engine.errors import EngineBusyError
from engine.types import AudioChunk, VoiceInfo, WordTiming
from gateway.access.admission import Refused
from gateway.compat.cartesia import CartesiaSession
from gateway.compat.core import VendorSession
from gateway.compat.deepgram import DeepgramSession
from gateway.compat.elevenlabs import ElevenLabsMultiSession, ElevenLabsSession, parse_output_format
from gateway.compat.formats import OutputFormat
from gateway.stream.actions import Action, Cancel, Close, SendFrame, Submit
from gateway.stream.options import Limits, SessionOptions
from gateway.voices.catalog import VoiceCatalog, unknown_voice_message

RATE = 22050


def _make(kind: type[VendorSession[Any, Any]], output: OutputFormat, limits: Limits | None = None,
          **kwargs: Any) -> Any:
    session = kind("s1", catalog=VoiceCatalog({"joe"}), sample_rate=RATE,
                   options=SessionOptions(voice="joe"),
                   limits=limits or Limits(), output=output, admit=lambda key: None,
                   release=lambda key: None, **kwargs)
    session.start(0.0)
    return session


def _frames(actions: list[Action]) -> list[dict[str, Any]]:
    return [json.loads(a.frame) for a in actions if isinstance(a, SendFrame)
            and isinstance(a.frame, str)]


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
    actions = session.receive_frame(json.dumps({"text": " ", "voice_settings": {"speed": 1.2}}),
                                    0.0)
    actions += session.receive_frame(json.dumps({"text": "Bye now. "}), 0.0)
    actions += session.receive_frame(json.dumps({"text": ""}), 0.0)
    (submit,) = _submits(actions)
    assert submit.request.params.speed == 1.2
    out = session.receive_audio(_chunk(submit, 0.4, is_last=True), 0.1)
    assert _frames(out)[-1] == {"isFinal": True}
    assert any(isinstance(a, Close) and a.code == 1000 for a in out)


def test_cartesia_cancel_cancels_the_context_requests_and_sends_nothing_more() -> None:
    session = _make(CartesiaSession, OutputFormat("pcm_s16le", 24000))
    message = {"context_id": "c",
               "transcript": "One sentence here. Another one there. Still more to come",
               "continue": True, "voice": {"mode": "id", "id": "joe"},
               "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}
    submits = _submits(session.receive_frame(json.dumps(message), 0.0))
    actions = session.receive_frame(json.dumps({"context_id": "c", "cancel": True}), 0.1)
    assert {a.request_id for a in actions if isinstance(a, Cancel)} == {
        s.request.request_id for s in submits}
    assert _frames(actions) == []


def test_deepgram_clear_cancels_and_answers_cleared_in_the_same_call() -> None:
    session = _make(DeepgramSession, OutputFormat("pcm_s16le", 16000))
    submits = _submits(session.receive_frame(json.dumps({"type": "Speak",
                                                         "text": "A first part. Then some"}),
                                             0.0))
    actions = session.receive_frame(json.dumps({"type": "Clear"}), 0.1)
    assert {a.request_id for a in actions if isinstance(a, Cancel)} == {
        s.request.request_id for s in submits}
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
    actions = session.receive_frame(json.dumps({"text": "No room for me. ", "context_id": "a"}),
                                    0.0)
    actions += session.receive_frame(json.dumps({"context_id": "a", "flush": True}), 0.0)
    actions += session.receive_frame(json.dumps({"context_id": "a", "close_context": True}), 0.0)
    frames = _frames(actions)
    assert not _submits(actions)
    assert frames[0]["error"] == "busy" and frames[0]["contextId"] == "a"
    assert frames[-1] == {"isFinal": True, "contextId": "a", "context_id": "a"}
    assert session.vendor_contexts == {}


def test_a_vendor_frame_costs_one_rate_token_however_many_native_messages_it_becomes() -> None:
    # three tokens; each frame below becomes two native messages (session.update for the
    # speed, then the text) or more, which used to cost a token each on top of nothing
    limits = Limits(max_messages_per_s=1.0, burst_s=3.0)
    session = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"), limits)
    speeds = (1.1, 1.2, 1.3)
    submitted = []
    for n, speed in enumerate(speeds):
        frame = {"text": f"Turn number {n} is here. ", "context_id": f"c{n}", "flush": True,
                 "voice_settings": {"speed": speed}}
        actions = session.receive_frame(json.dumps(frame), 0.0)
        assert _frames(actions) == []  # no error
        submitted += _submits(actions)
    assert [s.request.params.speed for s in submitted] == list(speeds)
    (refused,) = _frames(session.receive_frame(json.dumps({"text": "One more. ",
                                                           "context_id": "c9"}), 0.0))
    assert refused["error"] == "rate_limited"


def test_a_frame_of_chinese_is_sized_as_the_client_sent_it_and_spoken() -> None:
    text = "今天天气很好，我们一起去公园散步吧。" * 1000  # 18,000 characters, 54,000 bytes of UTF-8
    frame = json.dumps({"text": text, "context_id": "zh", "flush": True}, ensure_ascii=False)
    assert 50_000 < len(frame.encode("utf-8")) < Limits().max_message_bytes < len(
        json.dumps({"text": text}))
    limits = Limits(max_text_chars_per_s=4000.0, burst_s=5.0)
    session = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"), limits)
    actions = session.receive_frame(frame, 0.0)
    assert _frames(actions) == []  # neither message_too_large nor anything else
    submits = _submits(actions)
    assert submits and submits[0].request.text.startswith("今天天气很好")


def test_a_frame_too_large_as_sent_is_refused_before_it_is_read() -> None:
    session = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"),
                    Limits(max_message_bytes=100))
    (error,) = _frames(session.receive_frame(json.dumps({"text": "x" * 200, "context_id": "a"}),
                                             0.0))
    assert error["error"] == "message_too_large" and "the limit is 100" in error["message"]


def test_a_vendor_frame_nested_thousands_deep_is_a_bad_message_not_a_crash() -> None:
    session = _make(CartesiaSession, OutputFormat("pcm_s16le", 24000))
    (error,) = _frames(session.receive_frame("[" * 5000 + "]" * 5000, 0.0))
    assert error["title"] == "bad_message" and "not valid JSON" in error["error"]


def test_a_key_in_the_first_message_is_checked_by_the_admission_and_only_then_speaks() -> None:
    seen: list[str | None] = []

    def authorize(key: str | None) -> None:
        seen.append(key)
        if key != "good-key-123":
            raise Refused("unauthorized", "a valid API key is required: xi_api_key", 4401)

    refused = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"), authorize=authorize)
    actions = refused.receive_frame(json.dumps({"text": "Hi there. ", "context_id": "a",
                                                "xi_api_key": "wrong-key-000", "flush": True}), 0.0)
    assert _frames(actions)[0]["error"] == "unauthorized" and not _submits(actions)
    assert any(isinstance(a, Close) and a.code == 4401 for a in actions)
    accepted = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"), authorize=authorize)
    actions = accepted.receive_frame(json.dumps({"text": "Hi there. ", "context_id": "a",
                                                 "xi_api_key": "good-key-123", "flush": True}), 0.0)
    assert _submits(actions) and accepted.authorize is None  # checked once, for the socket
    assert seen == ["wrong-key-000", "good-key-123"]


def test_a_speed_too_large_for_a_float_is_a_bad_message_not_a_crash() -> None:
    session = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"))
    frame = '{"text": "Hi. ", "context_id": "a", "voice_settings": {"speed": ' + "1" * 400 + "}}"
    (error,) = _frames(session.receive_frame(frame, 0.0))
    assert error["error"] == "bad_message"
    assert "voice_settings.speed must be a finite number" in error["message"]


def test_a_socket_waiting_for_its_key_is_closed_at_the_deadline_with_the_vendors_error() -> None:
    def authorize(key: str | None) -> None:
        raise AssertionError("no frame came, so no key was checked")

    session = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"),
                    Limits(auth_timeout_s=5.0), authorize=authorize)
    assert session.next_wakeup() == 5.0  # the timer wakes the session for it
    assert session.tick(4.9) == []
    actions = session.tick(5.0)
    (error,) = _frames(actions)
    assert (error["error"], error["code"]) == ("unauthorized", 1008)
    assert error["message"] == "a valid API key is required within 5 s of connecting; none came"
    assert [(a.code, a.reason) for a in actions if isinstance(a, Close)] == [(1008, "unauthorized")]
    assert session.tick(6.0) == [] and session.next_wakeup() is None  # said once


def test_a_socket_whose_key_came_has_no_deadline_and_one_keyed_at_the_handshake_had_none() -> None:
    accepted = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"),
                     Limits(auth_timeout_s=5.0), authorize=lambda key: None)
    accepted.receive_frame(json.dumps({"text": " ", "xi_api_key": "good-key-123"}), 1.0)
    assert accepted.tick(60.0) == [] and accepted.next_wakeup() is None
    keyed = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"),
                  Limits(auth_timeout_s=5.0))
    assert keyed.tick(60.0) == [] and keyed.next_wakeup() is None


def test_the_url_voice_of_a_first_message_key_is_resolved_in_that_keys_tenant() -> None:
    from gateway.access.keys import Principal

    alice, bob = Principal("a" * 32), Principal("b" * 32)
    catalog = VoiceCatalog({"joe", "alice-voice"}, owners={"alice-voice": alice.tenant})

    def session_for(tenant: Principal) -> ElevenLabsMultiSession:
        view = catalog.view(Principal(""))  # no key yet: the shared voices only
        session = ElevenLabsMultiSession(
            "s1", catalog=view, sample_rate=RATE, options=SessionOptions(voice="joe"),
            limits=Limits(),
            output=parse_output_format("pcm_16000"), admit=lambda key: None,
            release=lambda key: None,
            authorize=lambda key: view.rekey(tenant))  # the endpoint's: admission, then this view
        session.pending_voice = "alice-voice"
        session.start(0.0)
        return session

    first = {"text": "Hello there. ", "context_id": "a", "xi_api_key": "any-key-123", "flush": True}
    refused = session_for(bob).receive_frame(json.dumps(first), 0.0)
    (error,) = _frames(refused)
    assert (error["error"], error["message"]) == ("unknown_voice",
                                                  unknown_voice_message("alice-voice"))
    assert any(isinstance(a, Close) and a.code == 1008 for a in refused) and not _submits(refused)
    spoken = _submits(session_for(alice).receive_frame(json.dumps(first), 0.0))
    assert spoken and {s.request.voice for s in spoken} == {"alice-voice"}
    assert catalog.num_holders("alice-voice") >= 1


def _english_catalog_session(caplog: pytest.LogCaptureFixture) -> Any:
    from gateway.text.routing import Languages

    languages = Languages.from_listing(
        lambda: [VoiceInfo("joe", "joe", "en", "piper", RATE, languages=("en",))], {})
    session = ElevenLabsMultiSession("s1", catalog=VoiceCatalog({"joe"}), sample_rate=RATE,
                                     options=SessionOptions(voice="joe"), limits=Limits(),
                                     output=parse_output_format("pcm_16000"),
                                     admit=lambda key: None, release=lambda key: None,
                                     languages=languages)
    session.start(0.0)
    caplog.set_level("INFO", logger="voxgate.gateway")
    return session


def test_a_vendor_context_says_what_it_skipped_in_one_log_line_with_counts_not_text(
        caplog: pytest.LogCaptureFixture) -> None:
    session = _english_catalog_session(caplog)
    text = "Hello there. " + "Привет. " * 300 + "中。" * 200 + "Goodbye now. "
    actions = session.receive_frame(json.dumps({"text": text, "context_id": "a"}), 0.0)
    actions += session.receive_frame(json.dumps({"context_id": "a", "flush": True}), 0.0)
    actions += session.receive_frame(json.dumps({"context_id": "a", "close_context": True}), 0.0)
    for submit in _submits(actions):
        session.receive_audio(_chunk(submit, 0.2, is_last=True), 0.1)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert lines == [("session s1 (elevenlabs): skipped 2100 characters of und-Cyrl in 300 "
                      "pieces, 400 characters of zh in 200 pieces: no voice for it")]


def test_a_vendor_context_holds_no_more_state_however_many_flush_groups_it_speaks() -> None:
    session = _make(ElevenLabsMultiSession, parse_output_format("pcm_16000"))
    for n in range(200):  # each flush ends a native context; the vendor context goes on
        actions = session.receive_frame(json.dumps(
            {"text": f"Sentence {n} is here. ", "context_id": "a", "flush": True}), float(n))
        (submit,) = _submits(actions)
        assert _frames(session.receive_audio(_chunk(submit, 0.1, is_last=True), n + 0.5))
    vctx = session.vendor_contexts["a"]
    values = {f.name: getattr(vctx, f.name) for f in dataclasses.fields(vctx)}
    held = {name: len(value) for name, value in values.items()
            if hasattr(value, "__len__") and not isinstance(value, str)}
    assert held and max(held.values()) == 0, held  # nothing kept per native context that ended
    assert vctx.num_segments == 200 and session.num_open_contexts == 0
