"""The error tree and the two constructors of what a client reads: `error_message`, `http_error`."""

from __future__ import annotations

import json

import pytest

from engine.errors import EngineBusyError, UnknownVoiceError, VoxgateError
from gateway.errors import ProtocolError, error_message, http_error
from gateway.voices.store import CorruptRecordError, RegistryError, VoiceExistsError
from gateway.voices.upload import VoiceUploadError


def test_every_gateway_error_hangs_under_the_root_with_a_code_and_an_http_status() -> None:
    for error in (RegistryError("store gone"), VoiceExistsError("taken"), CorruptRecordError("bad"),
                  VoiceUploadError(415, "not_audio", "not an audio file")):
        assert isinstance(error, VoxgateError)
    assert (RegistryError.code, RegistryError.status) == ("registry_unavailable", 503)
    assert (VoiceExistsError.code, VoiceExistsError.status) == ("voice_exists", 409)
    assert (CorruptRecordError.code, CorruptRecordError.status) == ("corrupt_voice", 409)
    upload = VoiceUploadError(415, "not_audio", "not an audio file")
    assert (upload.status, upload.code, str(upload)) == (415, "not_audio", "not an audio file")


def test_an_http_error_is_openais_error_object_with_code_and_message_mirrored() -> None:
    response = http_error(404, "unknown_voice", "no voice 'zed'")
    assert response.status_code == 404
    assert json.loads(bytes(response.body)) == {
        "error": {"code": "unknown_voice", "message": "no voice 'zed'",
                  "type": "invalid_request_error"},
        "code": "unknown_voice", "message": "no voice 'zed'"}
    busy = http_error(503, "busy", "try later", headers={"Retry-After": "1"})
    assert json.loads(bytes(busy.body))["error"]["type"] == "server_error"
    assert busy.headers["retry-after"] == "1"


def test_the_error_event_keeps_a_protocol_errors_context_and_hides_unexpected_ones() -> None:
    event = error_message(ProtocolError("bad_context_id", "no context", context_id="c", fatal=True))
    assert event.to_wire() == {"type": "error", "code": "bad_context_id", "message": "no context",
                               "context_id": "c", "fatal": True}
    assert error_message(EngineBusyError("full"), "c").code == "busy"
    assert error_message(UnknownVoiceError("who?")).code == "unknown_voice"
    hidden = error_message(RuntimeError("/secret/path exploded"), "c")
    assert hidden.code == "internal" and "/secret" not in hidden.message


def test_a_protocol_error_refuses_a_code_the_protocol_does_not_have() -> None:
    with pytest.raises(ValueError, match="unknown error code 'oops'"):
        ProtocolError("oops", "never sent")
