"""The sans-I/O session, driven synchronously: messages in, actions out, no socket, no clock."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.errors import BackendFailure, EngineBusyError
from engine.types import AudioChunk, WordTiming
from gateway.stream.events import AudioEvent
from gateway.stream.messages import CancelMessage, TextMessage
from gateway.stream.options import Limits, SessionOptions
from gateway.stream.session import Cancel, Close, Send, Session, Submit
from gateway.voices.catalog import VoiceCatalog

RATE = 22050


def make_session(**kwargs) -> Session:  # type: ignore[no-untyped-def]
    options = kwargs.pop("options", SessionOptions(codec="pcm16", sample_rate=24000))
    session = Session("s1", catalog=VoiceCatalog({"joe"}), sample_rate=RATE, options=options,
                      **kwargs)
    session.start(0.0)
    return session


def text(session: Session, context_id: str, value: str, now: float = 0.0,
         flush: bool = False) -> list:
    return session.receive_frame(json.dumps({"type": "text", "context_id": context_id,
                                             "text": value, "flush": flush}), now)


def sent(actions: list, kind: str | None = None) -> list[dict]:
    """The events sent, as their wire objects."""
    return [a.message.to_wire() for a in actions
            if isinstance(a, Send) and (kind is None or a.message.type == kind)]


def audio_of(actions: list) -> list[AudioEvent]:
    return [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, AudioEvent)]


def submits(actions: list) -> list:
    return [a.request for a in actions if isinstance(a, Submit)]


def chunk(request_id, seconds: float, words: list[WordTiming] | None = None) -> AudioChunk:  # type: ignore[no-untyped-def]
    pcm = (0.1 * np.sin(np.arange(int(RATE * seconds)) * 0.05)).astype(np.float32)
    return AudioChunk(request_id, pcm, RATE, is_last=True, words=words)


def test_session_ready_announces_options_and_limits() -> None:
    session = Session("abc", catalog=VoiceCatalog({"joe"}), sample_rate=RATE,
                      limits=Limits(max_open_contexts=3))
    ready = sent(session.start(0.0))[0]
    assert ready["type"] == "session.ready" and ready["protocol"] == 1
    assert ready["limits"]["max_open_contexts"] == 3
    assert ready["options"]["codec"] == "opus"


def test_segments_go_to_the_engine_in_order_with_where_they_play_and_no_time() -> None:
    # the engine times them (engine/clock.py): a context's segments play in the order submitted,
    # and a context opened while another still plays plays after it
    session = make_session()
    requests = submits(text(session, "c", "The first sentence is here. Second one follows. Third",
                            now=5.0))
    assert [r.text for r in requests] == ["The first sentence is here.", "Second one follows."]
    assert len({r.context_key for r in requests}) == 1
    assert [r.plays_after for r in requests] == ["", ""]
    (queued,) = submits(text(session, "d", "Another turn begins here. And", now=6.0))
    assert queued.context_key != requests[0].context_key
    assert queued.plays_after == requests[0].context_key


def test_audio_is_framed_in_order_and_context_done_follows_flush() -> None:
    session = make_session()
    r1, r2 = submits(text(session, "c", "One two three four. Five six seven. ", flush=True))
    # The second segment's audio arrives first: it must wait for the first.
    early = session.receive_audio(chunk(r2.request_id, 0.5), 0.1)
    assert sent(early, "audio") == [] and sent(early, "segment") == []
    actions = session.receive_audio(chunk(r1.request_id, 0.3), 0.2)
    segments = sent(actions, "segment")
    assert [s["segment_id"] for s in segments] == [0, 1]
    assert segments[1]["pts_ms"] == pytest.approx(300.0, abs=0.1)
    audio = audio_of(actions)
    assert [a.seq for a in audio] == list(range(len(audio)))
    assert sum(a.duration_ms for a in audio) == pytest.approx(800.0, abs=20.0)
    done = sent(actions, "context.done")
    assert done and done[0]["segments"] == 2


def test_contexts_play_one_after_another() -> None:
    session = make_session()
    (ra,) = submits(text(session, "a", "Context A speaks. ", flush=True))
    (rb,) = submits(text(session, "b", "Context B speaks. ", flush=True))
    held = session.receive_audio(chunk(rb.request_id, 0.2), 0.1)
    assert not audio_of(held)
    actions = session.receive_audio(chunk(ra.request_id, 0.2), 0.2)
    order = [a.context_id for a in audio_of(actions)]
    assert order == sorted(order) and set(order) == {"a", "b"}


def test_cancel_splits_heard_text_by_word_timings() -> None:
    session = make_session()
    r1, r2 = submits(text(session, "c", "Alpha beta gamma delta. Epsilon zeta. Eta", now=0.0))
    words = [WordTiming("Alpha", 0, 100), WordTiming("beta", 100, 200),
             WordTiming("gamma", 200, 250), WordTiming("delta.", 250, 300)]
    session.receive_audio(chunk(r1.request_id, 0.3, words), 0.1)
    actions = session.receive_frame(json.dumps({"type": "cancel", "context_id": "c",
                                                "played_ms": 210}), 0.3)
    cancelled = sent(actions, "cancelled")[0]
    assert cancelled["spoken_text"] == "Alpha beta"
    assert cancelled["unspoken_text"] == "gamma delta. Epsilon zeta. Eta"
    assert [a.request_id for a in actions if isinstance(a, Cancel)] == [r2.request_id]
    # Late audio and late text of the cancelled context produce nothing but one context_closed.
    assert session.receive_audio(chunk(r2.request_id, 0.2), 0.4) == []
    errors = sent(text(session, "c", "late tokens"), "error")
    assert errors[0]["code"] == "context_closed"
    assert sent(text(session, "c", "more late tokens")) == []


def test_cancelled_context_frees_its_slot_so_many_turns_never_leak() -> None:
    session = make_session(limits=Limits(max_open_contexts=2))
    for turn in range(500):
        text(session, f"t{turn}", "Some words. ")
        session.receive_frame(json.dumps({"type": "cancel", "context_id": f"t{turn}"}), 0.0)
    assert session.contexts == {}
    assert sent(text(session, "final", "Still works. "), "error") == []


def test_too_many_contexts_and_text_too_long_are_refused() -> None:
    session = make_session(limits=Limits(max_open_contexts=1, max_text_per_context=20))
    text(session, "a", "open")
    assert sent(text(session, "b", "second"), "error")[0]["code"] == "too_many_contexts"
    assert sent(text(session, "a", "x" * 30), "error")[0]["code"] == "text_too_long"
    assert sent(text(session, "a", " fine"), "error") == []


def test_busy_engine_refuses_a_context_when_its_first_segment_is_ready() -> None:
    def admit(key: str) -> None:
        raise EngineBusyError("full")

    session = make_session(admit=admit)
    actions = text(session, "a", "Hello there. ", flush=True)
    error = sent(actions, "error")[0]
    assert error["code"] == "busy" and error["context_id"] == "a"
    assert submits(actions) == [] and session.contexts == {}
    late = sent(text(session, "a", "more"), "error")  # a refused context is closed
    assert [e["code"] for e in late] == ["context_closed"]


def test_text_that_makes_no_segment_takes_no_engine_capacity() -> None:
    admitted: list[str] = []
    released: list[str] = []
    session = make_session(admit=admitted.append, release=released.append,
                           limits=Limits(max_open_contexts=17))
    for n in range(16):  # the hoarder of issue 21: "x" in sixteen contexts, never flushed
        assert sent(text(session, f"h{n}", "x"), "error") == []
    assert admitted == [] and len(session.contexts) == 16
    (request,) = submits(text(session, "t", "Now a whole sentence. ", flush=True))
    assert admitted == [request.context_key]
    session.receive_frame(json.dumps({"type": "cancel"}), 0.2)
    assert released == admitted  # only what was taken is given back


def test_a_refused_share_ends_that_context_only_with_rate_limited() -> None:
    from gateway.errors import ShareExceededError

    def admit(key: str) -> None:
        if key.endswith("/b"):
            raise ShareExceededError("over its share")

    session = make_session(admit=admit)
    text(session, "a", "First turn is here. And", now=0.0)
    actions = text(session, "b", "Second turn here. ", now=0.1, flush=True)
    assert [e["code"] for e in sent(actions, "error")] == ["rate_limited"]
    assert list(session.contexts) == ["a"]


def test_an_open_context_that_gets_no_text_is_flushed_after_the_context_idle_timeout() -> None:
    session = make_session(limits=Limits(context_idle_timeout_s=5.0))
    assert submits(text(session, "c", "an unfinished", now=1.0)) == []
    assert session.next_wakeup() == 6.0
    assert submits(session.tick(5.9)) == []
    (request,) = submits(session.tick(6.0))
    assert request.text == "an unfinished"
    done = session.receive_audio(chunk(request.request_id, 0.1), 6.1)
    assert sent(done, "context.done")[0]["context_id"] == "c"
    assert sent(text(session, "c", " more", now=6.2), "error")[0]["code"] == "context_closed"


def test_idle_counts_client_frames_not_open_contexts() -> None:
    session = make_session(limits=Limits(idle_timeout_s=10.0, context_idle_timeout_s=100.0))
    text(session, "c", "never finished", now=1.0)
    assert not session.is_idle(10.9)
    assert session.is_idle(11.0)  # an open context does not keep a silent socket alive
    session = make_session(limits=Limits(idle_timeout_s=10.0))
    (request,) = submits(text(session, "d", "Spoken. ", now=1.0, flush=True))
    assert not session.is_idle(30.0)  # a flushed context still speaking does
    session.receive_audio(chunk(request.request_id, 0.1), 30.0)
    assert session.is_idle(30.0)


def test_engine_failure_ends_only_its_context() -> None:
    session = make_session()
    (ra,) = submits(text(session, "a", "First context. ", flush=True))
    (rb,) = submits(text(session, "b", "Second context. ", flush=True))
    actions = session.receive_engine_error(ra.request_id, BackendFailure("boom"), 0.1)
    error = sent(actions, "error")[0]
    assert error["code"] == "internal" and error["context_id"] == "a"
    done = sent(session.receive_audio(chunk(rb.request_id, 0.2), 0.2), "context.done")
    assert done[0]["context_id"] == "b"


def test_realtime_pacing_keeps_a_bounded_lead() -> None:
    session = make_session(options=SessionOptions(codec="pcm16", sample_rate=24000,
                                                  pacing="realtime"))
    (r1,) = submits(text(session, "c", "A long segment of speech. ", flush=True))
    first = session.receive_audio(chunk(r1.request_id, 5.0), 10.0)
    sent_ms = sum(a.duration_ms for a in audio_of(first))
    assert 1500 <= sent_ms <= 1700
    assert session.next_wakeup() is not None
    later = session.tick(11.0)
    sent_ms += sum(a.duration_ms for a in audio_of(later))
    assert 2500 <= sent_ms <= 2700
    rest = session.tick(20.0)
    assert sent(rest, "context.done")


def test_close_finishes_open_contexts_then_closes_normally() -> None:
    session = make_session()
    assert submits(text(session, "c", "Goodbye")) == []
    actions = session.receive_frame(json.dumps({"type": "close"}), 0.0)
    (r2,) = submits(actions)
    assert not [a for a in actions if isinstance(a, Close)]
    final = session.receive_audio(chunk(r2.request_id, 0.2), 0.1)
    assert sent(final, "context.done") and isinstance(final[-1], Close) and final[-1].code == 1000


def test_session_update_changes_options_for_new_contexts() -> None:
    session = make_session()
    updated = sent(session.receive_frame(json.dumps({"type": "session.update", "speed": 1.5,
                                                     "pacing": "realtime"}), 0.0))[0]
    assert updated["type"] == "session.updated" and updated["options"]["speed"] == 1.5
    (request,) = submits(text(session, "c", "Faster now. ", flush=True))
    assert request.params.speed == 1.5


def test_cancel_after_all_audio_was_sent_still_splits_by_what_was_heard() -> None:
    session = make_session()
    (r1,) = submits(text(session, "c", "Alpha beta gamma. ", flush=True))
    words = [WordTiming("Alpha", 0, 100), WordTiming("beta", 100, 200),
             WordTiming("gamma.", 200, 300)]
    assert sent(session.receive_audio(chunk(r1.request_id, 0.3, words), 0.1), "context.done")
    session.receive_frame(json.dumps({"type": "playback", "context_id": "c", "played_ms": 150}),
                          0.2)
    cancelled = sent(session.receive_frame(json.dumps({"type": "cancel", "context_id": "c"}),
                                           0.3))[0]
    assert cancelled["spoken_text"] == "Alpha" and cancelled["unspoken_text"] == "beta gamma."
    # with no played_ms of its own, the answer says where it cut: the last playback report
    assert cancelled["played_ms"] == 150


def test_a_misspelt_flag_gets_bad_message_naming_it_and_flushes_nothing() -> None:
    session = make_session()
    text(session, "c", "An unfinished turn")
    frame = json.dumps({"type": "text", "context_id": "c", "text": " here.", "flsh": True})
    actions = session.receive_frame(frame, 0.1)
    (error,) = sent(actions, "error")
    assert error["code"] == "bad_message" and error["context_id"] == "c"
    assert error["message"] == "unknown field 'flsh' in 'text'; expected context_id, text, flush"
    assert submits(actions) == []  # the delta was dropped: nothing flushed, nothing spoken
    assert session.contexts["c"].segmenter.pending_text == "An unfinished turn"


def test_a_typed_message_takes_no_rate_token_and_a_frame_takes_one() -> None:
    session = make_session(limits=Limits(max_messages_per_s=1.0, burst_s=2.0))  # two tokens
    for n in range(10):  # typed messages (a vendor adapter's) are not counted again
        assert sent(session.receive_message(TextMessage(f"t{n}", "x"), 0.0), "error") == []
        session.receive_message(CancelMessage(f"t{n}"), 0.0)
    frame = json.dumps({"type": "cancel"})
    assert sent(session.receive_frame(frame, 0.0), "error") == []
    assert sent(session.receive_frame(frame, 0.0), "error") == []
    assert sent(session.receive_frame(frame, 0.0), "error")[0]["code"] == "rate_limited"


def test_a_typed_message_error_names_its_context() -> None:
    session = make_session(limits=Limits(max_text_per_context=5))
    (error,) = sent(session.receive_message(TextMessage("c", "far too long"), 0.0), "error")
    assert (error["code"], error["context_id"]) == ("text_too_long", "c")


def test_notes_say_where_each_segment_starts_and_when_its_timings_are_final() -> None:
    from gateway.stream.actions import SegmentFramed, SegmentStarted

    session = make_session()
    actions = text(session, "c", "One two three. Four five six. ", flush=True)
    r1, r2 = submits(actions)
    assert [a.context_id for a in actions if isinstance(a, Submit)] == ["c", "c"]
    words = [WordTiming("One", 0.0, 100.0), WordTiming("two", 100.0, 200.0),
             WordTiming("three.", 200.0, 400.0)]
    first = session.receive_audio(chunk(r1.request_id, 0.4, words), 0.1)
    second = session.receive_audio(chunk(r2.request_id, 0.3), 0.2)
    notes = [a for a in first + second if isinstance(a, (SegmentStarted, SegmentFramed))]
    assert notes == [
        SegmentStarted("c", 0, r1.request_id, 0.0),
        SegmentFramed("c", 0, "One two three.", 0.0, pytest.approx(400.0), tuple(words)),
        SegmentStarted("c", 1, r2.request_id, pytest.approx(400.0)),
        SegmentFramed("c", 1, "Four five six.", pytest.approx(400.0), pytest.approx(300.0), None),
    ]


def test_each_chunk_is_encoded_once_in_the_sessions_codec() -> None:
    from gateway.audio.encoders import EncoderFactory

    encoders = EncoderFactory()
    session = make_session(options=SessionOptions(codec="opus"), encoders=encoders)
    r1, r2 = submits(text(session, "c", "One two three. Four five six. ", flush=True))
    for request in (r1, r2):
        session.receive_audio(chunk(request.request_id, 0.2), 0.1)
    assert encoders.num_opened == {"opus": 1} and encoders.num_encodes == {"opus": 2}
