"""Security, second pass (issue 44), against real servers with two keys on loopback.

A voice id is resolved in the caller's tenant on every route, and no answer
lists voices: key B, and a caller with no key, read nothing of key A's voice
ids from any HTTP body, socket frame or close reason; key B asking for key A's
voice by id gets exactly what an id that never existed gets. The key and the
Origin are checked before anything about the voice. A key sent in an
ElevenLabs first message counts against that key's fair share, as a header
key does. The bounds on clients that never finish (keyless sockets, stalled
uploads, trickled speech bodies) are in tests/e2e/test_security_bounds.py.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import websockets

from tests.e2e.test_voices import make_wav
from tests.support.server import ServerProcess, start_server
from tests.support.wsclient import Client

KEY_A = "sk-security-a-0123456789"
KEY_B = "sk-security-b-0123456789"
ADMIN = "sk-security-admin-0123456789"
PCM = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000}


@pytest.fixture(scope="module")
def two_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Keys A and B and an admin key; 16 engine contexts, of which one key holds at most 8."""
    proc = start_server(tmp_path_factory.mktemp("security"), "--max-contexts", "16",
                        env={"VOXGATE_API_KEYS": f"{KEY_A},{KEY_B}", "VOXGATE_ADMIN_KEYS": ADMIN,
                             "VOXGATE_MAX_ENGINE_SHARE": "0.5",
                             "VOXGATE_LIMIT_IDLE_TIMEOUT_S": "30"})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def a_voice(two_keys: ServerProcess) -> str:
    """A voice of key A's, with an id nobody could guess."""
    voice_id = "a-" + secrets.token_hex(6)
    response = httpx.post(two_keys.url + "/v1/voices", headers=bearer(KEY_A), timeout=60,
                          data={"id": voice_id, "text": "Hello, this is me."},
                          files={"audio": ("ref.wav", make_wav(1.5), "audio/wav")})
    assert response.status_code == 201, response.text
    return voice_id


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def run(coro: Any, timeout: float = 180) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def exchange(url: str, send: Sequence[dict[str, Any] | str] = (), *,
                   headers: dict[str, str] | None = None, quiet_s: float = 3.0) -> list[str]:
    """Everything a socket answers: text frames, then `close <code> <reason>` (or `open` when
    it stays open and quiet for `quiet_s`), or the handshake's refusal with its body."""
    out: list[str] = []
    try:
        async with websockets.connect(url, additional_headers=headers or {}, max_size=None) as ws:
            try:
                for message in send:
                    await ws.send(message if isinstance(message, str) else json.dumps(message))
            except websockets.ConnectionClosed:
                pass  # refused already: what it said is still to be read
            while True:
                try:
                    frame = await asyncio.wait_for(ws.recv(), quiet_s)
                except asyncio.TimeoutError:
                    out.append("open")
                    return out
                if isinstance(frame, str):
                    out.append(frame)
    except websockets.ConnectionClosed as closed:
        out.append(f"close {closed.rcvd.code} {closed.rcvd.reason}" if closed.rcvd
                   else "close none")
    except websockets.InvalidStatus as refused:
        out.append(f"refused {refused.response.status_code} {refused.response.body!r}")
    return out


def ws(server: ServerProcess, path: str) -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


def elevenlabs(server: ServerProcess, voice_id: str) -> str:
    return ws(server, f"/v1/text-to-speech/{voice_id}/stream-input?output_format=pcm_16000")


def cartesia_turn(voice_id: str) -> dict[str, Any]:
    return {"transcript": "Hello there.", "context_id": "c", "continue": False,
            "voice": {"mode": "id", "id": voice_id}, "output_format": PCM}


