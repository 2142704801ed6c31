"""API keys and browser origins: where keys come from, how they are checked, who may connect."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.access.keys import (
    OPERATOR,
    AuthConfig,
    KeyCounter,
    SessionTokens,
    check_exposure,
    is_authorized,
    is_loopback,
    is_loopback_host,
    is_origin_allowed,
    load_keys,
    presented_key,
    principal_of,
    redact,
    tenant_of,
)

KEY = "sk-voxgate-0123456789"
OTHER = "sk-voxgate-9876543210"


def test_keys_come_from_the_variable_and_the_file_without_comments_or_repeats(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# team keys\n{OTHER}  # ops\n\n{KEY}\n", encoding="utf-8")
    env = {"VOXGATE_API_KEYS": f" {KEY}, ,another-key-123 ", "VOXGATE_API_KEYS_FILE": str(keys_file)}
    assert load_keys(env) == (KEY, "another-key-123", OTHER)
    assert load_keys({}) == ()
    assert load_keys({"VOXGATE_ADMIN_KEYS": KEY}, variable="VOXGATE_ADMIN_KEYS") == (KEY,)


def test_a_key_shorter_than_eight_characters_is_refused_without_echoing_it() -> None:
    with pytest.raises(ValueError, match="at least 8 characters, got one of 5") as caught:
        AuthConfig(api_keys=("short",))
    assert "short" not in str(caught.value)


def test_without_keys_the_server_may_listen_only_on_loopback_unless_told_otherwise() -> None:
    assert "auth is off" in check_exposure("127.0.0.1", AuthConfig())
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0 without API keys"):
        check_exposure("0.0.0.0", AuthConfig())
    assert check_exposure("0.0.0.0", AuthConfig(allow_no_auth=True)).startswith("WARNING")


def test_the_start_up_message_counts_keys_and_never_shows_one() -> None:
    message = check_exposure("0.0.0.0", AuthConfig(api_keys=(KEY, OTHER)))
    assert "2 API key(s)" in message and KEY not in message and OTHER not in message


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("192.168.1.10", False), ("example.com", False), ("", False),
])
def test_loopback_is_recognized_by_address(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_the_key_is_taken_from_the_bearer_header_before_the_query() -> None:
    assert presented_key({"authorization": f"Bearer {KEY}"}, {"api_key": OTHER}) == KEY
    assert presented_key({"authorization": f"bearer  {KEY} "}, {}) == KEY
    assert presented_key({"authorization": f"Basic {KEY}"}, {"api_key": OTHER}) == OTHER
    assert presented_key({}, {}) is None


def test_only_a_configured_key_is_authorized_when_auth_is_on() -> None:
    auth = AuthConfig(api_keys=(KEY, OTHER))
    assert is_authorized(auth, KEY) and is_authorized(auth, OTHER)
    assert not is_authorized(auth, KEY + "x")
    assert not is_authorized(auth, None) and not is_authorized(auth, "")
    assert is_authorized(AuthConfig(), None)  # auth off


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
    assert not is_origin_allowed(auth, "http://localhost:3000", "localhost:8000")  # another local app
    assert is_origin_allowed(AuthConfig(allowed_origins=("http://localhost:3000",)),
                             "http://localhost:3000", "localhost:8000")


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1:8000", True), ("localhost", True), ("LOCALHOST:1", True), ("[::1]:8000", True),
    ("::1", True), ("127.9.9.9", True), ("evil.example", False), ("evil.example:8000", False),
    ("localhost.evil.example", False), ("127.0.0.1.nip.io", False), ("", False), (None, False),
])
def test_a_host_header_is_loopback_only_when_it_names_this_machine(host: str | None, expected: bool) -> None:
    assert is_loopback_host(host) is expected


def test_a_tenant_is_a_hash_of_its_key_and_an_admin_key_is_an_api_key_too() -> None:
    auth = AuthConfig(api_keys=(KEY,), admin_keys=(OTHER,))
    assert is_authorized(auth, OTHER) and is_authorized(auth, KEY)
    tenant = principal_of(auth, KEY)
    assert tenant.tenant == tenant_of(KEY) and KEY not in tenant.tenant and not tenant.is_admin
    assert principal_of(auth, OTHER).is_admin
    assert tenant_of(KEY) != tenant_of(OTHER)
    assert principal_of(AuthConfig(), None) == OPERATOR  # auth off: one tenant, which sees all


@pytest.mark.parametrize("query", [
    "api_key={k}", "token={k}", "key={k}", "access_token={k}", "voice=joe&api_key={k}&codec=opus",
    "API_KEY={k}", "x-api-key={k}", "client_secret={k}",
])
def test_key_like_query_values_are_redacted_and_the_rest_is_kept(query: str) -> None:
    line = '127.0.0.1:5 - "GET /v1/stream?' + query.format(k=KEY) + ' HTTP/1.1" 101'
    redacted = redact(line)
    assert KEY not in redacted and "[redacted]" in redacted
    assert redacted.startswith('127.0.0.1:5 - "GET /v1/stream?') and redacted.endswith(' HTTP/1.1" 101')
    assert redact("/v1/stream?voice=joe&codec=opus") == "/v1/stream?voice=joe&codec=opus"


def test_session_tokens_are_single_use_expire_and_stay_bounded() -> None:
    tokens = SessionTokens(ttl_s=60, max_tokens=2)
    issued = tokens.issue(KEY, now=100.0)
    assert issued is not None
    token, expires_at = issued
    assert expires_at == 160.0 and KEY not in token
    assert tokens.redeem(token, now=101.0) == KEY
    assert tokens.redeem(token, now=101.0) is None  # spent
    late = tokens.issue(KEY, now=100.0)
    assert late is not None and tokens.redeem(late[0], now=160.0) is None  # expired
    assert tokens.issue(KEY, now=200.0) and tokens.issue(KEY, now=200.0)
    assert tokens.issue(KEY, now=200.0) is None  # bounded: two outstanding
    assert tokens.issue(KEY, now=300.0) is not None  # the expired ones make room
    assert tokens.redeem("vxt_made-up", now=0.0) is None
    per_key = SessionTokens(ttl_s=60, max_per_key=2)
    assert per_key.issue(KEY, now=0.0) and per_key.issue(KEY, now=0.0)
    assert per_key.issue(KEY, now=1.0) is None and per_key.issue(OTHER, now=1.0) is not None
    assert per_key.issue(KEY, now=61.0) is not None  # its expired ones went


def test_the_key_counter_caps_sockets_per_key_and_forgets_keys_no_socket_uses() -> None:
    counter = KeyCounter()
    assert counter.acquire(KEY, 2) and counter.acquire(KEY, 2)
    assert not counter.acquire(KEY, 2)
    assert counter.acquire(OTHER, 2)
    counter.release(KEY)
    assert counter.acquire(KEY, 2)
    for _ in range(2):
        counter.release(KEY)
    counter.release(OTHER)
    assert counter.counts == {}
