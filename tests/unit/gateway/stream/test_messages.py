"""Client messages: a frame decoded once, with strict keys, into its frozen message, or refused."""

from __future__ import annotations

import json

import msgpack
import pytest

from gateway.errors import ProtocolError
from gateway.stream.messages import (
    CancelMessage,
    CloseMessage,
    FlushMessage,
    PlaybackMessage,
    SessionUpdate,
    TextMessage,
    context_id_of,
    decode_frame,
    decode_message,
    optional_ms,
)


def refusal(call, *args, **kwargs) -> ProtocolError:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError) as caught:
        call(*args, **kwargs)
    return caught.value


def decoded(message: dict) -> object:
    return decode_message(json.dumps(message), 65536)


def test_json_and_msgpack_frames_decode_to_the_same_message() -> None:
    message = {"type": "text", "context_id": "c1", "text": "Hi there.", "flush": True}
    assert decode_message(json.dumps(message), 1000) == TextMessage("c1", "Hi there.", flush=True)
    assert decode_message(msgpack.packb(message), 1000) == TextMessage(
        "c1", "Hi there.", flush=True)


def test_each_message_type_decodes_to_its_typed_message() -> None:
    assert decoded({"type": "text", "context_id": "c", "text": "Hi"}) == TextMessage("c", "Hi")
    assert decoded({"type": "flush", "context_id": "c"}) == FlushMessage("c")
    assert decoded({"type": "cancel"}) == CancelMessage()
    assert decoded({"type": "cancel", "context_id": "c", "played_ms": 250}) == CancelMessage(
        "c", 250.0)
    assert decoded({"type": "playback", "context_id": "c", "played_ms": 9.5}) == PlaybackMessage(
        "c", 9.5)
    assert decoded({"type": "close"}) == CloseMessage()
    update = decoded({"type": "session.update", "speed": 1.5, "codec": "pcm16"})
    assert update == SessionUpdate({"speed": 1.5, "codec": "pcm16"})


def test_a_misspelt_field_is_refused_naming_it_and_the_fields_expected() -> None:
    error = refusal(decoded, {"type": "text", "context_id": "c", "text": "Hi.", "flsh": True})
    assert error.code == "bad_message"
    assert error.message == "unknown field 'flsh' in 'text'; expected context_id, text, flush"
    assert error.context_id == "c"  # the error is routed to the context it came for
    closing = refusal(decoded, {"type": "close", "now": True})
    assert "unknown field 'now' in 'close'; expected no field besides 'type'" in closing.message
    assert "expected context_id, played_ms" in refusal(decoded,
                                                       {"type": "cancel", "id": "c"}).message


def test_an_unknown_option_in_an_update_is_unsupported_and_lists_the_options() -> None:
    error = refusal(decoded, {"type": "session.update", "sped": 1.5})
    assert error.code == "unsupported_option"
    assert "unknown option 'sped'; expected one of voice" in error.message


def test_an_unknown_type_lists_the_types() -> None:
    error = refusal(decoded, {"type": "speak"})
    assert error.code == "bad_message"
    assert "expected one of session.update, text, flush" in error.message


@pytest.mark.parametrize(("raw", "code", "words"), [
    ("x" * 2000, "message_too_large", "2000 bytes; the limit is 1000"),
    ("{not json", "bad_message", "not valid JSON"),
    (b"\xc1", "bad_message", "not valid msgpack"),
    ("[1, 2]", "bad_message", "must be an object, got list"),
    ('{"context_id": "c"}', "bad_message", "string field 'type'"),
])
def test_a_bad_frame_is_refused_with_what_was_expected(raw: str | bytes, code: str,
                                                       words: str) -> None:
    error = refusal(decode_message, raw, 1000)
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
    update = refusal(decode_message,
                     msgpack.packb({"type": "session.update", "speed": float("nan")}), 100)
    assert update.code == "bad_message" and "speed must be a finite number" in update.message


def test_the_size_limit_counts_utf8_bytes_not_characters() -> None:
    text = json.dumps({"type": "text", "text": "é" * 40}, ensure_ascii=False)
    assert len(text) < 100 and refusal(decode_frame, text, 100).code == "message_too_large"


def test_context_ids_are_checked_for_type_and_charset() -> None:
    assert context_id_of({"type": "flush", "context_id": "a.b:c-1_2"}, required=True) == "a.b:c-1_2"
    assert context_id_of({"type": "cancel"}, required=False) is None
    assert refusal(context_id_of, {"type": "flush"}, required=True).code == "bad_message"
    assert refusal(context_id_of, {"type": "flush", "context_id": 7},
                   required=True).code == "bad_message"
    bad = refusal(context_id_of, {"type": "flush", "context_id": "no spaces"}, required=True)
    assert bad.code == "bad_context_id" and "got 'no spaces'" in bad.message


def test_text_fields_are_checked_and_the_text_error_names_its_context() -> None:
    wrong = refusal(decoded, {"type": "text", "context_id": "c", "text": 5})
    assert wrong.context_id == "c" and "got int" in wrong.message
    assert "boolean" in refusal(decoded, {"type": "text", "context_id": "c", "text": "",
                                          "flush": "yes"}).message
    assert "needs a number field 'played_ms'" in refusal(decoded, {"type": "playback",
                                                                   "context_id": "c"}).message


def test_optional_ms_takes_numbers_and_refuses_negatives_and_booleans() -> None:
    assert optional_ms({"played_ms": 250}, "played_ms") == 250.0
    assert optional_ms({}, "played_ms") is None
    assert "must be >= 0" in refusal(optional_ms, {"played_ms": -1}, "played_ms").message
    assert "got bool" in refusal(optional_ms, {"played_ms": True}, "played_ms").message


def test_messages_are_frozen() -> None:
    message = TextMessage("c", "Hi")
    with pytest.raises(AttributeError):
        message.text = "changed"  # type: ignore[misc]
