"""Browser origins and loopback names: who may reach the server from where.

With no keys configured, auth is off (one tenant), which the server allows
only when bound to loopback (`check_exposure`); then only loopback Host
headers and origins are accepted (docs/operations.md, "Security model"): a
DNS-rebound page reaches 127.0.0.1 under the attacker's name. Browsers send an
Origin; `is_origin_allowed` says which pass (`--allowed-origins`, or pages
this server served itself).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from gateway.access.keys import AuthConfig


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
        return (f"WARNING: auth is off and the server listens on {host}; "
                "anyone who reaches it can use it")
    raise ValueError(f"refusing to listen on {host} without API keys: set VOXGATE_API_KEYS (or "
                     "--api-keys-file), or pass --no-auth to accept an open server")


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
