"""The socket's I/O loop (`ws.Connection`) around the session, on the real engine.

The websocket here is a stand-in (a queue of frames in, a list of frames out)
so that a test can stop reading, or go silent, on cue; the real uvicorn server
and real sockets are the end-to-end tests' (test_stream_e2e.py, test_hardening.py).
The engine is the real one, with the scripted backend.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from engine.engine import Engine, EngineConfig
from gateway.audio.codecs import decode_pcm16
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.state import AppState
from gateway.stream.encoding import MAX_ENCODING_MS, EncodeJob, EncodeWorker, OnDone
from gateway.stream.endpoint import Connection
from gateway.stream.options import Limits, SessionOptions
from gateway.stream.session import Session
from tests.support.scripted_backend import ScriptedBackend
from tests.support.wait import async_wait_until

PCM16 = SessionOptions(voice="v", codec="pcm16", sample_rate=16000)


class FakeWebSocket:
    """Starlette's WebSocket as far as `Connection` uses it."""

    def __init__(self, *, is_reading: bool = True) -> None:
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[str | bytes] = []
        self.closed: tuple[int, str] | None = None
        self.is_reading = is_reading  # False: a client that stops reading; sends never complete

    async def receive(self) -> dict[str, Any]:
        return await self.incoming.get()

    async def send_text(self, frame: str) -> None:
        await self._send(frame)

    async def send_bytes(self, frame: bytes) -> None:
        await self._send(frame)

    async def _send(self, frame: str | bytes) -> None:
        if not self.is_reading:
            await asyncio.Event().wait()
        self.sent.append(frame)

    async def close(self, code: int, reason: str = "") -> None:
        self.closed = (code, reason)

    def say(self, message: dict[str, Any]) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(message)})

    def leave(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(f) for f in self.sent if isinstance(f, str)]

    def audio(self) -> list[dict[str, Any]]:
        return [msgpack.unpackb(f) for f in self.sent if isinstance(f, bytes)]


Scenario = Callable[[FakeWebSocket, Connection, AppState], Awaitable[None]]


def run(scenario: Scenario, *, limits: Limits | None = None, is_reading: bool = True,
        backend: ScriptedBackend | None = None, tmp_path: Path | None = None,
        encoding: EncodeWorker | None = None, look_ahead_s: float = 1.5) -> AppState:
    """`encoding`: the app's encode worker, and the session defers its encodes to it."""
    async def main() -> AppState:
        engine = Engine(backend or ScriptedBackend(),
                        EngineConfig(warmup_text="", look_ahead_s=look_ahead_s))
        await engine.start()
        state = AppState(GatewayConfig(voice="v", data_dir=tmp_path or Path(".")), engine,
                         Metrics(engine))
        if encoding is not None:
            state.encoding = encoding
        state.catalog.set_listed({"v"})
        session = Session("s", catalog=state.catalog, sample_rate=engine.sample_rate, options=PCM16,
                          limits=limits, admit=engine.admit, release=engine.release_context,
                          defer_encode=encoding is not None)
        ws = FakeWebSocket(is_reading=is_reading)
        connection = Connection(ws, session, engine, state)  # type: ignore[arg-type]
        state.connections.add(connection)
        try:
            await scenario(ws, connection, state)
        finally:
            await engine.stop()
            state.encoding.close()
        return state

    return asyncio.run(main())


def test_a_turn_goes_from_text_frames_to_audio_frames_and_context_done(tmp_path: Path) -> None:
    async def scenario(ws: FakeWebSocket, connection: Connection, state: AppState) -> None:
        running = asyncio.create_task(connection.run())
        ws.say({"type": "text", "context_id": "c", "text": "Hello there. ", "flush": True})
        await async_wait_until(lambda: any(e["type"] == "context.done" for e in ws.events()),
                               timeout=20.0, message="no context.done")
        ws.leave()
        await asyncio.wait_for(running, 10)
        events = ws.events()
        assert events[0]["type"] == "session.ready" and events[0]["options"]["codec"] == "pcm16"
        assert [e["type"] for e in events[1:]] == ["segment", "context.done"]
        audio = ws.audio()
        assert [a["seq"] for a in audio] == list(range(len(audio)))
        pcm = decode_pcm16(b"".join(a["data"] for a in audio))
        assert len(pcm) == 0.1 * 16000 and abs(float(pcm.mean()) - 0.25) < 0.01
        assert events[-1]["audio_ms"] == 100.0
        # the socket is gone: its voice and its engine capacity are let go
        assert state.catalog.num_holders("v") == 0
        assert state.engine.scheduler.num_contexts == 0

    run(scenario, tmp_path=tmp_path)


