"""The shared speech engine: one scheduling loop per process, every session's requests.

Public face (docs/architecture.md, "The engine"):
`submit(SynthesisRequest) -> AsyncIterator[AudioChunk]`, `cancel(request_id)`,
`voices`, `sample_rate`, `start()`, `stop()`, admission
(`admit`/`release_context`) and `stats` for metrics. This module owns that
face and the engine's lifecycle (load, warm-up, stop: every thread and pool
ended, the backend's own with `Backend.close`). The parts behind it are
separable: the loop (engine/loop.py: prepare, schedule, run, route), the
request table with each request's and each context's playback clock
(engine/requests.py, engine/clock.py), the scheduler (engine/scheduler.py),
the counters (engine/stats.py) and the voice verbs (engine/voice_verbs.py).

Threads. The loop runs on a thread of its own (engine/loop_thread.py), so it
never waits for the gateway's event loop; the face (`submit`, `cancel`,
`admit`, `release_context`, a consumer taking a chunk) stays on the
gateway's event loop, and both sides change the request table and the
scheduler under the table's lock, briefly and never across a wait. A step's
chunks come back to the gateway's loop as one batch per step.

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

from engine.backend import Backend
from engine.clock import RequestHandle
from engine.errors import EngineBusyError, EngineStoppedError
from engine.loop import StepLoop, post
from engine.loop_thread import LoopThread
from engine.requests import RequestTable
from engine.scheduler import Scheduler, SchedulerConfig
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
        self.scheduler = Scheduler(self.scheduler_config, memory_capacity=backend.context_capacity)
        self.requests = RequestTable(self.config.max_pending, self.scheduler.is_admitted)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voxgate-engine")
        self._lanes = (ThreadPoolExecutor(self.num_lanes, thread_name_prefix="voxgate-lane")
                       if is_laned else self._executor)
        self.loop = StepLoop(backend, self.scheduler, self.requests, self.stats, self._executor,
                             self._lanes, self.num_lanes, self.config.look_ahead_s,
                             self.config.max_prepare_per_step, self.config.lane_slack_s)
        self._thread: LoopThread | None = None
        self._voices: list[VoiceInfo] = []
        self.is_ready = False

    # -- lifecycle --------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        return self.backend.sample_rate

    @property
    def num_failed_steps_in_row(self) -> int:
        return self.loop.num_failed_steps_in_row

    async def run_in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the worker thread: between steps, or beside the lanes' steps
        (engine docstring)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    @property
    def is_healthy(self) -> bool:
        """False when the loop died or the backend keeps failing (/readyz turns false)."""
        loop_alive = self._thread is not None and self._thread.is_running
        return loop_alive and self.num_failed_steps_in_row < 3

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.backend.load)
        self.refresh_voices()
        self._thread = LoopThread(self.loop)
        self._thread.start()
        if self.config.warmup_text and self._voices:
            await self._warm_up()
        self.is_ready = True
        log.info("engine %s ready: %d voices, sample rate %d",
                 self.backend.name, len(self._voices), self.sample_rate)

    async def _warm_up(self) -> None:
        # One real step measures the step cost before the first client arrives.
        request = SynthesisRequest(RequestId("warmup"), self.config.warmup_text,
                                   self._voices[0].voice_id)
        async for _ in self.submit(request):
            pass

    async def stop(self) -> None:
        """Stop the loop, end every request (`EngineStoppedError`), release what the backend
        holds, then end every thread and pool: the worker, the lanes and the backend's own."""
        self.is_ready = False
        if self._thread is not None:
            await self._thread.stop()  # from here on, only this thread touches the table
            self._thread = None
        requests = self.requests
        for handle in [*requests.handles.values(), *requests.incoming]:
            if not handle.is_done:
                self.loop.fail(handle, EngineStoppedError("the engine stopped"))
        requests.incoming = []
        for item in list(self.scheduler.items()):
            self.loop.retire(item.request_id)
        self.loop.send_outbox()  # the errors, into their queues at once
        if self._lanes is not self._executor:
            self._lanes.shutdown(wait=True, cancel_futures=False)  # no step runs after this
        requests.in_flight.clear()
        self._executor.submit(self.loop.release_all, requests.take_releases())
        self._executor.submit(self._close_backend)  # on the worker, after every release
        self._executor.shutdown(wait=True, cancel_futures=False)

    def _close_backend(self) -> None:
        try:
            self.backend.close()
        except Exception:  # a faulty close must not keep the others' threads alive
            log.exception("backend close failed")

    # -- admission --------------------------------------------------------
    def admit(self, context_key: str) -> None:
        """Reserve capacity for a new context; raises EngineBusyError when full."""
        with self.requests.lock:
            is_admitted = self.scheduler.admit(context_key)
        if not is_admitted:
            raise EngineBusyError(
                f"the engine is at capacity ({self.scheduler.max_contexts()} talking contexts); "
                "try again shortly"
            )

    def release_context(self, context_key: str) -> None:
        """The context ended: its capacity goes back, and its playback record with it."""
        with self.requests.lock:
            self.scheduler.release_context(context_key)
            self.requests.release_context(context_key)

    # -- requests ---------------------------------------------------------
    def submit(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Queue a request; iterate the result for its audio chunks."""
        if self._thread is None:
            raise EngineStoppedError("the engine is not running")
        with self.requests.lock:
            handle = self.requests.add(request, time.monotonic())
        self.stats.num_submitted += 1
        self._thread.wake()
        return self._iterate(handle)

    def _wake(self) -> None:
        if self._thread is not None:
            self._thread.wake()

    async def _iterate(self, handle: RequestHandle) -> AsyncIterator[AudioChunk]:
        try:
            while True:
                item = await handle.queue.get()
                if item is None:  # cancelled: end quietly
                    return
                if isinstance(item, BaseException):
                    raise item
                with self.requests.lock:
                    handle.took(item, time.monotonic())
                self._wake()  # what was taken may make the request runnable again
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
        with self.requests.lock:
            handle = self.requests.handles.get(request_id)
            if handle is None or handle.is_done:
                return
            handle.is_cancelled = True
            self.requests.end(handle)
            self.loop.retire(request_id)
        self.stats.num_cancelled += 1
        post(handle, None)
        self._wake()
