"""The shared speech engine: one scheduler loop per process, every session's requests.

Public face (docs/architecture.md, "The engine"):
`submit(SynthesisRequest) -> AsyncIterator[AudioChunk]`, `cancel(request_id)`,
`voices`, `sample_rate`, `start()`, `stop()`, admission
(`admit`/`release_context`) and `stats` for metrics. Each loop iteration is
prepare (new requests, most urgent first), schedule (EDF over each request's
next piece), run (one backend step in the worker thread), route (chunks to
each request's bounded queue). This module owns that loop, its lifecycle,
cancel and failure; each request's playback clock and the look-ahead rules
live in engine.clock, the counters in engine.stats, the voice verbs in
engine.voice_verbs.

Thread contract: `prepare`, `step` and `release` run only on the worker
thread. `cancel` (event loop) marks the request and takes it out of the
scheduler; the worker releases it before its next step, so a step never sees
state freed under it. The voice verbs keep it too: they run on the same worker.
A backend that declares `concurrent_steps` (piper: its calls share no state)
has `parallelism` lanes instead: steps of different requests run side by
side, each started the moment a lane is free (no step waits for a slower
one beside it); prepare and the voice verbs run on the worker meanwhile,
and releases on whichever thread steps next. A request is never in two
steps at once, and is released only once no step holds it. As it starts a
step the engine hands each item its `StepPlan` (engine.backend): whether
another lane's step runs beside it and is due soon, and whether the item's
context is the only one with prepared work; a backend sizes its work by that
plan and never counts lanes itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from engine import clock
from engine.backend import Backend, BackendRequest, StepResult, due_of
from engine.clock import RequestHandle
from engine.errors import BackendFailure, EngineBusyError, EngineError, EngineStoppedError
from engine.scheduler import Scheduler, SchedulerConfig, context_of, is_busy, plan_step
from engine.stats import EngineStats
from engine.types import AudioChunk, RequestId, SynthesisRequest, VoiceInfo
from engine.voice_verbs import VoiceVerbs

__all__ = ["Engine", "EngineConfig"]

log = logging.getLogger("voxgate.engine")

T = TypeVar("T")


@dataclass(slots=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_pending: int = 4096
    warmup_text: str = "Warming up the voice."
    #: seconds of audio a request may have made beyond what its listener has heard
    #: before it yields the box to requests closer to running dry (then it runs
    #: only in idle time)
    look_ahead_s: float = 1.5
    #: requests prepared per loop iteration, most urgent first: a new turn's
    #: segment waits behind at most this many other prepares and one step
    max_prepare_per_step: int = 4
    #: with lanes, a step starts beside a running one only for work due within this:
    #: work that can wait runs after it, when a lone step may use every core (a first
    #: window then runs undisturbed); under load everything is due sooner and every
    #: lane runs
    lane_slack_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if not 0.05 <= self.look_ahead_s <= 60.0:
            raise ValueError(f"look_ahead_s must be within 0.05-60, got {self.look_ahead_s}")
        if self.max_prepare_per_step < 1:
            raise ValueError(f"max_prepare_per_step must be >= 1, got {self.max_prepare_per_step}")
        if not 0.0 <= self.lane_slack_s <= 60.0:
            raise ValueError(f"lane_slack_s must be within 0-60, got {self.lane_slack_s}")


@dataclass(slots=True)
class _Step:
    """A step running in a lane: its batch, when it started, and whether it is busy (`is_busy`)."""

    batch: list[BackendRequest]
    started: float
    is_busy: bool


class Engine(VoiceVerbs):
    """Runs one backend for all sessions with continuous batching."""

    def __init__(self, backend: Backend, config: EngineConfig | None = None) -> None:
        self.backend = backend
        self.config = config or EngineConfig()  # as the caller gave it: never rewritten
        # Lanes: a backend whose steps may run side by side (Backend.concurrent_steps) gets
        # `parallelism` steps at once, each on a thread of its own, each started as soon as
        # a lane is free, each of one request; any other backend steps on the worker, one
        # step at a time of up to `parallelism` items.
        parallelism = max(1, getattr(backend, "parallelism", 1))
        #: steps that may run side by side (1 for a backend without concurrent steps)
        self.num_lanes = parallelism if getattr(backend, "concurrent_steps", False) else 1
        is_laned = self.num_lanes > 1
        #: the scheduler's config as it runs: the caller's, within what the backend can batch
        self.scheduler_config = dataclasses.replace(
            self.config.scheduler,
            max_batch_size=min(self.config.scheduler.max_batch_size, backend.max_batch_size),
            parallelism=1 if is_laned else parallelism,
            serial_items=is_laned or bool(getattr(backend, "serial_items", False)),
        )
        self.stats = EngineStats()
        self._handles: dict[RequestId, RequestHandle] = {}
        self._incoming: list[RequestHandle] = []
        self._last_of_context: dict[str, RequestHandle] = {}  # the newest request of each context
        self._to_release: list[BackendRequest] = []  # released on the worker before the next step
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voxgate-engine")
        self._lanes = (ThreadPoolExecutor(self.num_lanes, thread_name_prefix="voxgate-lane")
                       if is_laned else self._executor)
        self._in_flight: set[RequestId] = set()  # requests in a running step
        self.scheduler = Scheduler(self.scheduler_config, memory_capacity=backend.context_capacity)
        self._task: asyncio.Task[None] | None = None
        self._voices: list[VoiceInfo] = []
        self.is_ready = False
        self.num_failed_steps_in_row = 0

    # -- lifecycle --------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        return self.backend.sample_rate

    async def run_in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the worker thread: between steps, or beside the lanes' steps (engine docstring)."""
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
        for handle in self._incoming:
            self._fail(handle, EngineStoppedError("the engine stopped"))
        self._incoming = []
        for item in list(self.scheduler.items()):
            self._retire(item.request_id)
        if self._lanes is not self._executor:
            self._lanes.shutdown(wait=True, cancel_futures=False)  # no step runs after this
        self._in_flight.clear()
        releases, self._to_release = self._to_release, []
        self._executor.submit(self._release_all, releases)
        self._executor.shutdown(wait=True, cancel_futures=False)

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
        if self._task is not None:  # the backend frees what the context held, on its worker thread
            self._executor.submit(self._end_context, context_key)

    def _end_context(self, context_key: str) -> None:
        try:
            self.backend.end_context(context_key)
        except Exception:  # a faulty backend must not stop the loop
            log.exception("backend end_context failed for %s", context_key)

    # -- requests ---------------------------------------------------------
    def submit(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Queue a request; iterate the result for its audio chunks."""
        if self._task is None:
            raise EngineStoppedError("the engine is not running")
        if request.request_id in self._handles:
            raise EngineError(f"request id {request.request_id!r} is already in use")
        if len(self._handles) >= self.config.max_pending:
            raise EngineBusyError(f"the engine holds {self.config.max_pending} requests already")
        key = request.context_key
        handle = RequestHandle(request, self._last_of_context.get(key) if key else None)
        if key:
            self._last_of_context[key] = handle
        self._handles[request.request_id] = handle
        self._incoming.append(handle)
        self.stats.num_submitted += 1
        self._wake.set()
        return self._iterate(handle)

    async def _iterate(self, handle: RequestHandle) -> AsyncIterator[AudioChunk]:
        try:
            while True:
                item = await handle.queue.get()
                self._wake.set()  # what was taken may make the request runnable again
                if item is None:  # cancelled: end quietly
                    return
                if isinstance(item, BaseException):
                    raise item
                handle.took(item, time.monotonic())
                yield item
                if item.is_last:
                    return
        finally:
            if not handle.is_done:
                self.cancel(handle.request.request_id)

    def cancel(self, request_id: RequestId) -> None:
        """Forget a request: it is never stepped again and its results are dropped.

        Runs on the event loop while a step may be running: the request is only
        marked and taken out of the scheduler here; the worker releases it
        before its next step (the thread contract, module docstring).
        """
        handle = self._handles.pop(request_id, None)
        if handle is None or handle.is_done:
            return
        handle.is_cancelled = True
        handle.is_done = True
        self._forget_context(handle)
        self.stats.num_cancelled += 1
        self._retire(request_id)
        self._post(handle, None)
        self._wake.set()

    def _retire(self, request_id: RequestId) -> None:
        """Take a request out of the scheduler; the worker releases it before its next step."""
        item = self.scheduler.remove(request_id)
        if item is not None:
            self._to_release.append(item)

    def _forget_context(self, handle: RequestHandle) -> None:
        key = handle.request.context_key
        if key and self._last_of_context.get(key) is handle:
            del self._last_of_context[key]

    # -- the loop ---------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        running: dict[asyncio.Future[list[StepResult]], _Step] = {}
        try:
            while True:
                now = time.monotonic()
                fresh = self._take_incoming(now)
                if fresh:
                    prepared = await loop.run_in_executor(self._executor, self._prepare_all, fresh)
                    for handle, outcome in zip(fresh, prepared):
                        self._admit_prepared(handle, outcome)
                now = time.monotonic()
                self._set_dues(now)
                while len(running) < self.num_lanes:
                    due_by = now + self.config.lane_slack_s if running else None
                    batch = self.scheduler.schedule(now, self._is_runnable, self._is_ahead, due_by)
                    if not batch:
                        break
                    self._in_flight.update(item.request_id for item in batch)
                    releases = self._take_releases()
                    is_step_busy = self._plan(batch, running)
                    future = loop.run_in_executor(self._lanes, self._work, releases, batch)
                    running[future] = _Step(batch, time.monotonic(), is_step_busy)
                if not running:
                    if self._to_release:
                        await loop.run_in_executor(self._executor, self._release_all, self._take_releases())
                        continue
                    self._wake.clear()
                    if not self._incoming:  # else: prepare the next few first
                        await self._sleep(self._next_wake_s(time.monotonic()))
                    continue
                for future in await self._wait_steps(running):
                    step = running.pop(future)
                    results = await self._results(future, step.batch)
                    self._in_flight.difference_update(item.request_id for item in step.batch)
                    self._route(step.batch, results, time.monotonic() - step.started)
        finally:
            for future in running:
                future.cancel()

    def _plan(self, batch: list[BackendRequest],
              running: dict[asyncio.Future[list[StepResult]], _Step]) -> bool:
        """Give each item of a step about to start its `StepPlan`; whether the step is busy.

        The scheduler decides, the backend runs: what runs beside the step (the lanes'
        steps not yet ended, and whether each is busy) and which contexts have prepared
        work (every request not yet released: held by the scheduler, or waiting for its
        release; the releases this step makes first are no longer counted) are known
        here, and handed on, so a backend never counts lanes itself.
        """
        now = time.monotonic()
        beside = [step.is_busy for future, step in running.items() if not future.done()]
        live = {context_of(item.request) for item in self.scheduler.items()}
        live.update(context_of(item.request) for item in self._to_release)
        for item, plan in zip(batch, plan_step(batch, now, beside, live), strict=True):
            item.plan = plan
        return is_busy(batch, now, self.backend.busy_lead_s)

    async def _wait_steps(
        self, running: dict[asyncio.Future[list[StepResult]], _Step],
    ) -> set[asyncio.Future[list[StepResult]]]:
        """The steps that ended (`running` holds one or more); back early for new work or a
        clock with lanes (new requests are prepared on the worker while the lanes step)."""
        if self.num_lanes == 1:  # the worker is busy: nothing else could run
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            return done
        self._wake.clear()
        woken: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
        waiting: list[asyncio.Future[Any]] = [*running, woken]
        now = time.monotonic()
        timeout = self._next_wake_s(now)
        if len(running) < self.num_lanes:  # back when held work falls due
            held = self._held_s(now)
            if held is not None:
                timeout = held if timeout is None else min(timeout, held)
        try:
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        return {future for future in running if future in done}

    async def _results(self, future: asyncio.Future[list[StepResult]],
                       batch: list[BackendRequest]) -> list[StepResult]:
        """A finished step's results; a failed step is re-run item by item (batch of two or more)."""
        try:
            results = future.result()
            if len(results) != len(batch):
                raise BackendFailure(f"backend returned {len(results)} results for {len(batch)} items")
            self.num_failed_steps_in_row = 0
            return results
        except Exception as exc:
            log.exception("backend step failed for %d requests", len(batch))
            self.num_failed_steps_in_row += 1
            if len(batch) == 1:
                return [StepResult(error=exc)]
            # Re-run the batch one request at a time so that a fault ends only
            # the request that causes it, not its batch-mates from other sessions.
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._lanes, self._step_isolated, batch)

    def _held_s(self, now: float) -> float | None:
        """Seconds until work held back from a free lane (`lane_slack_s`) falls due."""
        dues = [due_of(item) for item in self.scheduler.items() if self._is_runnable(item)]
        return max(min(dues) - self.config.lane_slack_s - now, 0.005) if dues else None

    def _take_releases(self) -> list[BackendRequest]:
        """What was cancelled or finished and may be freed now: not in a running step."""
        releases = [item for item in self._to_release if item.request_id not in self._in_flight]
        self._to_release = [item for item in self._to_release if item.request_id in self._in_flight]
        return releases

    async def _sleep(self, timeout: float | None) -> None:
        """Wait for new work, a read, a cancel, or until a clock makes a request runnable."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _work(self, releases: list[BackendRequest], batch: list[BackendRequest]) -> list[StepResult]:
        """Worker thread: free what was cancelled since the last step, then step."""
        self._release_all(releases)
        return self.backend.step(batch)

    def _release_all(self, items: list[BackendRequest]) -> None:
        for item in items:
            try:
                self.backend.release(item)
            except Exception:  # a faulty release must not stop the loop
                log.exception("backend release failed for %s", item.request_id)

    # -- playback clocks ----------------------------------------------------
    def _take_incoming(self, now: float) -> list[RequestHandle]:
        """The new requests to prepare now: due within the look-ahead, most urgent first."""
        fresh, self._incoming = clock.take_incoming(
            self._incoming, now, self.config.look_ahead_s, self.config.max_prepare_per_step)
        return fresh

    def _admit_prepared(self, handle: RequestHandle, outcome: BackendRequest | BaseException) -> None:
        if handle.is_cancelled:
            if isinstance(outcome, BackendRequest):
                self._to_release.append(outcome)
        elif isinstance(outcome, BackendRequest):
            try:
                self.scheduler.add(outcome)
            except OverflowError as exc:
                self._to_release.append(outcome)
                self._fail(handle, EngineBusyError(str(exc)))
                return
            handle.est_s = outcome.est_audio_s
        else:
            self._fail(handle, outcome)

    def _set_dues(self, now: float) -> None:
        """Each request's next piece is due when its listener would run out of audio."""
        clock.set_dues(self.scheduler.items(), self._handles, now)

    def _is_ahead(self, item: BackendRequest) -> bool:
        return clock.is_ahead(self._handles.get(item.request_id), time.monotonic(),
                              self.config.look_ahead_s)

    def _next_wake_s(self, now: float) -> float | None:
        """Seconds until some request's lead falls under the look-ahead (None: only events wake).

        A request in a running step is left out: the step's end wakes the loop for it
        (else its lead, below the look-ahead until the step routes audio, would wake the
        loop every few milliseconds for the whole step).
        """
        idle = [item for item in self.scheduler.items() if item.request_id not in self._in_flight]
        return clock.next_wake_s(idle, self._handles, now, self.config.look_ahead_s)

    def _step_isolated(self, batch: list[BackendRequest]) -> list[StepResult]:
        results: list[StepResult] = []
        for item in batch:
            try:
                (result,) = self.backend.step([item])
            except Exception as exc:  # noqa: BLE001 - this item is the culprit
                result = StepResult(error=exc)
            results.append(result)
        return results

    def _prepare_all(self, handles: list[RequestHandle]) -> list[BackendRequest | BaseException]:
        out: list[BackendRequest | BaseException] = []
        for handle in handles:
            try:
                out.append(self.backend.prepare(handle.request))
            except Exception as exc:  # noqa: BLE001 - reported to that request alone
                out.append(exc)
        return out

    def _is_runnable(self, item: BackendRequest) -> bool:
        if item.request_id in self._in_flight:
            return False
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
                self._retire(item.request_id)
                self._fail(handle, result.error)
                continue
            chunk = AudioChunk(item.request_id, np.asarray(result.pcm, dtype=np.float32),
                               self.sample_rate, result.is_finished, result.words,
                               step_ms=1000.0 * elapsed)
            handle.made_s += chunk.duration_ms / 1000.0
            handle.est_s = item.est_audio_s  # a backend may know the length better once it ran
            if result.is_finished:
                self._retire(item.request_id)
                handle.is_done = True
                handle.is_finished = True
                self._handles.pop(item.request_id, None)
                self._forget_context(handle)
                self.stats.num_finished += 1
            if len(chunk.pcm) or chunk.is_last:
                handle.queue.put_nowait(chunk)
        self.scheduler.record_step(batch, elapsed, audio_s, time.monotonic())
        self.stats.num_steps += 1
        self.stats.audio_seconds += audio_s
        self.stats.busy_seconds += elapsed
        self.stats.last_step_seconds = elapsed
        self.stats.observe_step(elapsed)
        self.stats.last_batch_size = len(batch)

    def _fail(self, handle: RequestHandle, exc: BaseException) -> None:
        handle.is_done = True
        self._handles.pop(handle.request.request_id, None)
        self._forget_context(handle)
        self.stats.num_failed += 1
        if not isinstance(exc, EngineError):
            log.error("request %s failed: %r", handle.request.request_id, exc)
            wrapped = BackendFailure("speech synthesis failed for this segment")
            wrapped.__cause__ = exc
            exc = wrapped
        self._post(handle, exc)

    @staticmethod
    def _post(handle: RequestHandle, item: BaseException | None) -> None:
        """Put a terminal item, displacing the oldest chunk if the queue is full."""
        if handle.queue.full():
            handle.queue.get_nowait()
        handle.queue.put_nowait(item)