async def every_route(server: ServerProcess, voice_id: str, key: str | None,
                      origin: str | None = None, *, delete: bool = True) -> dict[str, list[str]]:
    """Ask for `voice_id` on every route, as `key` (None: no key); each route's answers.
    `delete`: DELETE it too (not for its owner, who would lose it)."""
    headers = bearer(key) if key else {}
    if origin:
        headers["Origin"] = origin
    answers: dict[str, list[str]] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        requests = {
            "speech": http.post("/v1/audio/speech", headers=headers,
                                json={"input": "Hello.", "voice": voice_id,
                                      "response_format": "pcm"}),
            "voices.get": http.get(f"/v1/voices/{voice_id}", headers=headers),
            "voices.base_voice": http.post(
                "/v1/voices", headers=headers, data={"text": "Hi there.", "base_voice": voice_id},
                files={"audio": ("ref.wav", make_wav(1.5), "audio/wav")}),
        }
        if delete:
            requests["voices.delete"] = http.delete(f"/v1/voices/{voice_id}", headers=headers)
        for name, request in requests.items():
            response = await request
            answers[name] = [f"{response.status_code} {response.text}"]
    query_key = f"&api_key={key}" if key else ""
    answers["stream.query"] = await exchange(ws(server, f"/v1/stream?voice={voice_id}{query_key}"),
                                             headers=headers)
    answers["stream.update"] = await exchange(ws(server, "/v1/stream"), headers=headers,
                                              send=[{"type": "session.update", "voice": voice_id}])
    answers["cartesia"] = await exchange(ws(server, "/tts/websocket?cartesia_version=2025-04-16"),
                                         headers={**headers, **({"X-API-Key": key} if key else {})},
                                         send=[cartesia_turn(voice_id)])
    eleven_headers = {k: v for k, v in headers.items() if k != "Authorization"}
    answers["elevenlabs.header"] = await exchange(
        elevenlabs(server, voice_id),
        headers={**eleven_headers, **({"xi-api-key": key} if key else {})},
        send=[{"text": " "}, {"text": "Hello there. "}, {"text": ""}])
    first: dict[str, Any] = {"text": " ", **({"xi_api_key": key} if key else {})}
    answers["elevenlabs.first_message"] = await exchange(
        elevenlabs(server, voice_id), headers=eleven_headers,
        send=[first, {"text": "Hello there. "}, {"text": ""}], quiet_s=8.0)
    answers["deepgram"] = await exchange(
        ws(server, f"/v1/speak?model={voice_id}&sample_rate=16000"),
        headers={**eleven_headers, **({"Authorization": f"Token {key}"} if key else {})},
        send=[{"type": "Speak", "text": "Hello there."}, {"type": "Flush"}, {"type": "Close"}])
    return answers


def without(answers: dict[str, list[str]], text: str) -> dict[str, list[str]]:
    """The answers with `text` replaced (so two runs that differ only in the id compare)."""
    return {route: [a.replace(text, "<id>") for a in out] for route, out in answers.items()}


def scrub_ids(answers: dict[str, list[str]]) -> dict[str, list[str]]:
    """Per-connection values that differ between any two runs: session ids, request ids."""
    out: dict[str, list[str]] = {}
    for route, frames in answers.items():
        kept = []
        for frame in frames:
            try:
                message = json.loads(frame)
            except ValueError:
                kept.append(frame)
                continue
            if isinstance(message, dict):
                for field in ("session_id", "request_id", "model_uuid"):
                    message.pop(field, None)
            kept.append(json.dumps(message, sort_keys=True))
        out[route] = kept
    return out


def test_no_answer_to_another_key_or_to_no_key_names_a_tenants_voice(two_keys: ServerProcess,
                                                                       a_voice: str) -> None:
    missing = "nope-" + secrets.token_hex(4)
    seen: list[str] = []
    for key, origin in [(KEY_B, None), (None, None), (None, "https://evil.example"),
                        (KEY_B, "https://evil.example")]:
        answers = run(every_route(two_keys, missing, key, origin))
        seen += [a for out in answers.values() for a in out]
        if key is None:  # nothing about a voice before the key: every route refuses first
            assert all("unknown_voice" not in a and missing not in a for out in answers.values()
                       for a in out), answers
    # the unknown_voice answers name the id asked for and where the list is, nothing more
    unknown = [a for a in seen if '"unknown_voice"' in a]  # bodies and frames, not close reasons
    assert len(unknown) >= 6
    assert not [a for a in unknown if "GET /v1/voices" not in a or "joe" in a]
    with httpx.Client(base_url=two_keys.url, timeout=30) as http:
        for path in ("/v1/voices", "/healthz", "/readyz", "/metrics", "/"):
            for headers in (bearer(KEY_B), {}):
                seen.append(http.get(path, headers=headers).text)
        listing = http.get("/v1/voices", headers=bearer(KEY_B)).json()
        assert "joe" in {v["id"] for v in listing["voices"]}  # the built-in voices are everyone's
    assert seen and not [a for a in seen if a_voice in a]


def test_another_keys_voice_is_unknown_on_every_route_as_a_voice_that_never_existed(
        two_keys: ServerProcess, a_voice: str) -> None:
    never = "a-" + secrets.token_hex(6)  # the same shape as key A's id
    theirs = scrub_ids(without(run(every_route(two_keys, a_voice, KEY_B)), a_voice))
    absent = scrub_ids(without(run(every_route(two_keys, never, KEY_B)), never))
    assert theirs == absent
    assert any("unknown_voice" in a for a in theirs["speech"] + theirs["stream.query"]
               + theirs["cartesia"] + theirs["elevenlabs.header"]
               + theirs["elevenlabs.first_message"])
    # Deepgram's model falls back to the default voice with a Warning, for either id
    metadata = json.loads(theirs["deepgram"][0])
    assert metadata["type"] == "Metadata" and metadata["model_name"] == "joe"


