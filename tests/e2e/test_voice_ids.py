"""A deleted voice's id never passes to another tenant (docs/voices.md, "Deleting a voice in use").

Two real `voxgate serve` replicas share one voice store, with keys A and B, an admin key,
and an operator's voice from the assets folder that `--voice-for` maps. Key A's socket holds
its voice while A deletes it: key B asking for that id, on either replica, gets 409
`voice_exists`, then and after the socket lets go, and A's socket goes on speaking with A's
voice. The operator's mapped voice, deleted by an admin, cannot be taken by a tenant either.
A 409 for an id comes only after the upload itself was checked.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.test_voices import make_wav
from tests.support.server import ServerProcess, start_server
from tests.support.wsclient import Client, speak

KEY_A = "sk-voice-ids-a-0123456789"
KEY_B = "sk-voice-ids-b-0123456789"
ADMIN = "sk-voice-ids-admin-0123456789"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def register(server: ServerProcess, key: str, voice_id: str,
             audio: bytes | None = None) -> httpx.Response:
    return httpx.post(server.url + "/v1/voices", headers=bearer(key), timeout=60,
                      data={"id": voice_id, "text": "Hello, this is me."},
                      files={"audio": ("ref.wav", make_wav(2.0) if audio is None else audio,
                                       "audio/wav")})


@pytest.fixture(scope="module")
def replicas(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("voice-ids")
    assets = tmp / "assets"
    assets.mkdir()
    (assets / "narrator.wav").write_bytes(make_wav(2.0))
    (assets / "narrator.txt").write_text("Hello, I read the Chinese parts.")
    env = {"VOXGATE_DATA_DIR": str(tmp / "shared"), "VOXGATE_VOICE_ASSETS": str(assets),
           "VOXGATE_VOICE_SYNC_INTERVAL_S": "0.5", "VOXGATE_API_KEYS": f"{KEY_A},{KEY_B}",
           "VOXGATE_ADMIN_KEYS": ADMIN}
    servers = []
    for name in ("one", "two"):
        folder = tmp / name
        folder.mkdir()
        servers.append(start_server(folder, "--voice-for", "zh=narrator", env=env))
    yield servers[0], servers[1]
    for server in servers:
        server.stop()


def test_a_deleted_voice_id_stays_its_tenants_while_a_socket_holds_it_and_after(
        replicas: tuple[ServerProcess, ServerProcess]) -> None:
    one, two = replicas
    voice_id = "a-" + secrets.token_hex(6)
    assert register(one, KEY_A, voice_id).status_code == 201

    async def scenario() -> dict[str, Any]:
        client = await Client.connect(f"{one.ws_url}?voice={voice_id}",
                                      additional_headers=bearer(KEY_A))
        try:
            first = await asyncio.wait_for(speak(client, "t1", "My own voice, first turn."), 60)
            deleted = await asyncio.to_thread(
                httpx.delete, f"{one.url}/v1/voices/{voice_id}", headers=bearer(KEY_A), timeout=30)
            taken = [await asyncio.to_thread(register, server, KEY_B, voice_id)
                     for server in (one, two)]
            second = await asyncio.wait_for(speak(client, "t2", "Still my own voice, second turn."),
                                            60)
            return {"first": first, "deleted": deleted, "taken": taken, "second": second,
                    "errors": client.received.of("error"),
                    "frames": len(client.received.audio_of("t2"))}
        finally:
            await client.close()

    got = asyncio.run(scenario())
    assert got["deleted"].status_code == 200
    assert [(r.status_code, r.json()["code"]) for r in got["taken"]] == [(409, "voice_exists")] * 2
    assert got["second"]["audio_ms"] > 500 and got["frames"] > 0 and got["errors"] == []
    # the socket is gone: nobody holds the voice, and the id is still A's, on either replica
    for server in (one, two):
        assert register(server, KEY_B, voice_id).status_code == 409
    assert httpx.get(f"{two.url}/v1/voices/{voice_id}", headers=bearer(KEY_B),
                     timeout=30).status_code == 404
    assert register(two, KEY_A, voice_id).status_code == 201  # its owner takes it back


def test_the_operators_mapped_voice_cannot_be_taken_by_a_tenant_once_deleted(
        replicas: tuple[ServerProcess, ServerProcess]) -> None:
    one, two = replicas
    listing = httpx.get(one.url + "/v1/voices", headers=bearer(KEY_B), timeout=30).json()
    assert "narrator" in {v["id"] for v in listing["voices"]}  # the operator's: every key sees it
    assert httpx.delete(one.url + "/v1/voices/narrator", headers=bearer(ADMIN),
                        timeout=30).status_code == 200
    for server in (two, one):
        answer = register(server, KEY_B, "narrator")
        assert (answer.status_code, answer.json()["code"]) == (409, "voice_exists"), answer.text


def test_a_taken_id_is_told_only_after_the_upload_is_checked(
        replicas: tuple[ServerProcess, ServerProcess]) -> None:
    one, _ = replicas
    voice_id = "a-" + secrets.token_hex(6)
    assert register(one, KEY_A, voice_id).status_code == 201
    taken = register(one, KEY_B, voice_id, audio=b"x")
    free = register(one, KEY_B, "b-" + secrets.token_hex(6), audio=b"x")
    assert taken.status_code == free.status_code != 409
    assert taken.json()["code"] == free.json()["code"] != "voice_exists"
    assert register(one, KEY_B, voice_id).status_code == 409  # a whole, valid reference: told
