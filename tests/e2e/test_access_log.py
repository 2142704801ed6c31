"""No key in the server's log: a real `voxgate serve` on loopback, connected to with keys and
tokens in the URL, valid and not; its captured log never shows one (issue 21, "API keys in
the access log")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tests.e2e.test_hardening import close_code
from tests.support.server import start_server
from tests.support.wsclient import Client

KEY = "sk-secret-log-key-0123456789"
WRONG = "sk-wrong-log-key-9876543210"


def test_keys_and_tokens_in_urls_never_reach_the_log(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--log-level", "debug", env={"VOXGATE_API_KEYS": KEY})
    try:
        token = httpx.post(server.url + "/v1/session-tokens",
                           headers={"Authorization": f"Bearer {KEY}"}).json()["token"]
        spent = httpx.post(server.url + "/v1/session-tokens",
                           headers={"Authorization": f"Bearer {KEY}"}).json()["token"]

        async def sockets() -> list[int | None]:
            codes = []
            client = await Client.connect(f"{server.ws_url}?voice=joe&api_key={KEY}")
            await client.close()
            client = await Client.connect(f"{server.ws_url}?token={spent}")
            await client.close()
            for url in (f"{server.ws_url}?api_key={WRONG}", f"{server.ws_url}?token={token}x",
                        f"{server.ws_url}?token={spent}"):
                codes.append((await close_code(url))[0])
            return codes

        assert asyncio.run(sockets()) == [4401, 4401, 4401]
        for query in (f"api_key={KEY}", f"api_key={WRONG}", f"token={token}", f"key={KEY}&x=1"):
            httpx.get(f"{server.url}/v1/voices?{query}")
        httpx.get(f"{server.url}/healthz?access_token={KEY}")
    finally:
        server.stop()
    log = server.log()
    for secret in (KEY, WRONG, token, spent):
        assert secret not in log
    # the lines were written, with the values replaced
    assert log.count("api_key=[redacted]") >= 4 and "token=[redacted]" in log
    assert "GET /v1/voices?api_key=[redacted]" in log
    assert "WebSocket /v1/stream?voice=joe&api_key=[redacted]" in log
