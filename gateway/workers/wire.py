"""What crosses the channel: engine/wire.py's maps, and the errors only a worker meets.

Both ends are the same build on one machine. Beside the engine's own errors, the
engine process's admission answers `rate_limited` (a key past its fair share,
decided there for every worker), and the voice verbs keep a ValueError's kind
(audio or metadata the engine cannot use).
"""

from __future__ import annotations

from typing import Any

from engine import wire
from engine.errors import VoxgateError
from engine.wire import (
    chunk_from_wire,
    chunk_to_wire,
    request_from_wire,
    request_to_wire,
    voice_from_wire,
    voice_to_wire,
)
from gateway.errors import ShareExceededError

__all__ = ["chunk_from_wire", "chunk_to_wire", "error_from_wire", "error_to_wire",
           "request_from_wire", "request_to_wire", "voice_from_wire", "voice_to_wire"]


def error_to_wire(exc: BaseException) -> dict[str, Any]:
    """An error as its code and a message safe to show a client; a ValueError keeps its
    kind (the voice verbs raise it for audio or metadata the engine cannot use)."""
    if isinstance(exc, ValueError) and not isinstance(exc, VoxgateError):
        return {"error": "value", "message": str(exc)}
    return wire.error_to_wire(exc, "the engine process failed this call; it logged why")


def error_from_wire(message: dict[str, Any]) -> Exception:
    if message["error"] == "value":
        return ValueError(message["message"])
    if message["error"] == ShareExceededError.code:
        return ShareExceededError(message["message"])
    return wire.error_from_wire(message)
