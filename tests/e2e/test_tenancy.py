"""Tenancy against a real server on loopback: each key sees and deletes its own voices only;
an admin key sees all; built-in names cannot be registered over (issue 21, "No tenancy")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.test_voices import make_wav
from tests.support.server import ServerProcess, start_server

KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-0123456789"
ADMIN = "sk-admin-key-0123456789"


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("tenancy"),
                        env={"VOXGATE_API_KEYS": f"{KEY_A},{KEY_B}", "VOXGATE_ADMIN_KEYS": ADMIN,
                             "VOXGATE_VOICE_QUOTA_MAX_VOICES_PER_OWNER": "2",
                             "VOXGATE_VOICE_QUOTA_MAX_VOICES": "4"})
    yield proc
    proc.stop()


def call(server: ServerProcess, method: str, path: str, key: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {key}"},
                         timeout=60, **kwargs)


def register(server: ServerProcess, key: str, voice_id: str) -> httpx.Response:
    return call(server, "POST", "/v1/voices", key,
                data={"id": voice_id, "text": "Hello, this is me."},
                files={"audio": ("ref.wav", make_wav(1.5), "audio/wav")})


def ids(server: ServerProcess, key: str) -> set[str]:
    return {v["id"] for v in call(server, "GET", "/v1/voices", key).json()["voices"]}


def test_another_key_can_neither_list_read_nor_delete_a_voice_and_an_admin_can(
        tenants: ServerProcess) -> None:
    assert register(tenants, KEY_A, "alice-voice").status_code == 201
    assert "alice-voice" in ids(tenants, KEY_A) and "joe" in ids(tenants, KEY_B)
    assert "alice-voice" not in ids(tenants, KEY_B)
    read = call(tenants, "GET", "/v1/voices/alice-voice", KEY_B)
    assert (read.status_code, read.json()["code"]) == (404, "unknown_voice")
    gone = call(tenants, "DELETE", "/v1/voices/alice-voice", KEY_B)
    assert (gone.status_code, gone.json()["code"]) == (404, "unknown_voice")
    assert call(tenants, "GET", "/v1/voices/alice-voice", KEY_A).status_code == 200  # still there
    assert "alice-voice" in ids(tenants, ADMIN)
    assert call(tenants, "GET", "/v1/voices/alice-voice", ADMIN).json()["id"] == "alice-voice"
    assert call(tenants, "DELETE", "/v1/voices/alice-voice", ADMIN).status_code == 200
    assert "alice-voice" not in ids(tenants, KEY_A)


@pytest.mark.parametrize("voice_id",
                         ["alloy", "Shimmer", "joe", "en_US-joe-medium", "en_GB-anna-high"])
def test_a_built_in_name_cannot_be_registered_over(tenants: ServerProcess, voice_id: str) -> None:
    response = register(tenants, KEY_B, voice_id)
    assert (response.status_code, response.json()["code"]) == (409, "reserved_voice_id")
    assert voice_id not in ids(tenants, ADMIN) - {"joe"}


def test_openai_clients_asking_for_alloy_still_hear_the_default_voice(
        tenants: ServerProcess) -> None:
    assert register(tenants, KEY_B, "alloy").status_code == 409
    speech = call(tenants, "POST", "/v1/audio/speech", KEY_A,
                  json={"model": "tts-1", "voice": "alloy", "input": "Hi.",
                        "response_format": "pcm"})
    assert speech.status_code == 200 and len(speech.content) > 1000


def test_voice_count_quotas_hold_per_key_and_in_total(tenants: ServerProcess) -> None:
    made = [register(tenants, KEY_A, f"qa-{n}").status_code for n in range(3)]
    assert made == [201, 201, 403]
    over = register(tenants, KEY_A, "qa-9").json()
    assert over["code"] == "quota_exceeded" and "limit is 2" in over["message"]
    assert [register(tenants, KEY_B, f"qb-{n}").status_code for n in range(2)] == [201, 201]
    total = register(tenants, ADMIN, "qadmin")  # 4 voices stored: the server's own limit
    assert (total.status_code, total.json()["code"]) == (403, "quota_exceeded")
    assert call(tenants, "DELETE", "/v1/voices/qa-0", KEY_A).status_code == 200
    assert register(tenants, KEY_A, "qa-3").status_code == 201
    for key, voice_id in [(KEY_A, "qa-1"), (KEY_A, "qa-3"), (KEY_B, "qb-0"), (KEY_B, "qb-1")]:
        assert call(tenants, "DELETE", f"/v1/voices/{voice_id}", key).status_code == 200


def test_with_keys_on_the_host_header_is_not_restricted_to_loopback(tenants: ServerProcess) -> None:
    response = httpx.get(tenants.url + "/v1/voices", headers={"Host": "voice.example",
                                                              "Authorization": f"Bearer {KEY_A}"})
    assert response.status_code == 200


def test_the_policy_reserves_built_in_names_in_any_case_and_scopes_by_owner() -> None:
    from gateway.access.keys import OPERATOR, Principal
    from gateway.voices.policy import is_reserved, is_visible, may_delete

    assert all(is_reserved(v, {"joe"})
               for v in ("alloy", "ALLOY", "Joe", "en_US-amy-low", "de_DE-x-high"))
    assert not any(is_reserved(v, {"joe"}) for v in ("alloy2", "my-voice", "en_US-amy", "joey"))
    alice, bob = Principal("a" * 32), Principal("b" * 32)
    assert is_visible("a" * 32, alice) and not is_visible("a" * 32, bob)
    assert is_visible("a" * 32, OPERATOR)
    assert is_visible("", bob) and not may_delete("", bob) and may_delete("", OPERATOR)
    assert may_delete("a" * 32, alice) and not may_delete("a" * 32, bob)