def test_a_client_that_stops_reading_is_dropped_as_a_slow_consumer_and_its_work_freed(
        tmp_path: Path) -> None:
    async def scenario(ws: FakeWebSocket, connection: Connection, state: AppState) -> None:
        running = asyncio.create_task(connection.run())
        ws.say({"type": "text", "context_id": "c", "text": "A long answer nobody reads. ",
                "flush": True})
        await asyncio.wait_for(running, 20)  # the connection ends by itself
        assert ws.sent == []  # nothing ever got through
        assert 'voxgate_errors_total{code="slow_consumer"} 1.0' in state.metrics.render().decode()
        assert state.engine.stats.num_cancelled >= 1  # its engine request was cancelled
        assert state.engine.scheduler.num_contexts == 0 and state.engine.scheduler.num_queued == 0
        assert state.catalog.num_holders("v") == 0

    limits = Limits(max_send_buffer_bytes=8192, slow_consumer_timeout_s=0.3)
    run(scenario, limits=limits, is_reading=False,
        backend=ScriptedBackend(chunks_per_request=50, chunk_s=0.1), tmp_path=tmp_path)


def test_a_silent_client_gets_a_fatal_error_and_close_4000_after_the_idle_timeout(
        tmp_path: Path) -> None:
    async def scenario(ws: FakeWebSocket, connection: Connection, state: AppState) -> None:
        await asyncio.wait_for(connection.run(), 10)
        error = ws.events()[-1]
        assert error["type"] == "error" and error["fatal"] is True
        assert "without messages" in error["message"]
        assert ws.closed == (4000, "idle timeout")

    run(scenario, limits=Limits(idle_timeout_s=0.2), tmp_path=tmp_path)


def test_an_open_context_does_not_keep_a_silent_client_past_the_idle_timeout(
        tmp_path: Path) -> None:
    async def scenario(ws: FakeWebSocket, connection: Connection, state: AppState) -> None:
        running = asyncio.create_task(connection.run())
        ws.say({"type": "text", "context_id": "c", "text": "x"})  # never flushed
        await asyncio.wait_for(running, 10)
        assert ws.closed == (4000, "idle timeout")
        assert state.engine.scheduler.num_contexts == 0

    run(scenario, limits=Limits(idle_timeout_s=0.3), tmp_path=tmp_path)


def test_a_reader_failure_is_logged_and_closes_with_1011(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(ws: FakeWebSocket, connection: Connection, state: AppState) -> None:
        def broken(raw: str | bytes, now: float) -> list[Any]:
            raise KeyError("a bug in the session")

        connection.session.receive_frame = broken  # type: ignore[method-assign]
        running = asyncio.create_task(connection.run())
        ws.say({"type": "text", "context_id": "c", "text": "Hello. "})
        await asyncio.wait_for(running, 10)
        assert ws.closed == (1011, "internal error")
        error = ws.events()[-1]
        assert (error["code"], error["fatal"]) == ("internal", True)
        assert "bug" not in error["message"]  # logged, not told

    with caplog.at_level("ERROR", logger="voxgate.gateway"):
        run(scenario, tmp_path=tmp_path)
    assert any("reader task failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_close_finishes_the_open_context_then_closes_normally(tmp_path: Path) -> None:
    async def scenario(ws: FakeWebSocket, connection: Connection, state: AppState) -> None:
        running = asyncio.create_task(connection.run())
        ws.say({"type": "text", "context_id": "c", "text": "Last words"})
        ws.say({"type": "close"})
        await asyncio.wait_for(running, 10)
        assert [e["type"] for e in ws.events()][-1] == "context.done"
        assert ws.closed == (1000, "session closed by client")

    run(scenario, tmp_path=tmp_path)


class HeldWorker(EncodeWorker):
    """An encode worker that has fallen behind: it holds every job until `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[EncodeJob, OnDone]] = []

    @property
    def held_ms(self) -> float:
        return sum(job.pcm_ms for job, _ in self.held)

    def submit(self, job: EncodeJob, on_done: OnDone) -> None:
        self.held.append((job, on_done))

    def release(self) -> None:
        held, self.held = self.held, []
        for job, on_done in held:
            super().submit(job, on_done)


def test_a_socket_takes_no_engine_audio_while_its_encodes_wait_past_the_bound(
        tmp_path: Path) -> None:
    worker = HeldWorker()

    async def scenario(ws: FakeWebSocket, connection: Connection, state: AppState) -> None:
        running = asyncio.create_task(connection.run())
        ws.say({"type": "text", "context_id": "c", "text": "A long answer. ", "flush": True})
        await async_wait_until(lambda: worker.held_ms > MAX_ENCODING_MS, timeout=20.0,
                               message="the encodes never passed the bound")
        await asyncio.sleep(0.3)  # the engine could make all 10 s in this time: it is not taken
        assert MAX_ENCODING_MS < worker.held_ms <= MAX_ENCODING_MS + 100.0  # one chunk past
        assert ws.audio() == []  # nothing encoded, nothing sent
        while not any(e["type"] == "context.done" for e in ws.events()):
            worker.release()  # the worker catches up: the rest is taken and encoded
            await asyncio.sleep(0.02)
        ws.leave()
        await asyncio.wait_for(running, 10)
        audio = ws.audio()
        assert [a["seq"] for a in audio] == list(range(len(audio)))
        assert len(decode_pcm16(b"".join(a["data"] for a in audio))) == 10.0 * 16000

    run(scenario, backend=ScriptedBackend(chunks_per_request=100, chunk_s=0.1),
        tmp_path=tmp_path, encoding=worker, look_ahead_s=60.0)
