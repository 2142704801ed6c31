"""Wire messages: client frames parsed and checked, server events built and encoded."""

from __future__ import annotations

import base64
import json

import msgpack
import pytest

from engine.types import WordTiming
from gateway.errors import ProtocolError
from gateway.stream import messages
from gateway.stream.messages import (
    Limits,
    SessionOptions,
    TokenBucket,
    apply_update,
    context_id_of,
    decode_frame,
    encode_audio,
    encode_event,
    optional_ms,
    text_fields,
)


def refusal(call, *args, **kwargs) -> ProtocolError:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError) as caught:
        call(*args, **kwargs)
    return caught.value


def test_json_and_msgpack_frames_decode_to_the_same_message() -> None:
    message = {"type": "text", "context_id": "c1", "text": "Hi there.", "flush": True}
    assert decode_frame(json.dumps(message), 1000) == message
    assert decode_frame(msgpack.packb(message), 1000) == message


@pytest.mark.parametrize(("raw", "code", "words"), [
    ("x" * 2000, "message_too_large", "2000 bytes; the limit is 1000"),
    ("{not json", "bad_message", "not valid JSON"),
    (b"\xc1", "bad_message", "not valid msgpack"),
    ("[1, 2]", "bad_message", "must be an object, got list"),
    ('{"context_id": "c"}', "bad_message", "string field 'type'"),
])
def test_a_bad_frame_is_refused_with_what_was_expected(raw: str | bytes, code: str, words: str) -> None:
    error = refusal(decode_frame, raw, 1000)
    assert error.code == code and words in error.message


@pytest.mark.parametrize(("raw", "words"), [
    ("[" * 3000 + "]" * 3000, "recursion"),
    ('{"type": "cancel", "played_ms": NaN}', "NaN is not a JSON number"),
    ('{"type": "cancel", "played_ms": Infinity}', "Infinity is not a JSON number"),
    ('{"type": "cancel", "played_ms": -Infinity}', "-Infinity is not a JSON number"),
    ('{"type": "cancel", "played_ms": 1e400}', "out of range"),
])
def test_deep_nesting_and_non_finite_numbers_are_bad_frames(raw: str, words: str) -> None:
    error = refusal(decode_frame, raw, 65536)
    assert error.code == "bad_message" and words in error.message


def test_a_msgpack_frame_nested_too_deep_is_a_bad_frame() -> None:
    raw = b"\x91" * 3000 + b"\xc0"  # 3,000 one-element arrays around nil
    assert refusal(decode_frame, raw, 65536).code == "bad_message"


def test_numbers_too_large_for_a_float_are_refused_where_a_number_goes() -> None:
    huge = int("9" * 400)
    assert "finite number" in refusal(optional_ms, {"played_ms": huge}, "played_ms").message
    assert "finite number" in refusal(optional_ms, {"played_ms": float("nan")}, "played_ms").message
    error = refusal(apply_update, SessionOptions(), {"speed": huge}, {"joe"})
    assert error.code == "bad_message" and "speed must be a finite number" in error.message
    assert refusal(apply_update, SessionOptions(), {"speed": float("inf")}, {"joe"}).code == "bad_message"
    assert refusal(apply_update, SessionOptions(), {"bitrate": huge}, {"joe"}).code == "unsupported_option"


def test_a_reply_never_contains_nan() -> None:
    with pytest.raises(ValueError):
        encode_event({"type": "cancelled", "played_ms": float("nan")}, "json")


def test_the_size_limit_counts_utf8_bytes_not_characters() -> None:
    text = json.dumps({"type": "text", "text": "é" * 40}, ensure_ascii=False)
    assert len(text) < 100 and refusal(decode_frame, text, 100).code == "message_too_large"


def test_context_ids_are_checked_for_type_and_charset() -> None:
    assert context_id_of({"type": "flush", "context_id": "a.b:c-1_2"}, required=True) == "a.b:c-1_2"
    assert context_id_of({"type": "cancel"}, required=False) is None
    assert refusal(context_id_of, {"type": "flush"}, required=True).code == "bad_message"
    assert refusal(context_id_of, {"type": "flush", "context_id": 7}, required=True).code == "bad_message"
    bad = refusal(context_id_of, {"type": "flush", "context_id": "no spaces"}, required=True)
    assert bad.code == "bad_context_id" and "got 'no spaces'" in bad.message


def test_text_fields_are_checked_and_the_text_error_names_its_context() -> None:
    assert text_fields({"type": "text", "context_id": "c", "text": "Hi"}) == ("c", "Hi", False)
    wrong = refusal(text_fields, {"type": "text", "context_id": "c", "text": 5})
    assert wrong.context_id == "c" and "got int" in wrong.message
    assert "boolean" in refusal(text_fields, {"type": "text", "context_id": "c", "text": "",
                                              "flush": "yes"}).message


def test_optional_ms_takes_numbers_and_refuses_negatives_and_booleans() -> None:
    assert optional_ms({"played_ms": 250}, "played_ms") == 250.0
    assert optional_ms({}, "played_ms") is None
    assert "must be >= 0" in refusal(optional_ms, {"played_ms": -1}, "played_ms").message
    assert "got bool" in refusal(optional_ms, {"played_ms": True}, "played_ms").message


def test_an_update_may_only_choose_a_listed_voice() -> None:
    options = apply_update(SessionOptions(), {"type": "session.update", "voice": "ada"}, {"joe", "ada"})
    assert options.voice == "ada"
    error = refusal(apply_update, SessionOptions(), {"voice": "zed"}, {"joe", "ada"})
    assert error.code == "unknown_voice" and "expected one of: ada, joe" in error.message


