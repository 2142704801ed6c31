"""Who may reach the app: loopback Host names, browser origins, keys and session tokens.

One ASGI middleware, in front of every route (docs/operations.md, "Security
model"), applies in order:

1. Loopback mode (auth off, not opened with --no-auth): the Host header must
   name this machine (localhost, 127.0.0.0/8, [::1]), else 421. A DNS-rebound
   page reaches 127.0.0.1 under the attacker's name and is refused here.
2. A browser's cross-origin request that is not a read (POST, DELETE...) from an
   origin that `is_origin_allowed` refuses gets 403: a page could otherwise send
   a "simple" request (a form post, multipart or text/plain) without a preflight.
3. `?token=` on the socket is redeemed (single use) for the key it stands for,
   which then travels as `Authorization: Bearer`; the token leaves the query.
4. HTTP requests under /v1/ need a key when auth is on (the socket checks its own,
   to answer with its 4401 event). The principal (tenant, admin) a request acts
   for is put in the scope for the routes (`principal`).

`POST /v1/session-tokens` issues the tokens (gateway/access/tokens.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.access.keys import OPERATOR, Principal, is_authorized, presented_key, principal_of
from gateway.access.origins import is_loopback_host, is_origin_allowed
from gateway.errors import http_error

if TYPE_CHECKING:
    from gateway.state import AppState

_PRINCIPAL = "voxgate.principal"
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


def principal(request: Request) -> Principal:
    """The principal the guard found for this request (the one tenant when auth is off)."""
    found = request.scope.get(_PRINCIPAL)
    return found if isinstance(found, Principal) else OPERATOR


class AccessGuard:
    """The checks above, as ASGI middleware; `state` is the app's AppState."""

    def __init__(self, app: ASGIApp, state: AppState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        auth = self.state.config.auth
        headers = Headers(scope=scope)
        host = headers.get("host")
        if auth.is_loopback_mode and not is_loopback_host(host):
            await self._refuse(scope, receive, send, 421, "misdirected_request",
                               "with auth off this server answers only to loopback names "
                               f"(localhost, 127.0.0.1, [::1]); got Host {host!r}. Set "
                               "VOXGATE_API_KEYS to serve other names")
            return
        is_http = scope["type"] == "http"
        if is_http and scope["method"] not in _READS and not is_origin_allowed(
                auth, headers.get("origin"), host):
            self.state.metrics.observe("error:forbidden_origin", 1)
            await self._refuse(scope, receive, send, 403, "forbidden_origin",
                               "requests from this page's origin are not allowed (see "
                               "--allowed-origins)")
            return
        if not is_http and scope["path"] == "/v1/stream":
            scope = self._redeem_token(scope)
        key = presented_key(Headers(scope=scope),
                            dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"))))
        if is_http and scope["path"].startswith("/v1/") and not is_authorized(auth, key):
            self.state.metrics.observe("error:unauthorized", 1)
            await http_error(401, "unauthorized",
                             "a valid API key is required: Authorization: Bearer <key>",
                             headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        scope = {**scope, _PRINCIPAL: principal_of(auth, key)}
        await self.app(scope, receive, send)

    def _redeem_token(self, scope: Scope) -> Scope:
        """The socket's `?token=` swapped for the key it stands for (a bad token: no key)."""
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        tokens = [v for k, v in query if k == "token"]
        if not tokens:
            return scope
        rest = urlencode([(k, v) for k, v in query if k != "token"]).encode("latin-1")
        raw = [(k, v) for k, v in scope["headers"] if k.lower() != b"authorization"]
        key = self.state.session_tokens.redeem(tokens[0], time.time())
        if key is not None:
            raw.append((b"authorization", b"Bearer " + key.encode("latin-1")))
        return {**scope, "query_string": rest, "headers": raw}

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, code: str,
                      message: str) -> None:
        if scope["type"] == "http":
            await http_error(status, code, message)(scope, receive, send)
            return
        await receive()  # websocket.connect; a close before accept answers the handshake with 403
        await send({"type": "websocket.close", "code": 1008, "reason": code})
