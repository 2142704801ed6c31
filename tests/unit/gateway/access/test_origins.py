"""Browser origins and loopback names: who may reach the server from where."""

from __future__ import annotations

import pytest

from gateway.access.keys import AuthConfig
from gateway.access.origins import is_loopback, is_loopback_host, is_origin_allowed

KEY = "sk-voxgate-0123456789"


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("192.168.1.10", False), ("example.com", False), ("", False),
])
def test_loopback_is_recognized_by_address(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_browser_origins_pass_when_listed_same_origin_or_wildcard() -> None:
    auth = AuthConfig(api_keys=(KEY,), allowed_origins=("https://app.example",))
    assert is_origin_allowed(auth, None, "voice.example")  # not a browser
    assert is_origin_allowed(auth, "https://app.example", "voice.example")
    assert is_origin_allowed(auth, "https://Voice.example", "voice.example")  # same origin
    assert not is_origin_allowed(auth, "https://evil.example", "voice.example")
    assert not is_origin_allowed(auth, "https://evil.example", None)
    assert is_origin_allowed(AuthConfig(allowed_origins=("*",)), "https://evil.example", "x")


def test_in_loopback_mode_a_same_origin_page_passes_only_when_it_is_a_loopback_one() -> None:
    auth = AuthConfig()
    assert auth.is_loopback_mode and not AuthConfig(allow_no_auth=True).is_loopback_mode
    assert is_origin_allowed(auth, "http://127.0.0.1:8000", "127.0.0.1:8000")
    assert is_origin_allowed(auth, "http://localhost:8000", "localhost:8000")
    assert is_origin_allowed(auth, "http://[::1]:8000", "[::1]:8000")
    # a DNS-rebound page: its Origin and Host both name the attacker's domain
    assert not is_origin_allowed(auth, "http://evil.example:8000", "evil.example:8000")
    # another local app
    assert not is_origin_allowed(auth, "http://localhost:3000", "localhost:8000")
    assert is_origin_allowed(AuthConfig(allowed_origins=("http://localhost:3000",)),
                             "http://localhost:3000", "localhost:8000")


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1:8000", True), ("localhost", True), ("LOCALHOST:1", True), ("[::1]:8000", True),
    ("::1", True), ("127.9.9.9", True), ("evil.example", False), ("evil.example:8000", False),
    ("localhost.evil.example", False), ("127.0.0.1.nip.io", False), ("", False), (None, False),
])
def test_a_host_header_is_loopback_only_when_it_names_this_machine(
        host: str | None, expected: bool) -> None:
    assert is_loopback_host(host) is expected
