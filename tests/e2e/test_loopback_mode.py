"""Loopback mode (auth off) against a real server: only this machine's pages reach it
(issue 21, "Loopback mode is reachable from web pages")."""

from __future__ import annotations

import asyncio
import base64
import os
import socket

import httpx
import pytest
import websockets

from tests.e2e.test_voices import make_wav
from tests.support.server import ServerProcess
from tests.support.wsclient import Client


def handshake(server: ServerProcess, host: str, origin: str | None) -> str:
    """A raw WebSocket upgrade with the given Host and Origin (what a DNS-rebound page sends);
    the status line of the answer."""
    key = base64.b64encode(os.urandom(16)).decode()
    lines = ["GET /v1/stream HTTP/1.1", f"Host: {host}", "Upgrade: websocket",
             "Connection: Upgrade", f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
    if origin is not None:
        lines.append(f"Origin: {origin}")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer.split(b"\r\n", 1)[0].decode()


def test_a_dns_rebound_page_gets_no_session(server: ServerProcess) -> None:
    rebound = f"evil.example:{server.port}"
    assert " 403 " in handshake(server, rebound, f"http://{rebound}") + " "
    assert " 101 " in handshake(server, f"127.0.0.1:{server.port}", None) + " "  # the same, at home


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example",
                                  "127.0.0.1.nip.io"])
def test_http_requests_under_a_foreign_host_name_are_refused_with_421(
        server: ServerProcess, host: str) -> None:
    response = httpx.get(server.url + "/v1/voices", headers={"Host": host})
    assert (response.status_code, response.json()["code"]) == (421, "misdirected_request")
    # the web client too
    assert httpx.get(server.url + "/", headers={"Host": host}).status_code == 421


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_loopback_host_names_are_served(server: ServerProcess, host: str) -> None:
    response = httpx.get(server.url + "/v1/voices", headers={"Host": f"{host}:{server.port}"})
    assert response.status_code == 200


def test_the_socket_checks_origin_against_the_configured_origins_not_the_host(
        server: ServerProcess) -> None:
    async def close_code(origin: str) -> int | None:
        async with websockets.connect(server.ws_url, origin=origin) as ws:  # type: ignore[arg-type]
            try:
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            except websockets.ConnectionClosed as closed:
                return closed.rcvd.code if closed.rcvd else None

    assert asyncio.run(close_code("https://evil.example")) == 4403
    # another local app
    assert asyncio.run(close_code(f"http://localhost:{server.port + 1}")) == 4403

    async def own_page() -> None:  # the web client this server serves
        client = await Client.connect(server.ws_url, origin=f"http://127.0.0.1:{server.port}")  # type: ignore[arg-type]
        await client.close()

    asyncio.run(own_page())


def test_a_foreign_page_cannot_register_or_delete_voices(server: ServerProcess) -> None:
    files = {"audio": ("ref.wav", make_wav(1.5), "audio/wav")}
    data = {"id": "planted", "text": "Hello, this is me."}
    foreign = {"Origin": "https://evil.example"}
    response = httpx.post(server.url + "/v1/voices", data=data, files=files, headers=foreign,
                          timeout=60)
    assert (response.status_code, response.json()["code"]) == (403, "forbidden_origin")
    assert httpx.get(server.url + "/v1/voices/planted").status_code == 404
    own = {"Origin": server.url}
    assert httpx.post(server.url + "/v1/voices", data=data, files=files, headers=own,
                      timeout=60).status_code == 201
    refused = httpx.delete(server.url + "/v1/voices/planted", headers=foreign)
    assert refused.status_code == 403
    assert httpx.get(server.url + "/v1/voices/planted").status_code == 200
    assert httpx.delete(server.url + "/v1/voices/planted", headers=own).status_code == 200
    # reads: CORS guards them
    assert httpx.get(server.url + "/v1/voices", headers=foreign).status_code == 200


def test_a_foreign_page_cannot_post_a_text_plain_speech_request(server: ServerProcess) -> None:
    """A "simple" request needs no preflight, so the browser sends it: the origin check stops it."""
    body = '{"input": "Spoken for a foreign page.", "voice": "joe"}'
    response = httpx.post(server.url + "/v1/audio/speech", content=body,
                          headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert (response.status_code, response.json()["code"]) == (403, "forbidden_origin")
