"""`WorkerEngine`: the engine of the engine process, as an `EngineClient` in a gateway worker.

`voxgate serve --workers N` runs the engine in one process and the app in N
worker processes (supervisor.py); each worker's sessions hold a `WorkerEngine`
and never learn that the engine is elsewhere. It speaks to the engine process
(host.py) on its stream link: a request is one `submit` message, its audio
comes back in the one frame a step makes for this worker, and the chunks a
session took are acknowledged together once per turn of the event loop (the
credit that carries backpressure across, host.py). Each request's queue holds
at most the host's window of chunks and its end; a host that sends more ends
the request with an error.

Admission is the engine process's: `admit` and `release_context` are
synchronous calls on the control link (control.py, which says why), and a
worker's `AppState` gets the engine process's fair share and socket counts
through the same link (child.py). The voice verbs are calls on the stream link;
the listing follows the engine's, broadcast by the host after every change.
The counters /metrics reads are polled every `poll_s`, and read afresh
(synchronously, on the control link) when older than `fresh_s`, so a scrape
reports the engine's counters as they are.

If the engine process goes away, every open request ends with an error, the
engine reads as unhealthy, and `on_lost` is called (the worker exits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import BackendFailure, EngineError, EngineStoppedError
from engine.scheduler import SchedulerStats
from engine.stats import EngineStats
from engine.types import AudioChunk, RequestId, SynthesisRequest, VoiceInfo
from engine.wire import RemoteFacts, SchedulerCounters
from gateway.workers import wire
from gateway.workers.channel import FrameError, Message, pack, read_frame
from gateway.workers.control import ControlLink
from gateway.workers.host import WINDOW

log = logging.getLogger("voxgate.gateway")

_Item = AudioChunk | BaseException | None


class WorkerEngine(RemoteFacts):
    """The engine process's engine (see the module doc)."""

    def __init__(self, path: Path, *, worker: int = 0, poll_s: float = 0.5,
                 fresh_s: float = 0.1, call_timeout_s: float = 120.0,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.path = path
        self.worker = worker
        self.poll_s, self.fresh_s, self.call_timeout_s = poll_s, fresh_s, call_timeout_s
        self.on_lost = on_lost
        self.control = ControlLink(path, worker)
        self._stats = EngineStats()
        self._scheduler = SchedulerCounters()
        self._polled_at = 0.0
        self._info: dict[str, Any] = {}
        self._voices: list[VoiceInfo] = []
        self._engine_ready = self._engine_healthy = False
        self._queues: dict[RequestId, asyncio.Queue[_Item]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_call = 0
        self._took: dict[str, int] = {}
        self._outbox: list[Message] = []
        self._is_flush_due = False
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(str(self.path))
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))
        self._info = await self._call("hello", worker=self.worker)
        self._voices = [wire.voice_from_wire(v) for v in self._info["voices"]]
        self._take_stats(self._info)
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        for task in (self._poller, self._reader_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._end_all(EngineStoppedError("the engine stopped"))
        if self._writer is not None:
            self._writer.close()
        self.control.close()

    @property
    def is_ready(self) -> bool:
        return self.is_healthy and self._engine_ready

    @property
    def is_healthy(self) -> bool:
        task = self._reader_task
        return task is not None and not task.done() and self._engine_healthy

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            with contextlib.suppress(EngineError, asyncio.TimeoutError):
                self._take_stats(await self._call("stats"))

    def _take_stats(self, report: dict[str, Any]) -> None:
        self._polled_at = time.monotonic()
        self._engine_ready, self._engine_healthy = report["is_ready"], report["is_healthy"]
        view = self._scheduler
        view.num_queued, view.num_contexts = report["num_queued"], report["num_contexts"]
        view.total_contexts = report["max_contexts"]
        view.stats = SchedulerStats(**report["scheduler"])
        self._stats = EngineStats(**report["stats"])

    def _fresh(self) -> None:
        if time.monotonic() - self._polled_at > self.fresh_s and self.is_healthy:
            with contextlib.suppress(EngineError):
                self._take_stats(self.control.call("stats"))

    # -- the stream link ---------------------------------------------------------------
    def _post(self, message: Message) -> None:
        if self._writer is None or self._writer.is_closing():
            raise EngineStoppedError("the engine process is not reachable")
        self._outbox.append(message)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._is_flush_due:
            self._is_flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._is_flush_due = False
        if self._took:
            self._outbox.append({"op": "took", "counts": self._took})
            self._took = {}
        messages, self._outbox = self._outbox, []
        if messages and self._writer is not None and not self._writer.is_closing():
            self._writer.write(pack(messages))

    async def _call(self, op: str, **args: Any) -> Any:
        self._next_call += 1
        call_id = self._next_call
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self._post({"op": op, "id": call_id, "args": args})
            return await asyncio.wait_for(future, self.call_timeout_s)
        finally:
            self._calls.pop(call_id, None)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (messages := await read_frame(reader)) is not None:
                for message in messages:
                    self._receive(message)
            log.error("the engine process closed the channel")
        except FrameError as exc:
            log.error("the engine process sent a bad frame: %s", exc)
        except (ConnectionError, OSError) as exc:
            log.error("the engine channel failed: %r", exc)
        self._end_all(BackendFailure("the engine process went away"))
        if self.on_lost is not None:
            self.on_lost()

    def _receive(self, message: Message) -> None:
        op = message["op"]
        if op == "audio":
            self._deliver(RequestId(message["id"]), wire.chunk_from_wire(message))
        elif op == "end":
            error = wire.error_from_wire(message) if "error" in message else None
            self._deliver(RequestId(message["id"]), error)
        elif op == "reply":
            future = self._calls.get(message["id"])
            if future is not None and not future.done():
                if "error" in message:
                    future.set_exception(wire.error_from_wire(message))
                else:
                    future.set_result(message.get("result"))
        elif op == "voices":
            self._voices = [wire.voice_from_wire(v) for v in message["voices"]]
        elif op == "fatal":
            log.error("the engine process closed this worker's channel: %s", message["message"])

    def _deliver(self, request_id: RequestId, item: _Item) -> None:
        queue = self._queues.get(request_id)
        if queue is None:
            return  # cancelled here meanwhile
        if item is None or not isinstance(item, AudioChunk) or item.is_last:
            del self._queues[request_id]  # ended: nothing to cancel
        if queue.full():
            log.error("the engine process sent request %s more than its window", request_id)
            self._queues.pop(request_id, None)
            self._post({"op": "cancel", "id": request_id})
            _replace(queue, BackendFailure("the engine channel broke its window"))
            return
        queue.put_nowait(item)

    def _end_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            _replace(queue, error)
        self._queues.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)

    # -- admission: the engine process's, without the fair share (child.py installs it) ----
    def admit(self, context_key: str) -> None:
        self.control.call("admit_engine", key=context_key)

    def release_context(self, context_key: str) -> None:
        self.control.send("release", key=context_key)

    # -- requests ------------------------------------------------------------------------
    def submit(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        if not self.is_healthy:
            raise EngineStoppedError("the engine process is not running")
        if request.request_id in self._queues:
            raise EngineError(f"request id {request.request_id!r} is already in use")
        self._post({"op": "submit", "request": wire.request_to_wire(request)})
        queue: asyncio.Queue[_Item] = asyncio.Queue(WINDOW + 1)  # its window and its end
        self._queues[request.request_id] = queue
        return self._iterate(request.request_id, queue)

    async def _iterate(self, request_id: RequestId,
                       queue: asyncio.Queue[_Item]) -> AsyncIterator[AudioChunk]:
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._took[request_id] = self._took.get(request_id, 0) + 1
                self._schedule_flush()
                yield item
                if item.is_last:
                    return
        finally:
            if self._queues.get(request_id) is queue:
                self.cancel(request_id)

    def cancel(self, request_id: RequestId) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is None:
            return
        _replace(queue, None)  # a consumer waiting on it ends quietly
        with contextlib.suppress(EngineStoppedError):
            self._post({"op": "cancel", "id": request_id})

    # -- registered voices: the engine process's one table (voices.py) ------------------------
    async def make_voice_features(self, audio: np.ndarray, sample_rate: int,
                                  transcript: str) -> bytes | None:
        pcm = np.ascontiguousarray(audio, dtype=np.float32).tobytes()
        features: bytes | None = await self._call(
            "make_voice_features", pcm=pcm, sample_rate=sample_rate, transcript=transcript)
        return features

    async def add_voice(self, voice_id: str, features: bytes | None,
                        meta: dict[str, Any]) -> VoiceInfo:
        info = wire.voice_from_wire(await self._call("add_voice", voice_id=voice_id,
                                                     features=features, meta=meta))
        self._voices = [v for v in self._voices if v.voice_id != voice_id] + [info]
        return info

    async def retire_voice(self, voice_id: str) -> None:
        await self._call("retire_voice", voice_id=voice_id)
        self._voices = [v for v in self._voices if v.voice_id != voice_id]

    async def remove_voice(self, voice_id: str) -> None:
        await self._call("remove_voice", voice_id=voice_id)
        self._voices = [v for v in self._voices if v.voice_id != voice_id]

    # -- counters for /metrics -------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        self._fresh()
        return self._stats

    @property
    def scheduler(self) -> SchedulerCounters:
        self._fresh()
        return self._scheduler


def _replace(queue: asyncio.Queue[_Item], item: _Item) -> None:
    """Empty `queue` and leave `item` alone in it."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(item)
