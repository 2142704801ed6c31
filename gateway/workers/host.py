"""The engine process's side of the channel: one engine served to every gateway worker.

`EngineHost` listens on a Unix socket in a private folder. Each worker opens
two connections to it, each a `WorkerLink`:

- its stream link (client.py's `WorkerEngine`): requests in (`submit`,
  `cancel`, `took`), their audio out, and the calls that may wait (`hello`,
  the voice verbs, `stats`). Everything a link has to say in one turn of the
  event loop goes out as one frame, and the engine hands a step's chunks over
  in one turn, so a worker gets one frame per step with all its audio.
- its control link (control.py): the calls the sans-I/O session makes
  synchronously (`admit`, `release`; the socket counts `acquire_socket`,
  `release_socket`, `num_sockets`; the session tokens `issue_token`,
  `redeem_token`, `num_tokens`), answered at once.

Admission is global because it is decided here: the host holds the one
`FairShare` in front of the engine (gateway/access/fair_share.py), the one
`KeyCounter` of open sockets per owner (gateway/access/keys.py) and the one
table of session tokens (gateway/access/tokens.py), so a key's share, its
socket cap and `--max-sessions` hold whichever workers its sockets landed on,
and a token issued by one worker opens a socket on another.

Backpressure crosses the channel as credit: the host takes a request's next
chunk from the engine only while the worker holds fewer than `window` of its
chunks untaken (the worker acknowledges what its sessions took, `took`), so
the engine's playback clock still stops when a client stops reading
(docs/architecture.md, "The backpressure story"), and the worker's queue for a
request never holds more than `window` chunks and its end.

A link that sends a bad frame (channel.py), an unknown op or a malformed
message is logged and closed, and so is one whose unsent output passes
`MAX_BUFFERED_BYTES` (its worker stopped reading); closing a link cancels its
requests, releases its contexts and socket counts, and stops its count of the
voices it added (voices.py). The other workers see nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.engine import Engine
from engine.errors import VoxgateError
from engine.types import RequestId
from engine.wire import counters_to_wire, info_to_wire
from gateway.access.fair_share import FairShare, FairShareConfig
from gateway.access.keys import KeyCounter
from gateway.access.tokens import SessionTokens
from gateway.workers import wire
from gateway.workers.channel import FrameError, Message, pack, read_frame
from gateway.workers.voices import SharedVoices

log = logging.getLogger("voxgate.engine")

#: chunks of one request a worker may hold untaken (the credit, module doc)
WINDOW = 4
#: output a link may have waiting for its worker to read before it is closed
MAX_BUFFERED_BYTES = 256 << 20


@dataclass(slots=True)
class _Pump:
    """One request's flow from the engine to a worker."""

    room: int
    more: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class EngineHost:
    """The engine, its admission and its voice table, served on `path` (see the module doc)."""

    def __init__(self, engine: Engine, path: Path, *, share: FairShareConfig,
                 tokens: SessionTokens | None = None, window: int = WINDOW) -> None:
        self.engine = engine
        self.path = path
        self.window = window
        self.fair_share = FairShare(engine.admit, engine.release_context,
                                    engine.scheduler.max_contexts, share)
        self.key_counter = KeyCounter()
        self.tokens = tokens or SessionTokens()
        self.voices = SharedVoices(engine)
        self.links: set[WorkerLink] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        self.path.chmod(0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            await link.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = WorkerLink(self, reader, writer)
        self.links.add(link)
        try:
            await link.run()
        finally:
            await link.close()

    def broadcast_voices(self) -> None:
        """Every worker's listing follows the engine's after a voice verb."""
        voices = [wire.voice_to_wire(v) for v in self.engine.voices]
        for link in self.links:
            link.post({"op": "voices", "voices": voices})

    def stats(self) -> dict[str, Any]:
        return counters_to_wire(self.engine)

    def info(self) -> dict[str, Any]:
        return {**info_to_wire(self.engine), **self.stats()}


class WorkerLink:
    """One connection of one worker (see the module doc)."""

    def __init__(self, host: EngineHost, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.host = host
        self.reader, self.writer = reader, writer
        self.worker = -1  # the worker's index, from its hello
        self.contexts: dict[str, bool] = {}  # admitted context key -> through the fair share
        self.sockets: dict[str, int] = {}  # owner -> sockets counted for it
        self.pumps: dict[RequestId, _Pump] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.is_closed = False
        self._outbox: list[Message] = []
        self._calls: dict[str, Callable[..., Any]] = {
            "hello": self._hello, "stats": host.stats, "admit": self._admit,
            "admit_engine": self._admit_engine, "acquire_socket": self._acquire_socket,
            "num_sockets": lambda: host.key_counter.num_open,
            "issue_token": host.tokens.issue, "redeem_token": host.tokens.redeem,
            "num_tokens": host.tokens.num_outstanding,
        }
        self._async_calls: dict[str, Callable[..., Awaitable[Any]]] = {
            "make_voice_features": self._make_voice_features, "add_voice": self._add_voice,
            "retire_voice": self._retire_voice, "remove_voice": self._remove_voice,
        }

    # -- reading --------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while True:
                messages = await read_frame(self.reader)
                if messages is None:
                    return
                for message in messages:
                    self._dispatch(message)
        except FrameError as exc:
            log.error("worker %d sent a bad frame on the engine channel: %s; its channel is "
                      "closed", self.worker, exc)
            self.post({"op": "fatal", "message": f"bad frame: {exc}"})
            self._flush()
        except (ConnectionError, OSError) as exc:
            log.warning("worker %d's engine channel failed: %r", self.worker, exc)

    def _dispatch(self, message: Message) -> None:
        op = message["op"]
        try:
            if op == "submit":
                self._submit(message["request"])
            elif op == "cancel":
                self._cancel(RequestId(message["id"]))
            elif op == "took":
                self._took(message["counts"])
            elif op == "release":
                self._release(message["key"])
            elif op == "release_socket":
                self._release_socket(message["owner"])
            elif op in self._calls or op in self._async_calls:
                self._call(op, message["id"], message.get("args", {}))
            else:
                raise FrameError(f"expected a known op, got {op[:40]!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FrameError(f"a malformed {op[:40]!r} message ({exc!r})") from None

    def _call(self, op: str, call_id: int, args: dict[str, Any]) -> None:
        if op in self._calls:
            try:
                self._reply(call_id, self._calls[op](**args))
            except (VoxgateError, ValueError) as exc:
                self.post({"op": "reply", "id": call_id, **wire.error_to_wire(exc)})
            return
        self._spawn(self._answer(call_id, self._async_calls[op](**args)))

    async def _answer(self, call_id: int, result: Awaitable[Any]) -> None:
        try:
            self._reply(call_id, await result)
        except Exception as exc:
            if not isinstance(exc, (VoxgateError, ValueError)):
                log.exception("a call of worker %d failed", self.worker)
            self.post({"op": "reply", "id": call_id, **wire.error_to_wire(exc)})

    def _reply(self, call_id: int, result: Any) -> None:
        self.post({"op": "reply", "id": call_id, "result": result})

    # -- writing: one frame per turn of the loop ---------------------------------------
    def post(self, message: Message) -> None:
        if self.is_closed:
            return
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        messages, self._outbox = self._outbox, []
        if self.is_closed or not messages:
            return
        for frame in _frames(messages):
            self.writer.write(frame)
        if self.writer.transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
            log.error("worker %d stopped reading its engine channel; its channel is closed",
                      self.worker)
            self._spawn(self.close())

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- requests ------------------------------------------------------------------------
    def _submit(self, request_wire: dict[str, Any]) -> None:
        request = wire.request_from_wire(request_wire)
        if request.request_id in self.pumps:
            raise ValueError(f"request id {request.request_id!r} is in use")
        pump = self.pumps[request.request_id] = _Pump(self.host.window)
        pump.task = asyncio.get_running_loop().create_task(self._pump(request, pump))

    async def _pump(self, request: Any, pump: _Pump) -> None:
        request_id = request.request_id
        try:
            async for chunk in self.host.engine.submit(request):
                self.post({"op": "audio", **wire.chunk_to_wire(chunk)})
                if chunk.is_last:
                    return
                pump.room -= 1
                while pump.room <= 0:
                    pump.more.clear()
                    await pump.more.wait()
            self.post({"op": "end", "id": request_id})
        except VoxgateError as exc:
            self.post({"op": "end", "id": request_id, **wire.error_to_wire(exc)})
        except Exception as exc:
            log.exception("request %s failed", request_id)
            self.post({"op": "end", "id": request_id, **wire.error_to_wire(exc)})
        finally:
            if self.pumps.get(request_id) is pump:
                del self.pumps[request_id]

    def _cancel(self, request_id: RequestId) -> None:
        pump = self.pumps.pop(request_id, None)
        if pump is not None and pump.task is not None:
            pump.task.cancel()  # the engine's iterator cancels the request as it closes

    def _took(self, counts: dict[str, int]) -> None:
        for request_id, count in counts.items():
            pump = self.pumps.get(RequestId(request_id))
            if pump is not None:
                pump.room += int(count)
                pump.more.set()

    # -- admission --------------------------------------------------------------------------
    def _hello(self, worker: int) -> dict[str, Any]:
        self.worker = int(worker)
        return self.host.info()

    def _admit(self, owner: str, key: str) -> None:
        self.host.fair_share.admit(owner, key)  # raises ShareExceededError or EngineBusyError
        self.contexts[key] = True

    def _admit_engine(self, key: str) -> None:
        self.host.engine.admit(key)
        self.contexts[key] = False

    def _release(self, key: str) -> None:
        through_share = self.contexts.pop(key, None)
        if through_share:
            self.host.fair_share.release(key)
        elif through_share is not None:
            self.host.engine.release_context(key)

    def _acquire_socket(self, owner: str, limit: int) -> bool:
        if not self.host.key_counter.acquire(owner, int(limit)):
            return False
        self.sockets[owner] = self.sockets.get(owner, 0) + 1
        return True

    def _release_socket(self, owner: str) -> None:
        held = self.sockets.get(owner, 0)
        if held <= 0:
            return
        self.host.key_counter.release(owner)
        if held > 1:
            self.sockets[owner] = held - 1
        else:
            del self.sockets[owner]

    # -- voices ----------------------------------------------------------------------------
    async def _make_voice_features(self, pcm: bytes, sample_rate: int,
                                   transcript: str) -> bytes | None:
        audio = np.frombuffer(pcm, dtype=np.float32)
        return await self.host.engine.make_voice_features(audio, int(sample_rate), transcript)

    async def _add_voice(self, voice_id: str, features: bytes | None,
                         meta: dict[str, Any]) -> dict[str, Any]:
        try:
            info = await self.host.voices.add(self.worker, voice_id, features, meta)
        finally:
            self.host.broadcast_voices()
        return wire.voice_to_wire(info)

    async def _retire_voice(self, voice_id: str) -> None:
        try:
            await self.host.voices.retire(self.worker, voice_id)
        finally:
            self.host.broadcast_voices()

    async def _remove_voice(self, voice_id: str) -> None:
        try:
            await self.host.voices.remove(self.worker, voice_id)
        finally:
            self.host.broadcast_voices()

    # -- the end -----------------------------------------------------------------------------
    async def close(self) -> None:
        """Cancel the link's requests, give back what it holds (idempotent)."""
        if self.is_closed:
            return
        self.is_closed = True
        self.host.links.discard(self)
        for pump in self.pumps.values():
            if pump.task is not None:
                pump.task.cancel()
        self.pumps.clear()
        for key in list(self.contexts):
            self._release(key)
        for owner, count in list(self.sockets.items()):
            for _ in range(count):
                self._release_socket(owner)
        if self.worker >= 0 and not any(link.worker == self.worker for link in self.host.links):
            await self.host.voices.drop_worker(self.worker)
        current = asyncio.current_task()
        for task in list(self.tasks):
            if task is not current:
                task.cancel()
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


def _frames(messages: list[Message]) -> list[bytes]:
    """`messages` as one frame, or as several where one would pass the channel's limit."""
    try:
        return [pack(messages)]
    except FrameError:
        if len(messages) == 1:
            raise
        half = len(messages) // 2
        return _frames(messages[:half]) + _frames(messages[half:])
