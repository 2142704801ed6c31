"""Session options and limits: updates and query strings checked, rates limited with the time passed
in."""

from __future__ import annotations

import pytest

from gateway.errors import ProtocolError
from gateway.stream.options import (
    OPTION_NAMES,
    SessionOptions,
    TokenBucket,
    apply_update,
    check_option,
    options_from_query,
)


def refusal(call, *args, **kwargs) -> ProtocolError:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError) as caught:
        call(*args, **kwargs)
    return caught.value


def test_numbers_too_large_for_a_float_are_refused_where_a_number_goes() -> None:
    huge = int("9" * 400)
    error = refusal(apply_update, SessionOptions(), {"speed": huge}, {"joe"})
    assert error.code == "bad_message" and "speed must be a finite number" in error.message
    assert refusal(apply_update, SessionOptions(), {"speed": float("inf")},
                   {"joe"}).code == "bad_message"
    error = refusal(apply_update, SessionOptions(), {"bitrate": huge}, {"joe"})
    assert error.code == "unsupported_option"


def test_an_update_may_only_choose_a_listed_voice() -> None:
    options = apply_update(SessionOptions(), {"voice": "ada"}, {"joe", "ada"})
    assert options.voice == "ada"
    error = refusal(apply_update, SessionOptions(), {"voice": "zed"}, {"joe", "ada"})
    assert error.code == "unknown_voice" and "unknown voice 'zed'" in error.message
    assert "joe" not in error.message  # the voices a caller may use are listed by GET /v1/voices


@pytest.mark.parametrize(("fields", "words"), [
    ({"speed": 2.5}, "speed must be within 0.5-2.0, got 2.5"),
    ({"bitrate": 1000}, "bitrate must be within 6000-510000, got 1000"),
    ({"codec": "flac"}, "codec must be one of opus, pcm16, mulaw; got 'flac'"),
    ({"sample_rate": 44100}, "sample_rate must be one of 48000, 24000, 16000, 8000"),
    ({"frame_ms": 25}, "frame_ms must be one of 20, 40, 60"),
    ({"max_buffer_delay_ms": 70000}, "within 0-60000"),
    ({"frames_per_message": 0}, "frames_per_message must be within 1-50, got 0"),
    ({"frames_per_message": 51}, "frames_per_message must be within 1-50, got 51"),
    ({"volume": 3}, "unknown option 'volume'; expected one of voice, language"),
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


def test_every_option_on_the_wire_is_one_an_update_may_set() -> None:
    wire = SessionOptions().to_wire()
    assert tuple(wire) == OPTION_NAMES
    for name, value in wire.items():
        assert check_option(name, value) == value


def test_query_options_arrive_as_text_and_are_checked_like_an_update() -> None:
    options = options_from_query({"codec": "pcm16", "sample_rate": "16000", "speed": "1.5",
                                  "voice": "ada", "api_key": "ignored"}, SessionOptions(),
                                 {"joe", "ada"})
    assert (options.codec, options.sample_rate, options.speed, options.voice) == (
        "pcm16", 16000, 1.5, "ada")
    with pytest.raises(ProtocolError, match="sample_rate must be a number, got 'fast'"):
        options_from_query({"sample_rate": "fast"}, SessionOptions(), {"joe"})
    assert refusal(options_from_query, {"voice": "zed"}, SessionOptions(),
                   {"joe"}).code == "unknown_voice"


def test_a_token_bucket_allows_a_burst_then_refills_with_the_time_passed_in() -> None:
    bucket = TokenBucket(rate=10.0, capacity=20.0)
    assert bucket.take(20, now=0.0)
    assert not bucket.take(1, now=0.0)
    assert bucket.take(5, now=0.5)  # 0.5 s at 10/s
    assert not bucket.take(1, now=0.5)
