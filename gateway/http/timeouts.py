"""A header timeout for uvicorn: connections that never finish a request head are closed.

uvicorn closes a keep-alive connection that stays silent between requests
(`timeout_keep_alive`), but it has no timer for the request head itself: a
client that connects and sends nothing, or sends "GET / HTTP/1.1\\r\\n" and
then one header byte a minute (slowloris), holds its connection, and a slot of
`limit_concurrency`, for ever. These protocol classes arm a timer when a
connection opens and whenever a new request head begins, and disarm it when
the head is complete (a WebSocket upgrade included: after it, the socket's own
idle timeout and pings apply). When the timer fires the connection is closed
without an answer, as nginx's `client_header_timeout` does.

`protocol_class(header_timeout_s)` picks the httptools parser when it is
installed (uvicorn[standard], uvicorn's own "auto" choice) and h11 otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("voxgate.gateway")


class _HeaderTimer:
    """The timer: armed at most once at a time; `expired` closes the transport."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.handle: asyncio.TimerHandle | None = None

    def arm(self, transport: asyncio.BaseTransport) -> None:
        if self.handle is None:
            self.handle = asyncio.get_running_loop().call_later(self.timeout_s, self._expired,
                                                                transport)

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _expired(self, transport: asyncio.BaseTransport) -> None:
        self.handle = None
        if not transport.is_closing():
            log.info("closing a connection that sent no whole request head in %g s", self.timeout_s)
            transport.close()


def _h11_class(timeout_s: float) -> type[asyncio.Protocol]:
    import h11

    class HeaderTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_timer = _HeaderTimer(timeout_s)
            super().connection_made(transport)
            self._header_timer.arm(transport)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # h11 stays IDLE until a whole request head is parsed; a head begun
            # and not finished (or a keep-alive connection's next one) is timed.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._header_timer.arm(self.transport)
            else:
                self._header_timer.disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._header_timer.disarm()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol


def _httptools_class(timeout_s: float) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_timer = _HeaderTimer(timeout_s)
            super().connection_made(transport)
            self._header_timer.arm(transport)

        def on_message_begin(self) -> None:  # the next request on a keep-alive connection
            super().on_message_begin()
            self._header_timer.arm(self.transport)

        def on_headers_complete(self) -> None:
            self._header_timer.disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._header_timer.disarm()
            super().connection_lost(exc)

    return HeaderTimeoutHttpToolsProtocol


def protocol_class(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools, else h11) with a header timeout (`http=` in its
    Config)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return _h11_class(header_timeout_s)
    return _httptools_class(header_timeout_s)


def uvicorn_limits(*, header_timeout_s: float, max_connections: int) -> dict[str, Any]:
    """The uvicorn.Config arguments that bound connections (docs/operations.md, "Connections")."""
    return {"http": protocol_class(header_timeout_s), "limit_concurrency": max_connections}
