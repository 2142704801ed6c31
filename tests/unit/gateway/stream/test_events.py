"""Server events: each spells its wire fields once (`to_wire`), and is encoded in the session's
encoding."""

from __future__ import annotations

import base64
import json

import msgpack
import pytest

from engine.types import WordTiming
from gateway.errors import ErrorEvent
from gateway.stream.events import (
    PROTOCOL_VERSION,
    AudioEvent,
    Cancelled,
    ContextDone,
    SegmentEvent,
    SessionReady,
    SessionUpdated,
    encode_audio,
    encode_event,
)
from gateway.stream.options import Limits, SessionOptions


def test_session_ready_and_updated_carry_the_wire_options() -> None:
    ready = SessionReady("s1", SessionOptions(voice="ada"), Limits(max_open_contexts=3)).to_wire()
    assert ready["type"] == "session.ready" and ready["protocol"] == PROTOCOL_VERSION
    assert ready["options"]["voice"] == "ada" and ready["limits"]["max_open_contexts"] == 3
    assert SessionUpdated(SessionOptions(speed=1.5)).to_wire()["options"]["speed"] == 1.5


def test_segment_rounds_its_times_and_lists_words_when_known() -> None:
    event = SegmentEvent("c", 2, "Hi there.", 1234.5678, 456.789,
                         [WordTiming("Hi", 0.04, 120.06),
                          WordTiming("there.", 120.06, 456.7)]).to_wire()
    assert event["pts_ms"] == 1234.6 and event["duration_ms"] == 456.8
    assert event["words"] == [{"word": "Hi", "start_ms": 0.0, "end_ms": 120.1},
                              {"word": "there.", "start_ms": 120.1, "end_ms": 456.7}]
    unknown = SegmentEvent("c", 0, "Hi.", 0.0, None, None).to_wire()
    assert unknown["duration_ms"] is None and unknown["words"] is None


def test_audio_carries_opus_packets_as_a_list_and_pcm_joined() -> None:
    opus = AudioEvent("c", 3, 60.00049, 40.0, "opus", (b"ab", b"cd")).to_wire()
    assert opus["packets"] == [b"ab", b"cd"] and "data" not in opus and opus["pts_ms"] == 60.0
    pcm = AudioEvent("c", 0, 0.0, 40.0, "pcm16", (b"ab", b"cd"))
    assert pcm.data == b"abcd" and pcm.to_wire()["data"] == b"abcd"
    assert "packets" not in pcm.to_wire()


def test_cancelled_rounds_what_was_sent_and_keeps_nones_for_a_closed_context() -> None:
    heard = Cancelled("c", 1234.56, 800.0, "Hello", "there").to_wire()
    assert heard == {"type": "cancelled", "context_id": "c", "audio_ms_sent": 1234.6,
                     "played_ms": 800.0, "spoken_text": "Hello", "unspoken_text": "there"}
    closed = Cancelled("c", None, None, None, None).to_wire()
    assert closed["audio_ms_sent"] is None and closed["spoken_text"] is None


def test_context_done_reports_audio_and_segments() -> None:
    assert ContextDone("c", 987.654, 3).to_wire() == {"type": "context.done", "context_id": "c",
                                                      "audio_ms": 987.7, "segments": 3}


def test_a_reply_never_contains_nan() -> None:
    with pytest.raises(ValueError):
        encode_event(Cancelled("c", 1.0, float("nan"), None, None), "json")


def test_events_follow_the_session_encoding_and_audio_is_binary_unless_base64_is_asked() -> None:
    event = ContextDone("c", 1.0, 1)
    assert json.loads(encode_event(event, "json")) == event.to_wire()
    assert msgpack.unpackb(encode_event(event, "msgpack")) == event.to_wire()
    error = ErrorEvent("bad_message", "no", "c")
    assert json.loads(encode_event(error, "json"))["type"] == "error"
    audio = AudioEvent("c", 0, 0.0, 20.0, "opus", (b"\x01\x02",))
    binary = encode_audio(audio, SessionOptions())
    assert isinstance(binary, bytes) and msgpack.unpackb(binary)["packets"] == [b"\x01\x02"]
    text = encode_audio(audio, SessionOptions(audio_as="base64"))
    assert isinstance(text, str)
    assert base64.b64decode(json.loads(text)["packets"][0]) == b"\x01\x02"
    pcm = AudioEvent("c", 0, 0.0, 20.0, "pcm16", (b"\x00\x01",))
    assert json.loads(encode_audio(pcm, SessionOptions(audio_as="base64")))["data"] == "AAE="
