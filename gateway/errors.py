"""Protocol errors: each carries its PROTOCOL.md wire `code`.

The tree hangs under engine.errors.VoxgateError (see its docstring). One place,
`error_message`, turns any exception into the `error` event a client sees, so
tracebacks and paths never leak: unexpected exceptions become `internal` with
a generic message and are logged instead.
"""

from __future__ import annotations

from typing import Any

from engine.errors import VoxgateError

# Named WebSocket close codes (RFC 6455 and the 4000-4999 private range).
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_SLOW_CONSUMER = 4408
CLOSE_IDLE_TIMEOUT = 4000

ERROR_CODES = frozenset({
    "bad_message", "context_closed", "bad_context_id", "unknown_voice", "unsupported_option",
    "text_too_long", "too_many_contexts", "message_too_large", "rate_limited", "busy",
    "unauthorized", "slow_consumer", "internal",
})


class ProtocolError(VoxgateError):
    """A client message broke the protocol; the message is dropped, the session goes on."""

    def __init__(self, code: str, message: str, *, context_id: str | None = None,
                 fatal: bool = False) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.context_id = context_id
        self.fatal = fatal


def error_message(exc: BaseException, context_id: str | None = None) -> dict[str, Any]:
    """The `error` event for an exception (PROTOCOL.md, Server -> client)."""
    if isinstance(exc, ProtocolError):
        return {"type": "error", "code": exc.code, "message": exc.message,
                "context_id": exc.context_id or context_id, "fatal": exc.fatal}
    if isinstance(exc, VoxgateError):
        return {"type": "error", "code": exc.code, "message": str(exc),
                "context_id": context_id, "fatal": False}
    return {"type": "error", "code": "internal", "message": "internal error; the server logged it",
            "context_id": context_id, "fatal": False}
