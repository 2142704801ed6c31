"""`RemoteEngine`: the engine tier as an `EngineClient`, over Ray Serve handles.

The gateway's sessions call `admit` synchronously, so admission is decided
here from a view of every engine replica's room, refreshed by a poll every
`poll_s` (one pinned `capacity` call per replica, which also renews this
gateway's lease on its contexts there). A context goes to the replica with
the most room, counting the contexts this gateway placed since that
replica's last answer; `busy` is raised only when no replica has room. The
replica admits the context for real on its first request; if it refuses (two
gateways raced for its last slot), that request is moved to the next replica
with room before any audio is made, so `busy` still means every replica said
no.

A replica that dies mid-turn ends its streams with an error: Ray raises on
the stream at once, and a stream whose replica stopped answering the poll
fails within `stall_s` even if Ray does not notice. Its contexts end (the
session sends `error`), and the next turn is admitted on another replica.

Voices are replayed: every voice added through this client is added to a
replica that joins later, before the replica takes contexts.

This module owns the calls: the poll, placement, requests and voice verbs.
What it keeps of each replica's answer, and how the answers are summed and
compared, is replicas.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import numpy as np
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from engine.errors import BackendFailure, EngineBusyError, EngineError, EngineStoppedError
from engine.stats import EngineStats
from engine.types import AudioChunk, RequestId, SynthesisRequest, VoiceInfo
from engine.wire import RemoteFacts, SchedulerCounters
from gateway.ray_serve import routing, wire
from gateway.ray_serve.replicas import Replica, roomiest, sum_reports

log = logging.getLogger("voxgate.gateway")
T = TypeVar("T")


class RemoteEngine(RemoteFacts):
    """The engine tier behind one `DeploymentHandle` (see the module doc)."""

    def __init__(self, handle: DeploymentHandle[Any], *, deployment: str = "Engine",
                 poll_s: float = 0.5, stall_s: float = 3.0, call_timeout_s: float = 5.0) -> None:
        self.handle = handle
        self.deployment = deployment
        self.poll_s, self.stall_s, self.call_timeout_s = poll_s, stall_s, call_timeout_s
        self.gateway_id = uuid.uuid4().hex[:12]
        self.replicas: dict[str, Replica] = {}
        self._placement: dict[str, str] = {}  # context key -> replica id
        self._streams: dict[RequestId, DeploymentResponseGenerator[Any]] = {}
        self._added: dict[str, tuple[bytes | None, dict[str, Any]]] = {}  # replayed on new replicas
        self._retired: set[str] = set()
        self._info: dict[str, Any] = {}
        self._voices: list[VoiceInfo] = []
        self._poller: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.stats = EngineStats()
        self.scheduler = SchedulerCounters()

    # -- calls ---------------------------------------------------------------
    def _call(self, method: str, *args: Any, replica: str = "", **kwargs: Any) -> Any:
        return _own_request(lambda: self.handle.options(method_name=method).remote(
            *args, replica=replica, **kwargs))

    async def _ask(self, method: str, *args: Any, replica: str = "", **kwargs: Any) -> Any:
        return await asyncio.wait_for(self._call(method, *args, replica=replica, **kwargs),
                                      self.call_timeout_s)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- lifecycle -------------------------------------------------------------
    async def start(self, timeout_s: float = 120.0) -> None:
        """Learn what the tier speaks, then poll it in the background.

        It does not wait for the first poll: Serve starts a replica's handle traffic
        fully only once the replica has initialized (this runs in its ASGI startup).
        Until a poll answers, contexts get `busy` and /readyz says not ready.
        """
        self._info = await asyncio.wait_for(self._call("info"), timeout_s)
        self._voices = [wire.voice_from_wire(v) for v in self._info["voices"]]
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    @property
    def is_ready(self) -> bool:
        return self._poller is not None and any(r.is_ready for r in self.replicas.values())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        for stream in list(self._streams.values()):
            stream.cancel()  # type: ignore[no-untyped-call, unused-ignore]
        for key in list(self._placement):
            self.release_context(key)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2.0)

    @property
    def is_healthy(self) -> bool:
        return self._poller is not None and not self._poller.done()

    # -- the poll ------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        while True:
            routed = set(routing.live_replicas(self.deployment))
            if routed:  # the router's view of membership, when it has published one
                for gone in set(self.replicas) - routed:
                    del self.replicas[gone]
            known = routed | set(self.replicas)
            # One unpinned poll per round finds replicas the router has not published.
            await asyncio.gather(self._poll(""), *(self._poll(rid) for rid in known),
                                 return_exceptions=True)
            self._sum_reports()
            await asyncio.sleep(self.poll_s)

    async def _poll(self, replica_id: str) -> None:
        held = [k for k, r in self._placement.items() if r == replica_id and replica_id]
        try:
            report = await self._ask("capacity", gateway=self.gateway_id, held=held,
                                     replica=replica_id)
        except (RayError, asyncio.TimeoutError) as exc:
            log.warning("engine replica %s did not answer its poll: %r", replica_id or "(any)", exc)
            if replica_id in self.replicas:
                self.replicas[replica_id].is_ready = False
            return
        answered = str(report["replica"])
        if replica_id and answered != replica_id:  # it is gone: the router sent the poll elsewhere
            self.replicas.pop(replica_id, None)
            return
        replica = self.replicas.get(answered)
        if replica is None:
            replica = self.replicas[answered] = Replica(answered)
        elif not replica_id:
            return  # a known replica: its pinned poll reports it
        if not replica.is_ready:
            await self._replay_voices(answered)
        replica.max_contexts, replica.num_contexts = report["max_contexts"], report["num_contexts"]
        replica.num_placed, replica.last_seen, replica.report = 0, time.monotonic(), report
        replica.is_ready = bool(report["is_ready"] and report["is_healthy"])

    async def _replay_voices(self, replica_id: str) -> None:
        for voice_id, (features, meta) in list(self._added.items()):
            await self._ask("add_voice", voice_id, features, meta, replica=replica_id)
            if voice_id in self._retired:
                await self._ask("retire_voice", voice_id, replica=replica_id)

    def _sum_reports(self) -> None:
        reports = [r.report for r in self.replicas.values() if r.report]
        totals, stats = sum_reports(reports)
        # In place: callers hold bound methods of these (FairShare keeps `max_contexts`).
        for name in ("num_queued", "num_contexts", "total_contexts", "stats"):
            setattr(self.scheduler, name, getattr(totals, name))
        for name in EngineStats.__slots__:
            setattr(self.stats, name, getattr(stats, name))
        if reports:
            self._voices = [wire.voice_from_wire(v) for v in reports[0]["voices"]]

    # -- admission -------------------------------------------------------------------
    def _roomiest(self, exclude: frozenset[str] | set[str] = frozenset()) -> Replica | None:
        return roomiest(self.replicas.values(), exclude)

    def admit(self, context_key: str) -> None:
        replica = self._roomiest()
        if replica is None:
            raise EngineBusyError(f"every engine replica is at capacity ({len(self.replicas)} "
                                  "replicas); try again shortly")
        replica.num_placed += 1
        self._placement[context_key] = replica.replica_id

    def release_context(self, context_key: str) -> None:
        replica_id = self._placement.pop(context_key, None)
        if replica_id is not None:
            self._spawn(self._release(context_key, replica_id))

    async def _release(self, context_key: str, replica_id: str) -> None:
        with contextlib.suppress(RayError, asyncio.TimeoutError):
            await self._ask("release", context_key, replica=replica_id)

    # -- requests ----------------------------------------------------------------------
    def submit(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        if not self.is_ready:
            raise EngineStoppedError("the engine tier is not running")
        if request.request_id in self._streams:
            raise EngineError(f"request id {request.request_id!r} is already in use")
        replica_id = self._placement.get(request.context_key, "")
        if not replica_id:  # not admitted through this client (e.g. warm-up): any replica
            any_ready = self._roomiest()
            replica_id = any_ready.replica_id if any_ready is not None else ""
        return self._iterate(request, replica_id)

    def _open(self, request: SynthesisRequest, replica_id: str) -> DeploymentResponseGenerator[Any]:
        stream: DeploymentResponseGenerator[Any] = _own_request(lambda: self.handle.options(
            method_name="synthesize", stream=True).remote(
            wire.request_to_wire(request, self.gateway_id), replica=replica_id))  # type: ignore[arg-type, return-value, unused-ignore]
        self._streams[request.request_id] = stream
        return stream

    async def _iterate(self, request: SynthesisRequest,
                       replica_id: str) -> AsyncIterator[AudioChunk]:
        refused: set[str] = set()
        stream = self._open(request, replica_id)
        try:
            while True:
                try:
                    item = await self._next(stream, replica_id)
                except StopAsyncIteration:
                    raise BackendFailure("the engine replica ended this segment early") from None
                except RayError as exc:
                    log.warning("engine replica %s failed request %s: %r", replica_id,
                                request.request_id, exc)
                    self._mark_down(replica_id)
                    raise BackendFailure("the engine replica serving this turn stopped") from None
                if "error" in item:
                    error = wire.error_from_wire(item)
                    refused.add(replica_id)
                    other = self._roomiest(refused) if isinstance(error, EngineBusyError) else None
                    if other is None:
                        raise error
                    # Another gateway took this replica's last slot first: move the context.
                    replica_id = other.replica_id
                    other.num_placed += 1
                    if request.context_key in self._placement:
                        self._placement[request.context_key] = replica_id
                    stream = self._open(request, replica_id)
                    continue
                chunk = wire.chunk_from_wire(item, request.request_id)
                yield chunk
                if chunk.is_last:
                    return
        finally:
            live = self._streams.pop(request.request_id, None)
            if live is not None:
                live.cancel()  # type: ignore[no-untyped-call, unused-ignore]  # a no-op once it ended

    async def _next(self, stream: DeploymentResponseGenerator[Any],
                    replica_id: str) -> dict[str, Any]:
        """The next chunk; fails when the replica stops answering polls for `stall_s`."""
        pending = asyncio.ensure_future(_anext(stream))
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=0.5)
                if done:
                    item: dict[str, Any] = pending.result()
                    return item
                replica = self.replicas.get(replica_id)
                if replica is None or (not replica.is_ready
                                       and time.monotonic() - replica.last_seen > self.stall_s):
                    raise BackendFailure("the engine replica serving this turn stopped answering")
        finally:
            pending.cancel()  # a no-op when it is done

    def _mark_down(self, replica_id: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.is_ready = False

    def cancel(self, request_id: RequestId) -> None:
        """Cancel the call: Serve cancels the replica's generator, which frees the request."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()  # type: ignore[no-untyped-call, unused-ignore]

    # -- voices: every replica speaks every voice ------------------------------------------
    async def make_voice_features(self, audio: np.ndarray, sample_rate: int,
                                  transcript: str) -> bytes | None:
        pcm = np.ascontiguousarray(audio, dtype=np.float32).tobytes()
        features: bytes | None = await self._ask("make_voice_features", pcm, sample_rate,
                                                 transcript)
        return features

    async def _everywhere(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """Every ready replica's answer; before the first poll, any one replica's (the
        voice is replayed onto each replica as it turns ready, so none misses it)."""
        ready = [r.replica_id for r in self.replicas.values() if r.is_ready] or [""]
        answers: list[dict[str, Any]] = await asyncio.gather(
            *(self._ask(method, *args, replica=rid) for rid in ready))
        for answer in answers:
            if "error" in answer:
                raise wire.error_from_wire(answer)
        return answers

    async def add_voice(self, voice_id: str, features: bytes | None,
                        meta: dict[str, Any]) -> VoiceInfo:
        previous = self._added.get(voice_id)
        self._added[voice_id] = (features, meta)  # first: a replica turning ready meanwhile gets it
        try:
            answers = await self._everywhere("add_voice", voice_id, features, meta)
        except BaseException:
            if previous is None:
                self._added.pop(voice_id, None)
            else:
                self._added[voice_id] = previous
            raise
        self._retired.discard(voice_id)
        info = wire.voice_from_wire(answers[0])
        self._voices = [v for v in self._voices if v.voice_id != voice_id] + [info]
        return info

    async def retire_voice(self, voice_id: str) -> None:
        await self._everywhere("retire_voice", voice_id)
        self._retired.add(voice_id)
        self._voices = [v for v in self._voices if v.voice_id != voice_id]

    async def remove_voice(self, voice_id: str) -> None:
        await self._everywhere("remove_voice", voice_id)
        self._added.pop(voice_id, None)
        self._retired.discard(voice_id)
        self._voices = [v for v in self._voices if v.voice_id != voice_id]


async def _anext(stream: DeploymentResponseGenerator[Any]) -> Any:
    return await stream.__anext__()


def _own_request(call: Callable[[], T]) -> T:
    """Make a handle call as a request of its own.

    A call made while this replica serves a request (a socket, here) inherits that
    request's ids from Serve's request context, and Serve matches and cancels
    calls by those ids: every engine call of one socket would share one id, and
    cancelling one segment's stream (a barge-in, or the end of a stream) could
    cancel its neighbours. Serve has no public option for this; its context
    variable is the one place the ids come from.
    """
    from ray.serve import context

    serve_context: Any = context
    fresh = contextvars.copy_context()
    fresh.run(serve_context._serve_request_context.set, serve_context._RequestContext())
    return fresh.run(call)
