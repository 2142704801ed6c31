"""The client's frames and errors: decoded once into typed events, every code its exception."""

from __future__ import annotations

import base64
import json
import random

import msgpack
import pytest

from voxgate_client import Busy, ContextClosed, RateLimited, ServerError, Unauthorized
from voxgate_client.backoff import Reconnect, backoff_s, retry_advice_s
from voxgate_client.errors import server_error
from voxgate_client.session import stream_url
from voxgate_client.wire import (
    Audio,
    BadFrame,
    Cancelled,
    Done,
    Error,
    Ready,
    Segment,
    TextSkipped,
    decode,
    encode,
)


def test_binary_audio_decodes_to_its_packets_and_json_audio_from_base64() -> None:
    wire = {"type": "audio", "context_id": "t1", "seq": 3, "pts_ms": 60.0, "duration_ms": 20.0,
            "codec": "opus", "packets": [b"\x01\x02", b"\x03"]}
    audio = decode(msgpack.packb(wire), 7.5)
    assert audio == Audio("t1", 3, 60.0, 20.0, "opus", [b"\x01\x02", b"\x03"], None, 7.5)
    as_json = {**wire, "codec": "pcm16", "packets": None,
               "data": base64.b64encode(b"\x00\x01").decode()}
    del as_json["packets"]
    pcm = decode(json.dumps(as_json), 8.0)
    assert isinstance(pcm, Audio) and pcm.data == b"\x00\x01" and pcm.packets is None


def test_segment_word_timings_become_relative_to_the_turn() -> None:
    frame = json.dumps({"type": "segment", "context_id": "t1", "segment_id": 1, "text": "Hi there.",
                        "pts_ms": 1000.0, "duration_ms": 500.0,
                        "words": [{"word": "Hi", "start_ms": 0.0, "end_ms": 200.0},
                                  {"word": "there.", "start_ms": 200.0, "end_ms": 480.0}]})
    segment = decode(frame, 1.0)
    assert isinstance(segment, Segment) and segment.words is not None
    assert [(w.word, w.start_ms, w.end_ms) for w in segment.words] == [
        ("Hi", 1000.0, 1200.0), ("there.", 1200.0, 1480.0)]


def test_every_event_type_decodes_and_an_unknown_one_is_skipped() -> None:
    events = [
        ({"type": "session.ready", "session_id": "s", "protocol": 1, "options": {"voice": "joe"},
          "limits": {}}, Ready),
        ({"type": "text.skipped", "context_id": "t", "segment_id": 2, "offset": None, "text": "王",
          "reason": "language_unsupported", "language": "zh"}, TextSkipped),
        ({"type": "context.done", "context_id": "t", "audio_ms": 10.0, "segments": 1}, Done),
        ({"type": "cancelled", "context_id": None, "audio_ms_sent": 1.0, "played_ms": None,
          "spoken_text": "", "unspoken_text": ""}, Cancelled),
        ({"type": "error", "code": "busy", "message": "full", "context_id": "t", "fatal": False},
         Error),
    ]
    for wire, kind in events:
        assert isinstance(decode(json.dumps(wire), 0.0), kind)
    assert decode(json.dumps({"type": "something.new", "x": 1}), 0.0) is None


@pytest.mark.parametrize("frame", ["not json", json.dumps({"no": "type"}), b"\xc1",
                                   msgpack.packb({"type": "audio", "context_id": "t"})])
def test_an_unreadable_frame_is_a_bad_frame(frame: str | bytes) -> None:
    with pytest.raises(BadFrame, match="unreadable server frame"):
        decode(frame, 0.0)


def test_client_messages_encode_as_msgpack_or_json() -> None:
    message = {"type": "text", "context_id": "t1", "text": "héllo"}
    assert msgpack.unpackb(encode(message, True)) == message
    assert encode(message, False) == '{"type":"text","context_id":"t1","text":"héllo"}'


def test_error_codes_map_to_their_exceptions() -> None:
    def error(code: str) -> ServerError:
        return server_error({"code": code, "message": "m", "context_id": "t", "fatal": False},
                            retry_after_s=2.5)

    assert type(error("busy")) is Busy and error("busy").retry_after_s == 2.5
    assert type(error("rate_limited")) is RateLimited and isinstance(error("rate_limited"), Busy)
    assert type(error("unauthorized")) is Unauthorized
    assert type(error("context_closed")) is ContextClosed
    other = error("text_too_long")
    assert type(other) is ServerError and other.code == "text_too_long" and other.context_id == "t"
    assert str(other) == "text_too_long: m"


def test_backoff_is_full_jitter_within_a_capped_doubling_window() -> None:
    rng = random.Random(4)
    for attempt, window in [(0, 0.5), (1, 1.0), (3, 4.0), (10, 30.0), (500, 30.0)]:
        delays = [backoff_s(attempt, 0.5, 30.0, rng) for _ in range(400)]
        assert 0.0 <= min(delays) and max(delays) <= window
        assert max(delays) > 0.8 * window and min(delays) < 0.2 * window  # spread over it
    policy = Reconnect(base_s=1.0, max_s=8.0, rng=random.Random(1))
    assert all(0.0 <= policy.delay_s(n) <= min(8.0, 2.0**n) for n in range(20))
    with pytest.raises(ValueError, match="max_attempts"):
        Reconnect(max_attempts=0)


def test_busy_advice_grows_with_the_streak_and_is_never_immediate() -> None:
    rng = random.Random(2)
    for streak, (low, high) in [(1, (0.5, 1.0)), (2, (1.0, 2.0)), (4, (4.0, 8.0)),
                                (50, (15.0, 30.0))]:
        assert all(low <= retry_advice_s(streak, rng) <= high for _ in range(200))


def test_the_stream_url_takes_http_or_ws_bases_and_keeps_their_query() -> None:
    assert stream_url("http://127.0.0.1:8000", {"codec": "pcm16"}) == (
        "ws://127.0.0.1:8000/v1/stream?codec=pcm16")
    assert stream_url("wss://h/v1/stream?x=1", {"sample_rate": 24000}) == (
        "wss://h/v1/stream?x=1&sample_rate=24000")
    with pytest.raises(ValueError, match="expected a ws"):
        stream_url("ftp://h", {})
