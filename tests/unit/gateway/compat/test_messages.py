"""Vendor frames decoded once into typed messages: lenient keys where the vendor is, strict
where it is (docs/compat.md, "Keys"), every field we read checked for its type."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.compat.formats import OutputFormat
from gateway.compat.messages import (
    CartesiaMessage,
    DeepgramClear,
    DeepgramSpeak,
    ElevenLabsMessage,
    decode_cartesia,
    decode_deepgram,
    decode_elevenlabs,
)
from gateway.errors import ProtocolError


def test_elevenlabs_frames_ignore_the_fields_voxgate_does_not_use() -> None:
    frame = {"text": "Hi. ", "context_id": "a", "flush": True, "try_trigger_generation": True,
             "generation_config": {"chunk_length_schedule": [50]}, "voice_settings":
             {"speed": 3.0, "stability": 0.5}, "xi_api_key": "k-123", "model_id": "eleven_flash"}
    assert decode_elevenlabs(frame, is_multi=True) == ElevenLabsMessage(
        "a", "Hi. ", flush=True, speed=2.0, key="k-123")  # the speed clamped to voxgate's
    assert decode_elevenlabs({"text": " ", "context_id": 5}, is_multi=False).context_id == ""
    assert decode_elevenlabs({"authorization": "Bearer k-9"}, is_multi=True).key == "k-9"


@pytest.mark.parametrize(("frame", "words"), [
    ({"text": 42, "context_id": "a"}, "text must be a string, got int"),
    ({"text": "Hi", "flush": "yes"}, "flush must be a boolean, got str"),
    ({"close_context": 1}, "close_context must be a boolean, got int"),
    ({"voice_settings": [1.0]}, "voice_settings must be an object, got list"),
    ({"context_id": ""}, "context_id must be a string of 1-256 characters"),
])
def test_an_elevenlabs_field_of_the_wrong_type_is_a_bad_message(frame: dict[str, Any],
                                                                words: str) -> None:
    with pytest.raises(ProtocolError, match=words) as caught:
        decode_elevenlabs(frame, is_multi=True)
    assert caught.value.code == "bad_message"


def test_cartesia_frames_ignore_unknown_fields_and_parse_voice_and_format_once() -> None:
    frame = {"context_id": "c", "model_id": "sonic-2", "language": "en", "transcript": "Hi.",
             "voice": {"mode": "id", "id": "joe"}, "continue": True, "speed": "normal",
             "output_format": {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 44100}}
    assert decode_cartesia(frame) == CartesiaMessage(
        "c", transcript="Hi.", is_continued=True, voice="joe",
        output=OutputFormat("pcm_f32le", 44100))
    assert decode_cartesia({"context_id": "c", "cancel": True, "transcript": 5}).is_cancel


@pytest.mark.parametrize(("frame", "code", "words"), [
    ({"transcript": "Hi."}, "bad_message", "context_id must be a string of 1-256"),
    ({"context_id": "c", "transcript": 5}, "bad_message", "transcript must be a string"),
    ({"context_id": "c", "continue": "no"}, "bad_message", "continue must be a boolean"),
    ({"context_id": "c", "voice": {"mode": "embedding"}}, "unsupported_option", "embeddings"),
    ({"context_id": "c", "output_format": "raw"}, "bad_message", "must be an object"),
    ({"context_id": "c", "max_buffer_delay_ms": -1}, "bad_message", "integer >= 0"),
])
def test_a_cartesia_field_of_the_wrong_type_names_its_context(frame: dict[str, Any], code: str,
                                                              words: str) -> None:
    with pytest.raises(ProtocolError, match=words) as caught:
        decode_cartesia(frame)
    assert caught.value.code == code
    assert caught.value.context_id == frame.get("context_id")


def test_deepgram_frames_are_decoded_whole_and_an_unknown_field_is_refused() -> None:
    assert decode_deepgram({"type": "Speak", "text": "Hi."}) == DeepgramSpeak("Hi.")
    assert decode_deepgram({"type": "Clear"}) == DeepgramClear()
    with pytest.raises(ProtocolError, match="unknown field 'speed' in 'Speak'; expected text"):
        decode_deepgram({"type": "Speak", "text": "Hi.", "speed": 1.2})
    with pytest.raises(ProtocolError, match="unknown field 'text' in 'Flush'; expected no field"):
        decode_deepgram({"type": "Flush", "text": "x"})
    with pytest.raises(ProtocolError, match="unknown message type 'Shout'"):
        decode_deepgram({"type": "Shout"})
    with pytest.raises(ProtocolError, match="Speak needs a string field 'text'"):
        decode_deepgram({"type": "Speak"})
