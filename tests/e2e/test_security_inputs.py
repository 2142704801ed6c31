"""Hostile input on the vendor sockets and the key places, on a real server on loopback (issue 44).

- Deep nesting or a 400-digit number in any vendor frame is `bad_message`, with
  or without a key: never a 1011 close or a traceback in the log.
- ElevenLabs `voice_settings.speed` NaN, Infinity or 1e400 is `bad_message`.
- Deepgram takes its key as `Sec-WebSocket-Protocol: token, KEY`, and answers
  with the subprotocol `token`, as Deepgram does (what browsers need).
- The 101st session token for one key is refused naming the cap per key.
- No key reaches the log from any documented place, its parameter name plain or
  percent-encoded (`?api%5Fkey=`, `?%74oken=`), at `--log-level debug`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from tests.support.server import ServerProcess, start_server
from tests.support.vendor_sockets import deepgram_speak

KEY = "sk-inputs-key-0123456789"
TOKENS_KEY = "sk-inputs-tokens-0123456789"  # spends its session tokens: no other test uses it
PCM = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000}
DEEP = "[" * 100_000 + "]" * 100_000  # past the parser's recursion limit, under 1 MiB
HUGE = "1" * 400  # past a float; Python's int() caps at 4300 digits


def run(coro: Any, timeout: float = 180) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def voxgate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("inputs"), "--log-level", "debug",
                        env={"VOXGATE_API_KEYS": f"{KEY},{TOKENS_KEY}",
                             "VOXGATE_LIMIT_MAX_MESSAGE_BYTES": str(1024 * 1024)})
    yield proc
    proc.stop()


def url(server: ServerProcess, path: str) -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


async def answers(address: str, frames: list[str], *, headers: dict[str, str] | None = None,
                  quiet_s: float = 3.0) -> tuple[list[dict[str, Any]], int | None]:
    """Send `frames`; the JSON frames answered until the socket closes or stays quiet."""
    out: list[dict[str, Any]] = []
    async with websockets.connect(address, additional_headers=headers or {}, max_size=None) as ws:
        try:
            for frame in frames:
                await ws.send(frame)
        except websockets.ConnectionClosed:
            pass  # closed already: what it said is still to be read
        try:
            while True:
                frame = await asyncio.wait_for(ws.recv(), quiet_s)
                if isinstance(frame, str):
                    out.append(json.loads(frame))
        except asyncio.TimeoutError:
            return out, None
        except websockets.ConnectionClosed as closed:
            return out, closed.rcvd.code if closed.rcvd else None


def error_code(message: dict[str, Any]) -> str | None:
    """The code of any vendor's error frame (None for other frames)."""
    if message.get("type") == "error":  # Cartesia
        return str(message["title"])
    if message.get("type") in ("Error", "Warning"):  # Deepgram
        return str(message.get("err_code") or message.get("warn_code"))
    if isinstance(message.get("error"), str) and "message" in message:  # ElevenLabs
        return str(message["error"])
    return None


VENDORS = {
    "elevenlabs": ("/v1/text-to-speech/joe/multi-stream-input?output_format=pcm_16000",
                   {"xi-api-key": KEY}),
    "cartesia": ("/tts/websocket?cartesia_version=2025-04-16", {"X-API-Key": KEY}),
    "deepgram": ("/v1/speak?model=joe", {"Authorization": f"Token {KEY}"}),
}
MALFORMED = [DEEP, '{"text":' + "[" * 50_000 + "]" * 50_000 + "}", '{"text": NaN, "type": "Speak"}',
             '{"text": "Hi.", "type": "Speak", "speed": 1e400}', '{"text": Infinity}']
#: each vendor's numeric fields given a 400-digit integer (valid JSON, past any float)
HUGE_NUMBERS = {
    "elevenlabs": ['{"text": "Hi. ", "context_id": "a", "voice_settings": {"speed": ' + HUGE + "}}",
                   '{"text": "Hi. ", "context_id": ' + HUGE + "}"],
    "cartesia": ['{"context_id": "c", "transcript": "Hi.", "voice": {"mode": "id", "id": "joe"}, '
                 '"output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": '
                 + HUGE + "}}", '{"context_id": ' + HUGE + "}"],
    "deepgram": ['{"type": "Speak", "text": ' + HUGE + "}", '{"type": ' + HUGE + "}"],
}


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_deep_nesting_and_huge_numbers_are_refused_on_every_vendor_socket_which_lives_on(
        voxgate: ServerProcess, vendor: str) -> None:
    path, headers = VENDORS[vendor]
    out, code = run(answers(url(voxgate, path), MALFORMED + HUGE_NUMBERS[vendor], headers=headers))
    codes = [c for c in map(error_code, out) if c is not None]
    assert codes[:len(MALFORMED)] == ["bad_message"] * len(MALFORMED), out
    # a number past a float where an option goes: unusable, or an option out of range
    assert len(codes) == len(MALFORMED) + len(HUGE_NUMBERS[vendor]), out
    assert set(codes[len(MALFORMED):]) <= {"bad_message", "unsupported_option"}, out
    assert code is None  # still open: no 1011, no close at all
    assert "Traceback" not in voxgate.log()


