"""The Cartesia- and Deepgram-compatible sockets' wire over a real server on loopback.

Barge-in (`cancel`, `Clear`) cancels the engine's requests and stops the audio
at once; a bad message gets that protocol's error shape and the socket goes
on; word timestamps and the raw encodings decode at their stated rates.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import websockets

from gateway.compat.formats import OutputFormat, decode_raw
from tests.support.server import ServerProcess, start_server

LONG = " ".join(f"Sentence number {n} of a long answer goes on for a while." for n in range(30))


@pytest.fixture(scope="module")
def voxgate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("compat-cartesia-deepgram"))
    yield proc
    proc.stop()


def _cartesia(context_id: str, transcript: str, *, more: bool, encoding: str = "pcm_s16le",
              rate: int = 16000) -> str:
    return json.dumps({"model_id": "sonic-2", "transcript": transcript, "context_id": context_id,
                       "voice": {"mode": "id", "id": "joe"}, "continue": more, "add_timestamps": True,
                       "output_format": {"container": "raw", "encoding": encoding, "sample_rate": rate}})


async def _cartesia_until_done(ws: Any, context_id: str) -> list[dict[str, Any]]:
    out = []
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 60))
        out.append(message)
        if message.get("type") == "done" and message.get("context_id") == context_id:
            return out


@pytest.mark.parametrize(("encoding", "rate"), [("pcm_s16le", 22050), ("pcm_f32le", 44100),
                                                ("pcm_mulaw", 8000), ("pcm_alaw", 8000)])
def test_cartesia_context_speaks_with_word_timestamps_at_the_stated_rate(
        voxgate: ServerProcess, encoding: str, rate: int) -> None:
    text = "Good morning to you. The sun is out and the birds are singing."

    async def run() -> list[dict[str, Any]]:
        url = f"ws://127.0.0.1:{voxgate.port}/tts/websocket?cartesia_version=2025-04-16"
        async with websockets.connect(url, additional_headers={"X-API-Key": "unused-key"}) as ws:
            await ws.send(_cartesia("c1", text[:21], more=True, encoding=encoding, rate=rate))
            await ws.send(_cartesia("c1", text[21:], more=True, encoding=encoding, rate=rate))
            await ws.send(_cartesia("c1", "", more=False, encoding=encoding, rate=rate))
            return await _cartesia_until_done(ws, "c1")
    messages = asyncio.run(run())
    kinds = {"pcm_s16le": "pcm_s16le", "pcm_f32le": "pcm_f32le", "pcm_mulaw": "mulaw", "pcm_alaw": "alaw"}
    data = b"".join(base64.b64decode(m["data"]) for m in messages if m["type"] == "chunk")
    pcm = decode_raw(data, OutputFormat(kinds[encoding], rate))
    words: list[str] = []
    end_s = 0.0
    for message in messages:
        if message["type"] == "timestamps":
            stamps = message["word_timestamps"]
            words += stamps["words"]
            assert stamps["start"] == sorted(stamps["start"])
            end_s = stamps["end"][-1]
    assert words == text.split()
    assert abs(len(pcm) / rate - end_s) <= 0.05, (len(pcm) / rate, end_s)  # read at the stated rate
    assert 0.01 < float(np.sqrt(np.mean(pcm ** 2))) < 0.5


def test_cartesia_cancel_stops_the_audio_and_cancels_the_engine_work(voxgate: ServerProcess) -> None:
    cancelled_before = voxgate.metric("voxgate_engine_requests_cancelled_total")

    async def run() -> list[dict[str, Any]]:
        url = f"ws://127.0.0.1:{voxgate.port}/tts/websocket?api_key=unused-key&cartesia_version=2025-04-16"
        async with websockets.connect(url) as ws:
            await ws.send(_cartesia("long", LONG, more=True))
            while json.loads(await asyncio.wait_for(ws.recv(), 60)).get("type") != "chunk":
                pass
            await ws.send(json.dumps({"context_id": "long", "cancel": True}))
            await ws.send(_cartesia("after", "And now something else.", more=False))
            return await _cartesia_until_done(ws, "after")
    messages = asyncio.run(run())
    # the native session drops the cancelled context's queued audio before the next frame
    first_after = next(i for i, m in enumerate(messages) if m.get("context_id") == "after")
    assert not [m for m in messages[first_after:] if m.get("context_id") == "long"]
    assert voxgate.metric("voxgate_engine_requests_cancelled_total") > cancelled_before


def test_a_bad_cartesia_message_gets_a_cartesia_error_and_the_socket_goes_on(voxgate: ServerProcess) -> None:
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        url = f"ws://127.0.0.1:{voxgate.port}/tts/websocket"
        async with websockets.connect(url) as ws:
            await ws.send("{not json")
            bad_voice = json.loads(_cartesia("x", "Hi.", more=False))
            bad_voice["voice"]["id"] = "nobody"
            await ws.send(json.dumps(bad_voice))
            errors = [json.loads(await ws.recv()), json.loads(await ws.recv())]
            await ws.send(_cartesia("ok", "Still fine.", more=False))
            return errors, await _cartesia_until_done(ws, "ok")
    errors, turn = asyncio.run(run())
    assert [e["type"] for e in errors] == ["error", "error"]
    assert errors[0]["status_code"] == 400 and errors[1]["status_code"] == 404
    assert errors[1]["context_id"] == "x" and "nobody" in errors[1]["error"]
    assert any(m["type"] == "chunk" for m in turn)


def test_deepgram_speak_flush_clear_and_close(voxgate: ServerProcess) -> None:
    cancelled_before = voxgate.metric("voxgate_engine_requests_cancelled_total")

    async def run() -> tuple[list[Any], list[Any], int | None]:
        url = f"ws://127.0.0.1:{voxgate.port}/v1/speak?model=joe&encoding=linear16&sample_rate=16000"
        async with websockets.connect(url, additional_headers={"Authorization": "Token unused-key"}) as ws:
            first: list[Any] = []
            await ws.send(json.dumps({"type": "Speak", "text": "Hello from the first turn."}))
            await ws.send(json.dumps({"type": "Flush"}))
            while True:
                frame = await asyncio.wait_for(ws.recv(), 60)
                first.append(frame)
                if isinstance(frame, str) and json.loads(frame)["type"] == "Flushed":
                    break
            await ws.send(json.dumps({"type": "Speak", "text": LONG}))
            while not isinstance(await asyncio.wait_for(ws.recv(), 60), bytes):
                pass
            await ws.send(json.dumps({"type": "Clear"}))
            second: list[Any] = []
            while True:
                frame = await asyncio.wait_for(ws.recv(), 60)
                second.append(frame)
                if isinstance(frame, str) and json.loads(frame)["type"] == "Cleared":
                    break
            await ws.send(json.dumps({"type": "Bogus"}))
            warning = json.loads(await asyncio.wait_for(ws.recv(), 60))
            second.append(warning)
            await ws.send(json.dumps({"type": "Close"}))
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 60)
            return first, second, ws.close_code
    first, second, code = asyncio.run(run())
    assert json.loads(first[0])["type"] == "Metadata"
    audio = b"".join(f for f in first if isinstance(f, bytes))
    assert 1.0 < len(audio) / 2 / 16000 < 4.0
    assert json.loads(first[-1]) == {"type": "Flushed", "sequence_id": 0}
    assert second[-1]["type"] == "Warning" and second[-1]["warn_code"] == "bad_message"
    assert voxgate.metric("voxgate_engine_requests_cancelled_total") > cancelled_before
    assert code == 1000
