"""The door of the vendor sockets: voxgate's admission rules, then the native I/O loop.

The same checks, in the same order, as the native `/v1/stream` endpoint
(gateway/stream/endpoint.py): the key (each vendor sends it its own way; the adapter says
where), the browser origin, shutdown, the session cap, the socket cap per
owner; then one `CompatConnection` runs the adapter's session. A refusal is
the vendor's error frame and a close code.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from starlette.websockets import WebSocket

from gateway.access.keys import is_authorized, is_origin_allowed
from gateway.compat.core import CompatConnection, CompatSession
from gateway.errors import (
    CLOSE_FORBIDDEN,
    CLOSE_GOING_AWAY,
    CLOSE_TRY_AGAIN_LATER,
    CLOSE_UNAUTHORIZED,
)
from gateway.stream.endpoint import serve_session
from gateway.stream.messages import Limits, SessionOptions

#: builds the adapter's session: (session id, catalog, engine rate, options, limits, admit,
#: release, is_authorized) -> CompatSession
SessionFactory = Callable[..., CompatSession]


async def refuse(websocket: WebSocket, frame: str, close_code: int, reason: str) -> None:
    await websocket.accept()
    await websocket.send_text(frame)
    await websocket.close(close_code, reason[:120])


def _fair_admission(state: Any, owner: str) -> tuple[Callable[[str], None], Callable[[str], None]]:
    """The engine's admission, behind the per-owner fair share where the app has one."""
    fair_share = getattr(state, "fair_share", None)
    if fair_share is not None:
        return (lambda key: fair_share.admit(owner, key)), fair_share.release
    engine = state.engine
    return engine.admit, engine.release_context


def _owner(state: Any, key: str | None, websocket: WebSocket) -> str:
    host = websocket.client.host if websocket.client else None
    try:
        from gateway.access.fair_share import owner_of
    except ImportError:  # an app without fair share counts sockets per key
        return key or ""
    return owner_of(key, host, is_auth_enabled=state.config.auth.is_enabled)


async def serve(websocket: WebSocket, make_session: SessionFactory, *, key: str | None,
                error_json: Callable[[str, str], str], options: SessionOptions,
                idle_timeout_s: float | None = None, defer_auth: bool = False) -> None:
    """Admit the socket and run the adapter's session on the native loop.

    `defer_auth`: with no valid key at the handshake, the session may still take
    one in its first message (ElevenLabs); it is told so by `is_authorized`.
    """
    state = websocket.app.state.voxgate
    config = state.config
    authorized = is_authorized(config.auth, key)
    if not authorized and not defer_auth:
        state.metrics.observe("error:unauthorized", 1)
        await refuse(websocket, error_json("unauthorized", "a valid API key is required"),
                     CLOSE_UNAUTHORIZED, "unauthorized")
        return
    if not is_origin_allowed(config.auth, websocket.headers.get("origin"), websocket.headers.get("host")):
        await refuse(websocket, error_json("unauthorized", "this origin is not allowed"),
                     CLOSE_FORBIDDEN, "origin")
        return
    if state.is_shutting_down:
        await refuse(websocket, error_json("busy", "the server is shutting down"),
                     CLOSE_GOING_AWAY, "busy")
        return
    if len(state.connections) >= config.max_sessions:
        state.metrics.observe("error:busy", 1)
        await refuse(websocket, error_json("busy", f"the server holds {config.max_sessions} "
                                           "sessions; try again later"), CLOSE_TRY_AGAIN_LATER, "busy")
        return
    owner = _owner(state, key if authorized else None, websocket)
    if not state.key_counter.acquire(owner, config.max_sockets_per_key):
        state.metrics.observe("error:rate_limited", 1)
        await refuse(websocket, error_json("rate_limited", f"this client holds "
                                           f"{config.max_sockets_per_key} sockets already"),
                     CLOSE_TRY_AGAIN_LATER, "rate_limited")
        return
    try:
        limits: Limits = config.limits
        if idle_timeout_s is not None:
            limits = replace(limits, idle_timeout_s=idle_timeout_s)
        admit, release = _fair_admission(state, owner)
        engine = state.engine
        session = make_session(uuid.uuid4().hex[:16], catalog=state.catalog,
                               sample_rate=engine.sample_rate, options=options, limits=limits,
                               admit=admit, release=release, is_authorized=authorized)
        await serve_session(websocket, session, CompatConnection(websocket, session, engine, state),
                            state)
    finally:
        state.key_counter.release(owner)
