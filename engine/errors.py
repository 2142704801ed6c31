"""The exception tree shared by every voxgate layer.

VoxgateError
 +-- EngineError                 raised by the engine and its backends
 |    +-- UnknownVoiceError      the voice id names no loaded or registered voice
 |    +-- UnsupportedOptionError the backend cannot honour an option (e.g. instructions)
 |    +-- EngineBusyError        admission control refused a new context
 |    +-- EngineStoppedError     the engine is not running
 |    +-- BackendFailure         a backend step raised; ends the affected requests only
 |    +-- ModelLoadError         a model directory or file is missing or malformed
 +-- ProtocolError               (gateway.errors) a client message broke PROTOCOL.md

Each error that reaches a client carries its wire `code` (PROTOCOL.md "Error
codes"); the gateway maps exceptions to messages in one place.
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
