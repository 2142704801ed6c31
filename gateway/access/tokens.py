"""Session tokens: short-lived, single-use stand-ins for a key, for browser socket URLs.

`POST /v1/session-tokens` (`create_session_token`, with the key in the
Authorization header) issues one; the socket takes it as `?token=`, and the
access guard (gateway/access/guard.py) redeems it for the key it stands for.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.access.keys import presented_key
from gateway.errors import http_error

if TYPE_CHECKING:
    from gateway.state import AppState


@dataclass(slots=True)
class SessionTokens:
    """Short-lived, single-use tokens that stand for the key that made them.

    A browser gets one from `POST /v1/session-tokens` (with its key) and puts it
    in the socket URL instead of the key, so a URL that leaks (a log, a proxy, the
    history) grants nothing after its first use or its `ttl_s`. Only a digest of
    each token is kept; at most `max_tokens` are outstanding (bounded memory),
    `max_per_key` of them for one key.
    Tokens live in this process: behind a load balancer, the socket must reach
    the replica that issued it (docs/operations.md).
    """

    ttl_s: float = 60.0
    max_tokens: int = 10000
    max_per_key: int = 100  # one key cannot take every place
    _tokens: dict[str, tuple[str, float]] = field(default_factory=dict)  # digest -> (key, expiry)

    def __post_init__(self) -> None:
        if not 0 < self.ttl_s <= 3600:
            raise ValueError(f"session token ttl_s must be within (0, 3600], got {self.ttl_s}")
        if self.max_tokens < 1 or self.max_per_key < 1:
            raise ValueError(f"max_tokens and max_per_key must be >= 1, got {self.max_tokens} and "
                             f"{self.max_per_key}")

    @staticmethod
    def _digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def issue(self, key: str, now: float) -> tuple[str, float] | None:
        """A new token for `key` and its expiry; None when too many are outstanding."""
        if len(self._tokens) >= self.max_tokens:
            self._tokens = {d: e for d, e in self._tokens.items() if e[1] > now}
            if len(self._tokens) >= self.max_tokens:
                return None
        mine = [d for d, e in self._tokens.items() if e[0] == key]
        if len(mine) >= self.max_per_key:
            for digest in mine:  # its expired ones go first
                if self._tokens[digest][1] <= now:
                    del self._tokens[digest]
            if sum(1 for e in self._tokens.values() if e[0] == key) >= self.max_per_key:
                return None
        token = "vxt_" + secrets.token_urlsafe(24)
        expires_at = now + self.ttl_s
        self._tokens[self._digest(token)] = (key, expires_at)
        return token, expires_at

    def redeem(self, token: str, now: float) -> str | None:
        """The key a token stands for, once: the token is spent either way."""
        entry = self._tokens.pop(self._digest(token), None)
        if entry is None or entry[1] <= now:
            return None
        return entry[0]

    def num_outstanding(self, key: str) -> int:
        """Tokens of `key` not yet spent (expired ones included until `issue` drops them)."""
        return sum(1 for entry in self._tokens.values() if entry[0] == key)

    def __len__(self) -> int:
        return len(self._tokens)


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
