"""API keys: where they come from, how they are checked, whom they name, how many sockets each
holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.access.keys import (
    OPERATOR,
    AuthConfig,
    KeyCounter,
    is_authorized,
    load_keys,
    presented_key,
    principal_of,
    tenant_of,
)
from gateway.access.origins import check_exposure

KEY = "sk-voxgate-0123456789"
OTHER = "sk-voxgate-9876543210"


def test_keys_come_from_the_variable_and_the_file_without_comments_or_repeats(
        tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# team keys\n{OTHER}  # ops\n\n{KEY}\n", encoding="utf-8")
    env = {"VOXGATE_API_KEYS": f" {KEY}, ,another-key-123 ",
           "VOXGATE_API_KEYS_FILE": str(keys_file)}
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


def test_a_tenant_is_a_hash_of_its_key_and_an_admin_key_is_an_api_key_too() -> None:
    auth = AuthConfig(api_keys=(KEY,), admin_keys=(OTHER,))
    assert is_authorized(auth, OTHER) and is_authorized(auth, KEY)
    tenant = principal_of(auth, KEY)
    assert tenant.tenant == tenant_of(KEY) and KEY not in tenant.tenant and not tenant.is_admin
    assert principal_of(auth, OTHER).is_admin
    assert tenant_of(KEY) != tenant_of(OTHER)
    assert principal_of(AuthConfig(), None) == OPERATOR  # auth off: one tenant, which sees all


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
    assert counter.counts == {} and counter.num_open == 0


def test_the_key_counter_counts_every_open_socket_and_ignores_a_release_it_never_gave() -> None:
    counter = KeyCounter()
    assert counter.acquire(KEY, 5) and counter.acquire(OTHER, 5) and counter.acquire(KEY, 5)
    assert counter.num_open == 3
    counter.release("never-acquired")
    assert counter.num_open == 3
    counter.release(KEY)
    assert counter.num_open == 2 and counter.counts == {KEY: 1, OTHER: 1}