def test_a_key_speaks_with_its_own_voice_on_every_route_and_an_admin_with_every_voice(
        two_keys: ServerProcess, a_voice: str) -> None:
    for key in (KEY_A, ADMIN):
        answers = run(every_route(two_keys, a_voice, key, delete=False))
        assert answers["speech"][0].startswith("200 ")
        assert answers["voices.get"][0].startswith("200 ")
        assert not any("unknown_voice" in a
                       for route in ("stream.query", "stream.update", "cartesia",
                                      "elevenlabs.header", "elevenlabs.first_message")
                       for a in answers[route]), answers
        assert any('"type":"chunk"' in a.replace(" ", "") for a in answers["cartesia"])
        assert any('"audio":"' in a.replace(" ", "") for a in answers["elevenlabs.first_message"])
        metadata = json.loads(answers["deepgram"][0])
        assert metadata["model_name"] == a_voice and "Warning" not in " ".join(answers["deepgram"])


def test_elevenlabs_checks_the_key_and_the_origin_before_the_voice(two_keys: ServerProcess) -> None:
    async def scenario() -> dict[str, list[str]]:
        return {
            "foreign origin, a key": await exchange(
                elevenlabs(two_keys, "nope"), headers={"xi-api-key": KEY_B, "Origin": "https://evil.example"}),
            "no key, a wrong first message": await exchange(
                elevenlabs(two_keys, "nope"),
                send=[{"text": " ", "xi_api_key": "sk-wrong-000000"}]),
            "a key": await exchange(elevenlabs(two_keys, "nope"), headers={"xi-api-key": KEY_B}),
        }
    answers = run(scenario())
    assert answers["foreign origin, a key"][-1].startswith("close 4403")
    assert '"unauthorized"' in answers["no key, a wrong first message"][0]
    assert answers["no key, a wrong first message"][-1].startswith("close 4401")
    assert '"unknown_voice"' in answers["a key"][0]
    assert answers["a key"][-1].startswith("close 1008")


# -- fair share, however the key arrives ----------------------------------------------------------

async def hoard(url: str, headers: dict[str, str], first: dict[str, Any]) -> tuple[Any, list[str]]:
    """An ElevenLabs multi-context socket whose 16 turns each reach the engine and never end."""
    sock = await websockets.connect(url, additional_headers=headers, max_size=None)
    await sock.send(json.dumps({"text": " ", "context_id": "c0", **first}))
    for n in range(16):
        await sock.send(json.dumps({"text": "Hold this. And", "context_id": f"c{n}"}))
    errors: list[str] = []
    return sock, errors


async def drain(sock: Any, errors: list[str], quiet_s: float = 1.5) -> None:
    """Read until the socket has been quiet for `quiet_s`, keeping the error codes."""
    while True:
        try:
            frame = await asyncio.wait_for(sock.recv(), quiet_s)
        except asyncio.TimeoutError:
            return
        message = json.loads(frame)
        if "error" in message:
            errors.append(str(message["error"]))


def test_a_key_sent_in_the_first_message_counts_against_that_keys_share(
        two_keys: ServerProcess) -> None:
    url = ws(two_keys, "/v1/text-to-speech/joe/multi-stream-input?output_format=pcm_16000")

    async def scenario() -> float:
        opened = []
        try:
            for _ in range(4):
                opened.append(await hoard(url, {"xi-api-key": KEY_A}, {}))
            for _ in range(4):
                opened.append(await hoard(url, {}, {"xi_api_key": KEY_A}))
            await asyncio.gather(*(drain(sock, errors) for sock, errors in opened))
            refused = [code for _, errors in opened for code in errors]
            assert refused and set(refused) == {"rate_limited"}, refused
            await two_keys.metric_reaches("voxgate_engine_active_contexts", 8)
            other = await Client.connect(two_keys.ws_url, additional_headers=bearer(KEY_B))
            try:
                started = time.monotonic()
                await other.send({"type": "text", "context_id": "t", "text": "Key B speaks.",
                                  "flush": True})
                while not other.received.audio_of("t"):
                    message = await other.recv()
                    assert message["type"] != "error", message
                return time.monotonic() - started
            finally:
                await other.close()
        finally:
            for sock, _ in opened:
                await sock.close()

    assert run(scenario()) < 2.0
