"""The client's exceptions: one root, and the protocol's error codes as types.

    VoxgateError                 every error this package raises
    ├── ServerError              an `error` event from the server (`code`, `message`,
    │   │                        `context_id`, `fatal`; docs/protocol.md, "Errors")
    │   ├── Busy                 `busy`: the engine is full; `retry_after_s` advises a wait
    │   ├── RateLimited          `rate_limited`: this client's share is taken (a Busy)
    │   ├── Unauthorized         `unauthorized`: no valid key or token (close 4401)
    │   └── ContextClosed        `context_closed`: the turn is done or cancelled
    ├── ConnectionLost           the socket could not open, or closed with the turn in flight
    └── NoAnswer                 the server did not answer in time (also a TimeoutError)

Every other code (`text_too_long`, `too_many_contexts`, `internal`...) is a
plain `ServerError` with that `code`.
"""

from __future__ import annotations

from typing import Any


class VoxgateError(Exception):
    """Root of every error the client raises."""


class ServerError(VoxgateError):
    """The server answered with an `error` event."""

    def __init__(self, code: str, message: str, *, context_id: str | None = None,
                 fatal: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.context_id = context_id
        self.fatal = fatal


class Busy(ServerError):
    """The engine is at capacity and did not admit the turn (or the server is at its socket
    limit). Retry with a new turn after `retry_after_s`: the advice grows with each `busy`
    in a row on one session, with jitter, so that many clients do not retry at once."""

    def __init__(self, code: str, message: str, *, context_id: str | None = None,
                 fatal: bool = False, retry_after_s: float = 1.0) -> None:
        super().__init__(code, message, context_id=context_id, fatal=fatal)
        self.retry_after_s = retry_after_s


class RateLimited(Busy):
    """Too many messages, or this key's share of the engine is taken; same advice as `Busy`."""


class Unauthorized(ServerError):
    """No valid API key or token: pass `api_key=` (or a `token=` for a browser)."""


class ContextClosed(ServerError):
    """The turn is done or cancelled: its text is no longer taken."""


class ConnectionLost(VoxgateError):
    """The socket could not be opened, or it closed while a turn was in flight.

    `close_code` is the WebSocket close code when the server sent one (1001: it shut
    down; 1013: it is full; 4000: idle), else None (refused, reset, timed out).
    """

    def __init__(self, message: str, *, close_code: int | None = None) -> None:
        super().__init__(message)
        self.close_code = close_code


class NoAnswer(VoxgateError, TimeoutError):
    """The server did not answer (a `cancel`, a `session.update`, the handshake) in time."""


_BY_CODE: dict[str, type[ServerError]] = {
    "busy": Busy,
    "rate_limited": RateLimited,
    "unauthorized": Unauthorized,
    "context_closed": ContextClosed,
}


def server_error(message: dict[str, Any], *, retry_after_s: float = 1.0) -> ServerError:
    """The exception for an `error` event (a dict as it came off the wire)."""
    code = str(message.get("code", "internal"))
    kind = _BY_CODE.get(code, ServerError)
    text = str(message.get("message", ""))
    context_id = message.get("context_id")
    context_id = context_id if isinstance(context_id, str) else None
    fatal = bool(message.get("fatal", False))
    if issubclass(kind, Busy):
        return kind(code, text, context_id=context_id, fatal=fatal, retry_after_s=retry_after_s)
    return kind(code, text, context_id=context_id, fatal=fatal)
