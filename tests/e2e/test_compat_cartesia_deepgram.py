"""The Cartesia- and Deepgram-compatible sockets' wire over a real server on loopback.

Barge-in (`cancel`, `Clear`) cancels the engine's requests and stops the audio
at once; a bad message gets that protocol's error shape and the socket goes
on; word timestamps and the raw encodings decode at their stated rates;
Cartesia's flushes are answered with `flush_done` and its chunks carry the
engine's step time; an idle socket is closed the way each vendor closes it
(a second server, with a one-second idle timeout).
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


@pytest.fixture(scope="module")
def quick_idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("compat-idle"),
                        env={"VOXGATE_LIMIT_IDLE_TIMEOUT_S": "1"})
    yield proc
    proc.stop()


def _cartesia(context_id: str, transcript: str, *, more: bool, encoding: str = "pcm_s16le",
              rate: int = 16000) -> str:
    return json.dumps({"model_id": "sonic-2", "transcript": transcript, "context_id": context_id,
                       "voice": {"mode": "id", "id": "joe"}, "continue": more,
                       "add_timestamps": True,
                       "output_format": {"container": "raw", "encoding": encoding,
                                         "sample_rate": rate}})


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
    kinds = {"pcm_s16le": "pcm_s16le", "pcm_f32le": "pcm_f32le", "pcm_mulaw": "mulaw",
             "pcm_alaw": "alaw"}
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


def test_cartesia_cancel_stops_the_audio_and_cancels_the_engine_work(
        voxgate: ServerProcess) -> None:
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


def test_a_bad_cartesia_message_gets_a_cartesia_error_and_the_socket_goes_on(
        voxgate: ServerProcess) -> None:
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
        headers = {"Authorization": "Token unused-key"}
        async with websockets.connect(url, additional_headers=headers) as ws:
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


def test_cartesia_flushes_are_answered_with_flush_done_after_their_audio(
        voxgate: ServerProcess) -> None:
    busy_before = voxgate.metric("voxgate_engine_busy_seconds_total")

    async def run() -> list[dict[str, Any]]:
        url = f"ws://127.0.0.1:{voxgate.port}/tts/websocket?api_key=unused-key"
        async with websockets.connect(url) as ws:
            # Cartesia's manual flush: an empty transcript with continue and flush, same context
            for part in ("The first part is spoken here. ", "And then the second part. "):
                await ws.send(_cartesia("f", part, more=True))
                flush = json.loads(_cartesia("f", "", more=True))
                await ws.send(json.dumps({**flush, "flush": True}))
            await ws.send(_cartesia("f", "", more=False))
            return await _cartesia_until_done(ws, "f")
    messages = asyncio.run(run())
    busy_ms = 1000.0 * (voxgate.metric("voxgate_engine_busy_seconds_total") - busy_before)
    kinds = [(m["type"], m.get("flush_id")) for m in messages
             if m["type"] in ("chunk", "flush_done", "done")]
    # group 1's chunks, its flush_done, group 2's chunks, its flush_done, then done
    first_done = kinds.index(("flush_done", 1))
    assert set(kinds[:first_done]) == {("chunk", 1)}
    assert set(kinds[first_done + 1:-2]) == {("chunk", 2)}
    assert kinds[-2:] == [("flush_done", 2), ("done", None)]
    flush_done = next(m for m in messages if m["type"] == "flush_done")
    assert flush_done == {"type": "flush_done", "context_id": "f", "status_code": 206,
                          "done": False, "flush_done": True, "flush_id": 1}
    # step_time: the engine's step time behind each chunk (ms); each step is counted once for
    # every segment of this context it made (up to the four the session keeps in flight)
    chunks = [m for m in messages if m["type"] == "chunk"]
    assert all(m["step_time"] > 0 for m in chunks[:-1])
    assert 1.0 < sum(m["step_time"] for m in chunks) <= 4 * busy_ms + 1.0


def test_an_idle_cartesia_socket_is_closed_normally_with_no_message(
        quick_idle: ServerProcess) -> None:
    async def run() -> tuple[list[Any], int | None]:
        url = f"ws://127.0.0.1:{quick_idle.port}/tts/websocket?api_key=unused-key"
        async with websockets.connect(url) as ws:
            await ws.send(_cartesia("i", "Said before going quiet.", more=False))
            received: list[Any] = []
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    received.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return received, ws.close_code
    received, code = asyncio.run(run())
    assert code == 1000
    assert received[-1]["type"] == "done"  # the turn, then the close: no error frame for the idle


def test_an_idle_deepgram_socket_is_closed_1011_with_net_0001(quick_idle: ServerProcess) -> None:
    async def run() -> tuple[list[Any], int | None, str | None]:
        url = f"ws://127.0.0.1:{quick_idle.port}/v1/speak?model=joe&encoding=linear16&sample_rate=16000"
        headers = {"Authorization": "Token unused-key"}
        async with websockets.connect(url, additional_headers=headers) as ws:
            received: list[Any] = []
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    received.append(await asyncio.wait_for(ws.recv(), 30))
            return received, ws.close_code, ws.close_reason
    received, code, reason = asyncio.run(run())
    assert code == 1011 and reason is not None and reason.startswith("NET-0001")
    # nothing else: the reason says it
    assert [json.loads(m)["type"] for m in received] == ["Metadata"]