def test_a_keyless_elevenlabs_socket_answers_malformed_frames_with_bad_message(
        voxgate: ServerProcess) -> None:
    path, _ = VENDORS["elevenlabs"]
    out, code = run(answers(url(voxgate, path), MALFORMED))
    assert [error_code(m) for m in out] == ["bad_message"] * len(MALFORMED), out
    assert code in (None, 1008)  # open until its authentication deadline
    assert "Traceback" not in voxgate.log()


@pytest.mark.parametrize("speed", ["NaN", "Infinity", "-Infinity", "1e400", '"fast"', "true"])
def test_an_elevenlabs_speed_that_is_not_a_finite_number_is_bad_message(voxgate: ServerProcess,
                                                                         speed: str) -> None:
    path, headers = VENDORS["elevenlabs"]
    frame = ('{"text": "Hello there. ", "context_id": "a", "voice_settings": {"speed": '
             + speed + "}}")
    out, code = run(answers(url(voxgate, path), [frame], headers=headers))
    assert [m["error"] for m in out if "error" in m][:1] == ["bad_message"], out
    assert not any(m.get("audio") for m in out) and code is None  # nothing spoken, the socket lives


def test_deepgram_takes_the_key_as_a_websocket_subprotocol_and_answers_token(
        voxgate: ServerProcess) -> None:
    async def scenario() -> tuple[str | None, bytes]:
        async with websockets.connect(url(voxgate, "/v1/speak?model=joe&sample_rate=16000"),
                                      subprotocols=["token", KEY]) as ws:  # type: ignore[list-item]
            return ws.subprotocol, await deepgram_speak(ws, "The subprotocol carried the key.")

    subprotocol, audio = run(scenario())
    assert subprotocol == "token" and len(audio) > 16000

    async def wrong() -> tuple[list[dict[str, Any]], int | None]:
        async with websockets.connect(url(voxgate, "/v1/speak?model=joe"),
                                      subprotocols=["token", "sk-wrong-key-000"]) as ws:  # type: ignore[list-item]
            frames = []
            try:
                while True:
                    frames.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
            except websockets.ConnectionClosed as closed:
                return frames, closed.rcvd.code if closed.rcvd else None

    frames, code = run(wrong())
    assert code == 4401 and frames[0]["err_code"] == "unauthorized"


def test_the_101st_session_token_for_one_key_is_refused_naming_the_cap_per_key(
        voxgate: ServerProcess) -> None:
    with httpx.Client(base_url=voxgate.url,
                      headers={"Authorization": f"Bearer {TOKENS_KEY}"}) as http:
        issued = [http.post("/v1/session-tokens") for _ in range(100)]
        assert {r.status_code for r in issued} == {200}
        refused = http.post("/v1/session-tokens")
    assert refused.status_code == 429 and refused.json()["code"] == "rate_limited"
    message = refused.json()["message"]
    assert "100 session tokens" in message and "this key" in message and "10000" not in message


def test_no_key_reaches_the_log_from_any_documented_place_plain_or_percent_encoded(
        voxgate: ServerProcess) -> None:
    names = ["api_key", "api%5Fkey", "%61pi_key", "token", "%74oken", "xi_api_key",
             "xi%5Fapi%5Fkey", "API_KEY", "access_token", "key"]

    async def sockets() -> None:
        for name in names:
            for path in ("/v1/stream", "/tts/websocket", "/v1/speak",
                         "/v1/text-to-speech/joe/stream-input"):
                try:
                    await answers(url(voxgate, f"{path}?{name}={KEY}&x=1"), [], quiet_s=0.5)
                except websockets.InvalidStatus:
                    pass
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"xi-api-key": KEY}, {"X-API-Key": KEY},
                        {"Authorization": f"Token {KEY}"}):
            for path in ("/v1/stream", "/tts/websocket", "/v1/speak",
                         "/v1/text-to-speech/joe/stream-input"):
                await answers(url(voxgate, path), ['{"text": " "}'], headers=headers, quiet_s=0.5)
        eleven = url(voxgate, "/v1/text-to-speech/joe/stream-input")
        await answers(eleven, [json.dumps({"text": " ", "xi_api_key": KEY})], quiet_s=0.5)
        await answers(eleven, [json.dumps({"text": " ", "authorization": f"Bearer {KEY}"})],
                      quiet_s=0.5)
        async with websockets.connect(url(voxgate, "/v1/speak"), subprotocols=["token", KEY]):  # type: ignore[list-item]
            pass

    run(sockets())
    with httpx.Client(base_url=voxgate.url) as http:
        token = http.post("/v1/session-tokens",
                          headers={"Authorization": f"Bearer {KEY}"}).json()["token"]
        for name in names:
            http.get(f"/v1/voices?{name}={KEY}")
            http.get(f"/healthz?{name}={KEY}")
    for name in ("token", "%74oken"):
        run(answers(url(voxgate, f"/v1/stream?{name}={token}"), [], quiet_s=0.5))
    log = voxgate.log()
    assert not [secret for secret in (KEY, TOKENS_KEY, token) if secret in log]
    assert "%74oken=[redacted]" in log and "api%5Fkey=[redacted]" in log  # the lines were written
