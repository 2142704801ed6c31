"""`POST /v1/session-tokens`: a single-use token for the socket, for the key that asked.

The tokens themselves, and how the socket redeems one, are gateway/access/tokens.py's.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.access.keys import presented_key
from gateway.access.tokens import SessionTokens
from gateway.errors import http_error
from gateway.state import AppState


async def create_session_token(request: Request) -> Response:
    """`POST /v1/session-tokens`: a single-use token for the socket, for the key that asked."""
    state: AppState = request.app.state.voxgate
    auth = state.config.auth
    if not auth.is_enabled:
        return http_error(400, "auth_off", "auth is off: the socket needs no token")
    key = presented_key(request.headers, {})
    if key is None:  # a key in the query (?api_key=) may not mint tokens: a leaked URL would
        return http_error(401, "unauthorized", "send the key as Authorization: Bearer <key>",
                          headers={"WWW-Authenticate": "Bearer"})
    tokens: SessionTokens = state.session_tokens
    issued = tokens.issue(key, time.time())
    if issued is None:  # say whose cap it is: the key's own, or the server's
        if tokens.num_outstanding(key) >= tokens.max_per_key:
            message = (f"this key holds {tokens.max_per_key} session tokens not yet used, the cap "
                       f"per key; use them, or wait for them to expire ({tokens.ttl_s:g} s)")
        else:
            message = (f"the server holds {tokens.max_tokens} session tokens not yet used; try "
                       "again in a minute")
        return http_error(429, "rate_limited", message)
    token, expires_at = issued
    return JSONResponse({"token": token, "expires_at": round(expires_at, 3),
                         "expires_in_s": tokens.ttl_s}, headers={"Cache-Control": "no-store"})
