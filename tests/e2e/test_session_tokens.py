"""`POST /v1/session-tokens` against a real server: short-lived, single-use tokens that act for
the key that made them, usable as `?token=` on the socket (docs/protocol.md, "Connection")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.test_hardening import close_code
from tests.support.server import ServerProcess, start_server
from tests.support.wait import wait_until
from tests.support.wsclient import Client, speak

KEY = "sk-token-key-0123456789"
OTHER = "sk-token-other-0123456789"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("tokens"),
                        env={"VOXGATE_API_KEYS": f"{KEY},{OTHER}",
                             "VOXGATE_SESSION_TOKEN_TTL_S": "2",
                             "VOXGATE_MAX_SOCKETS_PER_KEY": "1"})
    yield proc
    proc.stop()


def issue(server: ServerProcess, key: str = KEY) -> tuple[str, float]:
    """A new token and the expiry (Unix time) the server gave it."""
    response = httpx.post(server.url + "/v1/session-tokens",
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert 0 < body["expires_at"] - time.time() <= 2.5
    assert response.headers["cache-control"] == "no-store"
    return str(body["token"]), float(body["expires_at"])


def new_token(server: ServerProcess, key: str = KEY) -> str:
    return issue(server, key)[0]


def test_a_token_opens_one_session_and_is_spent(secured: ServerProcess) -> None:
    token = new_token(secured)
    assert KEY not in token

    async def scenario() -> tuple[int | None, list[dict]]:
        client = await Client.connect(f"{secured.ws_url}?token={token}&voice=joe")
        await speak(client, "c1", "Hello with a token.")
        await client.close()
        return await close_code(f"{secured.ws_url}?token={token}")

    code, events = asyncio.run(scenario())
    assert code == 4401 and [e["code"] for e in events] == ["unauthorized"]


def test_a_token_expires_unused(secured: ServerProcess) -> None:
    """The server's wall clock against the expiry it stated (the rule itself, with the
    clock driven by hand: tests/unit/gateway/access/test_tokens.py)."""
    token, expires_at = issue(secured)
    wait_until(lambda: time.time() > expires_at, timeout=5, interval=0.05,
               message="the stated expiry never passed")
    code, events = asyncio.run(close_code(f"{secured.ws_url}?token={token}"))
    assert code == 4401 and [e["code"] for e in events] == ["unauthorized"]


def test_a_made_up_token_is_refused_and_tokens_do_not_authorize_http(
        secured: ServerProcess) -> None:
    assert asyncio.run(close_code(f"{secured.ws_url}?token=vxt_made-up-token"))[0] == 4401
    assert httpx.get(secured.url + f"/v1/voices?token={new_token(secured)}").status_code == 401


def test_only_a_key_in_the_header_can_make_tokens(secured: ServerProcess) -> None:
    assert httpx.post(secured.url + "/v1/session-tokens").status_code == 401
    assert httpx.post(secured.url + "/v1/session-tokens",
                      headers={"Authorization": "Bearer wrong-key-0000"}).status_code == 401
    by_query = httpx.post(secured.url + f"/v1/session-tokens?api_key={KEY}")
    assert by_query.status_code == 401  # a leaked URL must not mint more


def test_a_token_acts_for_the_key_that_made_it(secured: ServerProcess) -> None:
    """One socket per key here: a token of a key that holds its socket is refused, another key's is
    not."""
    async def scenario() -> tuple[int | None, list[dict]]:
        holder = await Client.connect(secured.ws_url,
                                      additional_headers={"Authorization": f"Bearer {KEY}"})
        try:
            refused = await close_code(f"{secured.ws_url}?token={new_token(secured, KEY)}")
            other = await Client.connect(f"{secured.ws_url}?token={new_token(secured, OTHER)}")
            await other.close()
            return refused
        finally:
            await holder.close()

    code, events = asyncio.run(scenario())
    assert code == 1013 and events[0]["code"] == "rate_limited"