@pytest.mark.parametrize(("fields", "words"), [
    ({"speed": 2.5}, "speed must be within 0.5-2.0, got 2.5"),
    ({"bitrate": 1000}, "bitrate must be within 6000-510000, got 1000"),
    ({"codec": "flac"}, "codec must be one of opus, pcm16, mulaw; got 'flac'"),
    ({"sample_rate": 44100}, "sample_rate must be one of 48000, 24000, 16000, 8000"),
    ({"frame_ms": 25}, "frame_ms must be one of 20, 40, 60"),
    ({"max_buffer_delay_ms": 70000}, "within 0-60000"),
    ({"volume": 3}, "unknown option 'volume'"),
])
def test_an_update_out_of_range_is_unsupported_and_says_the_range(fields: dict, words: str) -> None:
    error = refusal(apply_update, SessionOptions(), fields, {"joe"})
    assert error.code == "unsupported_option" and words in error.message


def test_an_update_refuses_a_boolean_where_a_number_goes() -> None:
    error = refusal(apply_update, SessionOptions(), {"sample_rate": True}, {"joe"})
    assert error.code == "bad_message" and "got bool" in error.message


def test_an_update_keeps_the_old_options_and_mulaw_forces_8_khz() -> None:
    old = SessionOptions(speed=1.5)
    new = apply_update(old, {"codec": "mulaw", "sample_rate": 48000}, {"joe"})
    assert (new.codec, new.sample_rate, new.speed) == ("mulaw", 8000, 1.5)
    assert (old.codec, old.sample_rate) == ("opus", 48000)


def test_a_token_bucket_allows_a_burst_then_refills_with_the_time_passed_in() -> None:
    bucket = TokenBucket(rate=10.0, capacity=20.0)
    assert bucket.take(20, now=0.0)
    assert not bucket.take(1, now=0.0)
    assert bucket.take(5, now=0.5)  # 0.5 s at 10/s
    assert not bucket.take(1, now=0.5)


def test_session_ready_and_updated_carry_the_wire_options() -> None:
    ready = messages.session_ready("s1", SessionOptions(voice="ada"), Limits(max_open_contexts=3))
    assert ready["type"] == "session.ready" and ready["protocol"] == messages.PROTOCOL_VERSION
    assert ready["options"]["voice"] == "ada" and "extra" not in ready["options"]
    assert ready["limits"]["max_open_contexts"] == 3
    assert messages.session_updated(SessionOptions(speed=1.5))["options"]["speed"] == 1.5


def test_segment_rounds_its_times_and_lists_words_when_known() -> None:
    event = messages.segment("c", 2, "Hi there.", 1234.5678, 456.789,
                             [WordTiming("Hi", 0.04, 120.06), WordTiming("there.", 120.06, 456.7)])
    assert event["pts_ms"] == 1234.6 and event["duration_ms"] == 456.8
    assert event["words"] == [{"word": "Hi", "start_ms": 0.0, "end_ms": 120.1},
                              {"word": "there.", "start_ms": 120.1, "end_ms": 456.7}]
    unknown = messages.segment("c", 0, "Hi.", 0.0, None, None)
    assert unknown["duration_ms"] is None and unknown["words"] is None


def test_audio_carries_opus_packets_as_a_list_and_pcm_joined() -> None:
    opus = messages.audio("c", 3, 60.00049, 40.0, "opus", [b"ab", b"cd"])
    assert opus["packets"] == [b"ab", b"cd"] and "data" not in opus and opus["pts_ms"] == 60.0
    pcm = messages.audio("c", 0, 0.0, 40.0, "pcm16", [b"ab", b"cd"])
    assert pcm["data"] == b"abcd" and "packets" not in pcm


def test_cancelled_rounds_what_was_sent_and_keeps_nones_for_a_closed_context() -> None:
    heard = messages.cancelled("c", audio_ms_sent=1234.56, played_ms=800.0, spoken_text="Hello",
                               unspoken_text="there")
    assert heard == {"type": "cancelled", "context_id": "c", "audio_ms_sent": 1234.6,
                     "played_ms": 800.0, "spoken_text": "Hello", "unspoken_text": "there"}
    closed = messages.cancelled("c", audio_ms_sent=None, played_ms=None, spoken_text=None,
                                unspoken_text=None)
    assert closed["audio_ms_sent"] is None and closed["spoken_text"] is None


def test_context_done_reports_audio_and_segments() -> None:
    assert messages.context_done("c", 987.654, 3) == {"type": "context.done", "context_id": "c",
                                                      "audio_ms": 987.7, "segments": 3}


def test_events_follow_the_session_encoding_and_audio_is_binary_unless_base64_is_asked() -> None:
    event = {"type": "context.done", "context_id": "c", "audio_ms": 1.0, "segments": 1}
    assert json.loads(encode_event(event, "json")) == event
    assert msgpack.unpackb(encode_event(event, "msgpack")) == event
    audio = messages.audio("c", 0, 0.0, 20.0, "opus", [b"\x01\x02"])
    binary = encode_audio(audio, SessionOptions())
    assert isinstance(binary, bytes) and msgpack.unpackb(binary)["packets"] == [b"\x01\x02"]
    text = encode_audio(audio, SessionOptions(audio_as="base64"))
    assert isinstance(text, str)
    assert base64.b64decode(json.loads(text)["packets"][0]) == b"\x01\x02"
    pcm = messages.audio("c", 0, 0.0, 20.0, "pcm16", [b"\x00\x01"])
    assert json.loads(encode_audio(pcm, SessionOptions(audio_as="base64")))["data"] == "AAE="
