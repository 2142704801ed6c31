"""The shared speech engine: one scheduler loop per process, every session's requests.

Public face (DESIGN.md): `submit(SynthesisRequest) -> AsyncIterator[AudioChunk]`,
`cancel(request_id)`, `voices`, `sample_rate`, `start()`, `stop()`, admission
(`admit`/`release_context`) and `stats` for metrics. Each loop iteration is
prepare (new requests), schedule (EDF batch), run (one backend step in the
worker thread), route (chunks to each request's bounded queue). A request is
never stepped while its output queue is full, so a slow reader holds back only
its own work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from engine.backend import Backend, BackendRequest, StepResult
from engine.errors import BackendFailure, EngineBusyError, EngineError, EngineStoppedError
from engine.scheduler import Scheduler, SchedulerConfig
from engine.types import AudioChunk, RequestId, SynthesisRequest, VoiceInfo

log = logging.getLogger("voxgate.engine")

_QUEUE_DEPTH = 16
T = TypeVar("T")


@dataclass(slots=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_pending: int = 4096
    warmup_text: str = "Warming up the voice."

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")


@dataclass(slots=True)
class EngineStats:
    """Counters the gateway exports to /metrics."""

    num_submitted: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_steps: int = 0
    audio_seconds: float = 0.0
    busy_seconds: float = 0.0
    last_step_seconds: float = 0.0
    last_batch_size: int = 0


class _Handle:
    __slots__ = ("is_cancelled", "is_done", "queue", "request")

    def __init__(self, request: SynthesisRequest) -> None:
        self.request = request
        self.queue: asyncio.Queue[AudioChunk | BaseException | None] = asyncio.Queue(_QUEUE_DEPTH)
        self.is_cancelled = False
        self.is_done = False


class Engine:
    """Runs one backend for all sessions with continuous batching."""

    def __init__(self, backend: Backend, config: EngineConfig | None = None) -> None:
        self.backend = backend
        self.config = config or EngineConfig()
        self.config.scheduler.max_batch_size = min(
            self.config.scheduler.max_batch_size, backend.max_batch_size
        )
        self.config.scheduler.parallelism = max(1, getattr(backend, "parallelism", 1))
        self.scheduler = Scheduler(self.config.scheduler)
        self.stats = EngineStats()
        self._handles: dict[RequestId, _Handle] = {}
        self._incoming: list[_Handle] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voxgate-engine")
        self._task: asyncio.Task[None] | None = None
        self._voices: list[VoiceInfo] = []
        self.is_ready = False
        self.num_failed_steps_in_row = 0

    # -- lifecycle --------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        return self.backend.sample_rate

    @property
    def voices(self) -> list[VoiceInfo]:
        return self._voices

    def refresh_voices(self) -> None:
        self._voices = self.backend.voices()

    async def run_in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the worker thread, between steps (backends need no locks)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    @property
    def is_healthy(self) -> bool:
        """False when the loop died or the backend keeps failing (/readyz turns false)."""
        loop_alive = self._task is not None and not self._task.done()
        return loop_alive and self.num_failed_steps_in_row < 3

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.backend.load)
        self.refresh_voices()
        self._task = asyncio.create_task(self._run(), name="voxgate-engine")
        if self.config.warmup_text and self._voices:
            await self._warm_up()
        self.is_ready = True
        log.info("engine %s ready: %d voices, sample rate %d",
                 self.backend.name, len(self._voices), self.sample_rate)

    async def _warm_up(self) -> None:
        # One real step measures the step cost before the first client arrives.
        request = SynthesisRequest(RequestId("warmup"), self.config.warmup_text,
                                   self._voices[0].voice_id, deadline=time.monotonic())
        async for _ in self.submit(request):
            pass

    async def stop(self) -> None:
        self.is_ready = False
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for handle in list(self._handles.values()):
            self._fail(handle, EngineStoppedError("the engine stopped"))
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- admission --------------------------------------------------------
    def admit(self, context_key: str) -> None:
        """Reserve capacity for a new context; raises EngineBusyError when full."""
        if not self.scheduler.admit(context_key):
            raise EngineBusyError(
                f"the engine is at capacity ({self.scheduler.max_contexts()} talking contexts); "
                "try again shortly"
            )

    def release_context(self, context_key: str) -> None:
        self.scheduler.release_context(context_key)

    # -- requests ---------------------------------------------------------
    def submit(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Queue a request; iterate the result for its audio chunks."""
        if self._task is None:
            raise EngineStoppedError("the engine is not running")
        if request.request_id in self._handles:
            raise EngineError(f"request id {request.request_id!r} is already in use")
        if len(self._handles) >= self.config.max_pending:
            raise EngineBusyError(f"the engine holds {self.config.max_pending} requests already")
        handle = _Handle(request)
        self._handles[request.request_id] = handle
        self._incoming.append(handle)
        self.stats.num_submitted += 1
        self._wake.set()
        return self._iterate(handle)

    async def _iterate(self, handle: _Handle) -> AsyncIterator[AudioChunk]:
        try:
            while True:
                item = await handle.queue.get()
                self._wake.set()  # room in the queue may make the request runnable again
                if item is None:  # cancelled: end quietly
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.is_last:
                    return
        finally:
            if not handle.is_done:
                self.cancel(handle.request.request_id)

    def cancel(self, request_id: RequestId) -> None:
        """Forget a request: it is never stepped again and its results are dropped."""
        handle = self._handles.pop(request_id, None)
        if handle is None or handle.is_done:
            return
        handle.is_cancelled = True
        handle.is_done = True
        self.stats.num_cancelled += 1
        item = self.scheduler.remove(request_id)
        if item is not None:
            self.backend.release(item)
        self._post(handle, None)

    # -- the loop ---------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._incoming:
                fresh, self._incoming = self._incoming, []
                fresh = [h for h in fresh if not h.is_cancelled]
                prepared = await loop.run_in_executor(self._executor, self._prepare_all, fresh)
                for handle, outcome in zip(fresh, prepared):
                    if handle.is_cancelled:
                        if isinstance(outcome, BackendRequest):
                            self.backend.release(outcome)
                    elif isinstance(outcome, BackendRequest):
                        self.scheduler.add(outcome)
                    else:
                        self._fail(handle, outcome)
            batch = self.scheduler.schedule(time.monotonic(), self._is_runnable)
            if not batch:
                self._wake.clear()
                if not self._incoming:
                    await self._wake.wait()
                continue
            started = time.monotonic()
            try:
                results = await loop.run_in_executor(self._executor, self.backend.step, batch)
                if len(results) != len(batch):
                    raise BackendFailure(f"backend returned {len(results)} results for {len(batch)} items")
                self.num_failed_steps_in_row = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("backend step failed for %d requests", len(batch))
                self.num_failed_steps_in_row += 1
                if len(batch) == 1:
                    results = [StepResult(error=exc)]
                else:
                    # Re-run the batch one request at a time so that a fault ends only
                    # the request that causes it, not its batch-mates from other sessions.
                    results = await loop.run_in_executor(self._executor, self._step_isolated, batch)
            elapsed = time.monotonic() - started
            self._route(batch, results, elapsed)

    def _step_isolated(self, batch: list[BackendRequest]) -> list[StepResult]:
        results: list[StepResult] = []
        for item in batch:
            try:
                (result,) = self.backend.step([item])
            except Exception as exc:  # noqa: BLE001 - this item is the culprit
                result = StepResult(error=exc)
            results.append(result)
        return results

    def _prepare_all(self, handles: list[_Handle]) -> list[BackendRequest | BaseException]:
        out: list[BackendRequest | BaseException] = []
        for handle in handles:
            try:
                out.append(self.backend.prepare(handle.request))
            except Exception as exc:  # noqa: BLE001 - reported to that request alone
                out.append(exc)
        return out

    def _is_runnable(self, item: BackendRequest) -> bool:
        handle = self._handles.get(item.request_id)
        return handle is not None and not handle.queue.full()

    def _route(self, batch: list[BackendRequest], results: list[StepResult], elapsed: float) -> None:
        audio_s = 0.0
        for item, result in zip(batch, results):
            audio_s += len(result.pcm) / self.sample_rate
            handle = self._handles.get(item.request_id)
            if handle is None or handle.is_cancelled:
                continue
            if result.error is not None:
                self.scheduler.remove(item.request_id)
                self.backend.release(item)
                self._fail(handle, result.error)
                continue
            chunk = AudioChunk(item.request_id, np.asarray(result.pcm, dtype=np.float32),
                               self.sample_rate, result.is_finished, result.words)
            if result.is_finished:
                self.scheduler.remove(item.request_id)
                self.backend.release(item)
                handle.is_done = True
                self._handles.pop(item.request_id, None)
                self.stats.num_finished += 1
            if len(chunk.pcm) or chunk.is_last:
                handle.queue.put_nowait(chunk)
        self.scheduler.record_step(batch, elapsed, audio_s, time.monotonic())
        self.stats.num_steps += 1
        self.stats.audio_seconds += audio_s
        self.stats.busy_seconds += elapsed
        self.stats.last_step_seconds = elapsed
        self.stats.last_batch_size = len(batch)

    def _fail(self, handle: _Handle, exc: BaseException) -> None:
        handle.is_done = True
        self._handles.pop(handle.request.request_id, None)
        self.stats.num_failed += 1
        if not isinstance(exc, EngineError):
            log.error("request %s failed: %r", handle.request.request_id, exc)
            wrapped = BackendFailure("speech synthesis failed for this segment")
            wrapped.__cause__ = exc
            exc = wrapped
        self._post(handle, exc)

    @staticmethod
    def _post(handle: _Handle, item: BaseException | None) -> None:
        """Put a terminal item, displacing the oldest chunk if the queue is full."""
        if handle.queue.full():
            handle.queue.get_nowait()
        handle.queue.put_nowait(item)

    # -- voices: the engine's verbs for registered voices (docs/voices.md) -------
    # Each verb runs on the worker thread, between steps (backends need no locks),
    # and refreshes `voices` itself, so callers never reach into the backend.

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def can_register_voices(self) -> bool:
        """Whether `add_voice` can work (the backend declares it)."""
        return self.backend.can_register_voices

    @property
    def needs_transcript(self) -> bool:
        """Registration needs the reference audio's transcript (cosyvoice's prompt text)."""
        return self.backend.needs_transcript

    @property
    def voice_features_version(self) -> str:
        """Names the format of `make_voice_features`' output; stored features of another are stale."""
        return self.backend.voice_features_version

    async def make_voice_features(self, audio: np.ndarray, sample_rate: int,
                                  transcript: str) -> bytes | None:
        """A reference voice's prompt features (audio: [T] mono float32 at `sample_rate`).

        Raises ValueError for audio the backend cannot use.
        """
        return await self._on_worker(self.backend.make_voice_features, audio, sample_rate, transcript)

    async def add_voice(self, voice_id: str, features: bytes | None, meta: dict[str, Any]) -> VoiceInfo:
        """Make a registered voice speakable and listed (replacing one of the same id)."""
        return await self._change_voices(self.backend.add_voice, voice_id, features, meta)

    async def retire_voice(self, voice_id: str) -> None:
        """Unlist a registered voice; requests that name it keep speaking until it is removed."""
        await self._change_voices(self.backend.retire_voice, voice_id)

    async def remove_voice(self, voice_id: str) -> None:
        """Forget a registered or retired voice; raises UnknownVoiceError for any other id."""
        await self._change_voices(self.backend.remove_voice, voice_id)

    async def _change_voices(self, verb: Callable[..., T], *args: Any) -> T:
        def change() -> tuple[T, list[VoiceInfo]]:  # worker thread: the verb, then the new listing
            return verb(*args), self.backend.voices()

        result, self._voices = await self._on_worker(change)
        return result

    async def _on_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """The one place the voice verbs meet the worker's executor."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)
