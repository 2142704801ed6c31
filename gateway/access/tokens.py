"""Session tokens: short-lived, single-use stand-ins for a key, for browser socket URLs.

`POST /v1/session-tokens` (gateway/http/tokens.py, with the key in the
Authorization header) issues one; the socket takes it as `?token=`, and the
access guard (gateway/access/guard.py) redeems it for the key it stands for.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field


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
