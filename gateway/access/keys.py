"""API keys, tenants, session tokens, browser origins, and keys kept out of logs.

Keys come from `VOXGATE_API_KEYS` (comma-separated) and/or a keys file (one
key per line, `#` comments); admin keys, which also see every tenant's voices,
from `VOXGATE_ADMIN_KEYS` and/or `--admin-keys-file`. Clients send
`Authorization: Bearer <key>`, or, where they cannot set headers (browsers),
`?token=` (a short-lived single-use token from `POST /v1/session-tokens`) or
`?api_key=<key>`. Keys are compared in constant time and never stored: a
tenant is named by a hash of its key. With no keys configured, auth is off
(one tenant), which the server allows only when bound to loopback (see
`check_exposure`); then only loopback Host headers and origins are accepted
(docs/operations.md, "Security model").

Query strings reach the access log; `redact` and `RedactingFilter` replace
every key-like query value there with `[redacted]`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


@dataclass(slots=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allow_no_auth: bool = False
    admin_keys: tuple[str, ...] = ()  # also API keys; they see and delete every tenant's voices

    def __post_init__(self) -> None:
        for key in (*self.api_keys, *self.admin_keys):
            if len(key) < 8:
                raise ValueError(f"API keys must be at least 8 characters, got one of {len(key)}")

    @property
    def is_enabled(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    @property
    def is_loopback_mode(self) -> bool:
        """Auth off, not opened on purpose (--no-auth): only this machine may use the server."""
        return not self.is_enabled and not self.allow_no_auth

    @property
    def all_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.api_keys, *self.admin_keys)))


def load_keys(env: Mapping[str, str] | None = None, keys_file: str | Path | None = None,
              *, variable: str = "VOXGATE_API_KEYS") -> tuple[str, ...]:
    """Keys from `variable` (comma-separated) and the keys file (or `<variable>_FILE`)."""
    env = os.environ if env is None else env
    keys = [k.strip() for k in env.get(variable, "").split(",") if k.strip()]
    path = keys_file or env.get(variable + "_FILE")
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    return tuple(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, auth: AuthConfig) -> str:
    """A start-up message about auth; raises ValueError for an open server on a public address."""
    if auth.is_enabled:
        return f"auth is on: {len(auth.all_keys)} API key(s), {len(auth.admin_keys)} of them admin"
    if is_loopback(host):
        return "auth is off (bound to loopback only); set VOXGATE_API_KEYS to require keys"
    if auth.allow_no_auth:
        return f"WARNING: auth is off and the server listens on {host}; anyone who reaches it can use it"
    raise ValueError(f"refusing to listen on {host} without API keys: set VOXGATE_API_KEYS (or "
                     "--api-keys-file), or pass --no-auth to accept an open server")


def presented_key(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if value and value.lower().startswith("bearer "):
        return value[7:].strip()
    return query.get("api_key")


def _matches(keys: tuple[str, ...], key: str | None) -> bool:
    if not key:
        return False
    matched = False
    for candidate in keys:  # compare with every key: timing says nothing about which
        matched |= hmac.compare_digest(candidate.encode(), key.encode())
    return matched


def is_authorized(auth: AuthConfig, key: str | None) -> bool:
    if not auth.is_enabled:
        return True
    return _matches(auth.all_keys, key)


@dataclass(slots=True, frozen=True)
class Principal:
    """Who a request acts for: a tenant (a hash of its key; "" with auth off) and its rights."""

    tenant: str
    is_admin: bool = False


#: the one principal with auth off, and the server's own calls (start-up, assets)
OPERATOR = Principal("", is_admin=True)


def tenant_of(key: str) -> str:
    """The tenant a key names: a hash, so that no key is ever stored (registry owners)."""
    return hashlib.sha256(b"voxgate-tenant\0" + key.encode()).hexdigest()[:32]


def principal_of(auth: AuthConfig, key: str | None) -> Principal:
    """The principal of an authorized key; with auth off everyone is the one admin tenant."""
    if not auth.is_enabled:
        return OPERATOR
    if not key:
        return Principal("")
    return Principal(tenant_of(key), is_admin=_matches(auth.admin_keys, key))


def host_name(host_header: str | None) -> str:
    """The name in a Host header without its port: "[::1]:8000" -> "::1"."""
    host = (host_header or "").strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else ""
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_host(host_header: str | None) -> bool:
    """A Host header naming this machine (DNS rebinding sends the attacker's name instead)."""
    return is_loopback(host_name(host_header))


def is_origin_allowed(auth: AuthConfig, origin: str | None, host: str | None) -> bool:
    """Non-browser clients send no Origin; listed origins (or `*`) pass; then pages served
    by this server itself, same origin as Host. In loopback mode that origin must also be
    a loopback one: a DNS-rebound page has Origin and Host both naming the attacker's
    domain, so Host alone proves nothing (with auth on, such a page still needs a key).
    """
    if origin is None or "*" in auth.allowed_origins:
        return True
    if origin in auth.allowed_origins:
        return True
    netloc = urlsplit(origin).netloc.lower()
    if not host or netloc != str(host).lower():
        return False
    return not auth.is_loopback_mode or is_loopback_host(netloc)


# -- keys kept out of logs -----------------------------------------------------

#: query parameters whose values are secrets (api_key, token, key, access_token, ...)
_SECRET_QUERY = re.compile(r"(?i)([?&;](?:[a-z0-9_.-]*(?:key|token|secret|password|passwd|auth|"
                           r"signature|sig|credential)[a-z0-9_.-]*)=)[^&;\s\"']*")


def redact(text: str) -> str:
    """`text` with every key-like query value replaced: "?api_key=sk-1" -> "?api_key=[redacted]"."""
    return _SECRET_QUERY.sub(r"\1[redacted]", text)


class RedactingFilter(logging.Filter):
    """Redacts key-like query values in a record's message and arguments.

    uvicorn's access log prints the raw path with its query ("GET /v1/voices?api_key=..."),
    and its WebSocket lines ("WebSocket /v1/stream?api_key=..." [accepted]) do too.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


_LOGGERS_WITH_QUERIES = ("uvicorn.access", "uvicorn.error", "uvicorn", "websockets.server",
                         "websockets", "voxgate")


def install_log_redaction() -> None:
    """Put the filter on the loggers that may print a query and on every handler they
    use (a logger's filter skips records propagated from its children; a handler's
    does not). Idempotent; call it after logging is configured (uvicorn.Config does)."""
    targets: list[logging.Filterer] = [logging.getLogger()]
    for name in _LOGGERS_WITH_QUERIES:
        targets.append(logging.getLogger(name))
    targets += [h for t in list(targets) if isinstance(t, logging.Logger) for h in t.handlers]
    for target in targets:
        if not any(isinstance(f, RedactingFilter) for f in target.filters):
            target.addFilter(RedactingFilter())


# -- session tokens ------------------------------------------------------------

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

    def __len__(self) -> int:
        return len(self._tokens)


@dataclass(slots=True)
class KeyCounter:
    """Open sockets per key (a bounded dict: one entry per key in use)."""

    counts: dict[str, int] = field(default_factory=dict)

    def acquire(self, key: str, limit: int) -> bool:
        if self.counts.get(key, 0) >= limit:
            return False
        self.counts[key] = self.counts.get(key, 0) + 1
        return True

    def release(self, key: str) -> None:
        left = self.counts.get(key, 0) - 1
        if left > 0:
            self.counts[key] = left
        else:
            self.counts.pop(key, None)
