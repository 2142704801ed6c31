"""Protocol errors, and the one shape of each kind of error a client sees.

The tree hangs under engine.errors.VoxgateError (see its docstring). Two
constructors, side by side, make what a client reads, so tracebacks and paths
never leak: `error_message` turns any exception into the socket's `error`
event, an `ErrorEvent` (unexpected exceptions become `internal` with a generic
message and are logged instead), and `http_error` builds every HTTP error
response. The other server events live in gateway/stream/events.py.

The HTTP body is OpenAI's error object, `{"error": {"code", "message",
"type"}}`, which OpenAI's client libraries parse, with `code` and `message`
also at the top level, where the voices API has always put them
(docs/voices.md, "Errors").

Beside ProtocolError hangs ShareExceededError: a client over its fair share
of the engine (gateway/access/fair_share.py), `rate_limited` on the socket and 429
over HTTP, where the engine's own EngineBusyError (the engine is full) is
`busy` and 503.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from engine.errors import VoxgateError

if TYPE_CHECKING:
    from starlette.responses import JSONResponse

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


class ShareExceededError(VoxgateError):
    """The client already holds its share of the engine's contexts
    (gateway/access/fair_share.py)."""

    code = "rate_limited"
    status = 429


@dataclass(slots=True, frozen=True)
class ErrorEvent:
    """The socket's `error` event (docs/protocol.md, "Errors")."""

    type: ClassVar[str] = "error"
    code: str
    message: str
    context_id: str | None = None
    fatal: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "code": self.code, "message": self.message,
                "context_id": self.context_id, "fatal": self.fatal}


def error_message(exc: BaseException, context_id: str | None = None) -> ErrorEvent:
    """The `error` event for an exception (docs/protocol.md, "Errors")."""
    if isinstance(exc, ProtocolError):
        return ErrorEvent(exc.code, exc.message, exc.context_id or context_id, exc.fatal)
    if isinstance(exc, VoxgateError):
        return ErrorEvent(exc.code, str(exc), context_id)
    return ErrorEvent("internal", "internal error; the server logged it", context_id)


def http_error(status: int, code: str, message: str, *,
               headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The HTTP error response (the one body shape: see the module doc)."""
    # imported here: the sans-I/O protocol core imports this module, not the web framework
    from starlette.responses import JSONResponse

    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"code": code, "message": message, "type": kind},
            "code": code, "message": message}
    return JSONResponse(body, status_code=status, headers=dict(headers) if headers else None)
