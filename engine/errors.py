"""The exception tree shared by every voxgate layer.

VoxgateError                          `code`: the wire code a client sees
 +-- EngineError                 raised by the engine and its backends
 |    +-- UnknownVoiceError      the voice id names no loaded or registered voice
 |    +-- UnsupportedOptionError the backend cannot honour an option (e.g. instructions)
 |    +-- EngineBusyError        admission control refused a new context
 |    +-- EngineStoppedError     the engine is not running
 |    +-- BackendFailure         a backend step raised; ends the affected requests only
 |    +-- ModelLoadError         a model directory or file is missing or malformed
 +-- ProtocolError               (gateway.errors) a client message broke docs/protocol.md
 +-- RegistryError               (gateway.voices.store) the voice store fails; `status` 503
 |    +-- VoiceExistsError       the voice id is taken; 409
 |    +-- CorruptRecordError     a stored record fails its checksum; 409
 +-- VoiceUploadError            (gateway.voices.upload) a refused registration; its own
                                 `code` and HTTP `status` per refusal (docs/voices.md)

Each error that reaches a client carries its wire `code` (docs/protocol.md
"Errors", docs/voices.md "Errors"); the gateway's errors that answer HTTP
requests also carry their HTTP `status`. The gateway maps exceptions to
messages in one place (gateway/errors.py: `error_message` for the socket,
`http_error` for HTTP). The engine knows no HTTP, so its errors carry codes
only.
"""

from __future__ import annotations


class VoxgateError(Exception):
    """Root of every error voxgate raises on purpose."""

    code: str = "internal"


class EngineError(VoxgateError):
    code = "internal"


class UnknownVoiceError(EngineError):
    code = "unknown_voice"


class UnsupportedOptionError(EngineError):
    code = "unsupported_option"


class EngineBusyError(EngineError):
    code = "busy"


class EngineStoppedError(EngineError):
    code = "internal"


class BackendFailure(EngineError):
    code = "internal"


class ModelLoadError(EngineError):
    code = "internal"
