"""API keys and browser origins.

Keys come from `VOXGATE_API_KEYS` (comma-separated) and/or a keys file (one
key per line, `#` comments). Clients send `Authorization: Bearer <key>`, or
`?api_key=<key>` where they cannot set headers (browsers). Keys are compared
in constant time. With no keys configured, auth is off, which the server
allows only when bound to loopback (see `check_exposure`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


@dataclass(slots=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allow_no_auth: bool = False

    def __post_init__(self) -> None:
        for key in self.api_keys:
            if len(key) < 8:
                raise ValueError(f"API keys must be at least 8 characters, got one of {len(key)}")

    @property
    def is_enabled(self) -> bool:
        return bool(self.api_keys)


def load_keys(env: Mapping[str, str] | None = None, keys_file: str | Path | None = None) -> tuple[str, ...]:
    env = os.environ if env is None else env
    keys = [k.strip() for k in env.get("VOXGATE_API_KEYS", "").split(",") if k.strip()]
    path = keys_file or env.get("VOXGATE_API_KEYS_FILE")
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
        return f"auth is on: {len(auth.api_keys)} API key(s)"
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


def is_authorized(auth: AuthConfig, key: str | None) -> bool:
    if not auth.is_enabled:
        return True
    if not key:
        return False
    matched = False
    for candidate in auth.api_keys:  # compare with every key: timing says nothing about which
        matched |= hmac.compare_digest(candidate.encode(), key.encode())
    return matched


def is_origin_allowed(auth: AuthConfig, origin: str | None, host: str | None) -> bool:
    """Non-browser clients send no Origin; same-origin pages and listed origins pass."""
    if origin is None or "*" in auth.allowed_origins:
        return True
    if origin in auth.allowed_origins:
        return True
    return bool(host) and urlsplit(origin).netloc.lower() == str(host).lower()


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
