"""API keys and tenants: where keys come from, how they are checked, whom they name.

Keys come from `VOXGATE_API_KEYS` (comma-separated) and/or a keys file (one
key per line, `#` comments); admin keys, which also see every tenant's voices,
from `VOXGATE_ADMIN_KEYS` and/or `--admin-keys-file`. Clients send
`Authorization: Bearer <key>`, or, where they cannot set headers (browsers),
`?token=` (a short-lived single-use token: gateway/access/tokens.py) or
`?api_key=<key>`. Keys are compared in constant time and never stored: a
tenant is named by a hash of its key. With no keys configured, auth is off
(one tenant), which the server allows only when bound to loopback
(gateway/access/origins.py: `check_exposure`, and the names and origins then
accepted). `KeyCounter` counts the open sockets per key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


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


@dataclass(slots=True)
class KeyCounter:
    """Open sockets per key (a bounded dict: one entry per key in use), and in all.

    Acquired before the handshake is answered, with no await between the check
    and the count, so sockets arriving together cannot all pass a cap.
    """

    counts: dict[str, int] = field(default_factory=dict)
    num_open: int = 0  # sockets holding a count, over every key

    def acquire(self, key: str, limit: int) -> bool:
        if self.counts.get(key, 0) >= limit:
            return False
        self.counts[key] = self.counts.get(key, 0) + 1
        self.num_open += 1
        return True

    def release(self, key: str) -> None:
        held = self.counts.get(key, 0)
        if held <= 0:
            return
        self.num_open -= 1
        if held > 1:
            self.counts[key] = held - 1
        else:
            del self.counts[key]
