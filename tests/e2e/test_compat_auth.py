"""voxgate's API keys on the vendor sockets, each taken where its vendor sends it.

A real `voxgate serve` with `VOXGATE_API_KEYS` on loopback: ElevenLabs takes
`xi-api-key` or `xi_api_key` in the first message, Cartesia `X-API-Key` or
`?api_key=`, Deepgram `Authorization: Token`; a socket without a valid key
gets its vendor's error and nothing is synthesized for it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import websockets

from tests.support.server import ServerProcess, start_server
from tests.support.vendor_sockets import deepgram_speak

KEY = "compat-test-key-1234"


@pytest.fixture(scope="module")
def voxgate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("compat-auth"), env={"VOXGATE_API_KEYS": KEY})
    yield proc
    proc.stop()


def _elevenlabs(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/text-to-speech/joe/multi-stream-input?output_format=pcm_16000"


async def _turn(ws: Any, first: dict[str, Any]) -> list[dict[str, Any]]:
    await ws.send(json.dumps(first))
    await ws.send(json.dumps({"text": "Keys checked. ", "context_id": "a"}))
    await ws.send(json.dumps({"context_id": "a", "flush": True}))
    await ws.send(json.dumps({"context_id": "a", "close_context": True}))
    out = []
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 60))
        out.append(message)
        if message.get("isFinal"):
            return out


def test_elevenlabs_takes_the_key_in_the_header_or_in_the_first_message(
        voxgate: ServerProcess) -> None:
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with websockets.connect(_elevenlabs(voxgate),
                                      additional_headers={"xi-api-key": KEY}) as ws:
            by_header = await _turn(ws, {"text": " ", "context_id": "a"})
        async with websockets.connect(_elevenlabs(voxgate)) as ws:
            by_message = await _turn(ws, {"text": " ", "context_id": "a", "xi_api_key": KEY})
        return by_header, by_message
    for turn in asyncio.run(run()):
        assert any(m.get("audio") for m in turn)


def test_elevenlabs_without_a_valid_key_gets_an_error_and_a_close(voxgate: ServerProcess) -> None:
    submitted = voxgate.metric("voxgate_engine_requests_submitted_total")

    async def run() -> tuple[dict[str, Any], int | None]:
        async with websockets.connect(_elevenlabs(voxgate)) as ws:
            await ws.send(json.dumps({"text": "Hello there. ", "context_id": "a",
                                      "xi_api_key": "wrong-key-000"}))
            error = json.loads(await asyncio.wait_for(ws.recv(), 30))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return error, ws.close_code
    error, code = asyncio.run(run())
    assert error["error"] == "unauthorized" and code == 4401
    assert voxgate.metric("voxgate_engine_requests_submitted_total") == submitted


def test_cartesia_and_deepgram_refuse_a_missing_key_and_take_theirs(voxgate: ServerProcess) -> None:
    async def refused(url: str) -> tuple[dict[str, Any], int | None]:
        async with websockets.connect(url) as ws:
            error = json.loads(await asyncio.wait_for(ws.recv(), 30))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return error, ws.close_code

    async def deepgram_speaks() -> bytes:
        url = f"ws://127.0.0.1:{voxgate.port}/v1/speak?model=joe&sample_rate=16000"
        async with websockets.connect(url,
                                      additional_headers={"Authorization": f"Token {KEY}"}) as ws:
            return await deepgram_speak(ws, "Token accepted.")

    async def cartesia_speaks() -> list[dict[str, Any]]:
        url = f"ws://127.0.0.1:{voxgate.port}/tts/websocket?api_key={KEY}&cartesia_version=2025-04-16"
        async with websockets.connect(url) as ws:
            output = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000}
            await ws.send(json.dumps({"transcript": "Key accepted.", "context_id": "c",
                                      "continue": False, "voice": {"mode": "id", "id": "joe"},
                                      "output_format": output}))
            out = []
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                out.append(message)
                if message["type"] == "done":
                    return out

    cartesia_error, cartesia_code = asyncio.run(refused(f"ws://127.0.0.1:{voxgate.port}/tts/websocket"))
    assert cartesia_error["type"] == "error" and cartesia_error["status_code"] == 401
    deepgram_error, deepgram_code = asyncio.run(refused(f"ws://127.0.0.1:{voxgate.port}/v1/speak"))
    assert deepgram_error["type"] == "Error" and deepgram_error["err_code"] == "unauthorized"
    assert cartesia_code == deepgram_code == 4401
    assert len(asyncio.run(deepgram_speaks())) > 16000  # over half a second of PCM16 at 16 kHz
    assert any(m["type"] == "chunk" for m in asyncio.run(cartesia_speaks()))
