"""The engine's scheduling loop: prepare, schedule, step, route, for every session's requests.

Each iteration is prepare (new requests, most urgent first, on the worker
thread), schedule (EDF over each request's next piece, engine/scheduler.py),
run (one backend step in the worker thread, or one per free lane) and route
(chunks to each request's bounded queue). The loop runs on a thread of its
own, with an event loop of its own (engine/loop_thread.py), so no step,
prepare or release waits for a turn of the gateway's event loop. It reads
and changes the request table (engine/requests.py) and the scheduler under
the table's lock, and touches the backend only through the worker and the
lanes. What a step routed (each request's chunk, an error that ends one)
goes to the consumers as one batch (`send_outbox`: one hand-off to the
gateway's event loop per step, not one per chunk), where `deliver` puts
each item into its request's queue. The engine's face (engine/engine.py)
starts the thread and stops it.

Thread contract (the engine's docstring): `prepare`, `step` and `release`
run only on the worker thread, or, for a backend with `concurrent_steps`, a
step on a lane of its own; a request is never in two steps at once, and is
released only once no step holds it. As it starts a step the loop hands each
item its `StepPlan` (engine/backend.py). An item the backend could not run
(`StepResult.waiting`) is counted and left out of the batches until work has
moved (a step made audio or a request left), so a step of nothing but waits
never spins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import clock
from engine.backend import Backend, BackendRequest, StepResult, due_of
from engine.clock import RequestHandle
from engine.errors import BackendFailure, EngineBusyError, EngineError
from engine.requests import RequestTable
from engine.scheduler import Scheduler, context_of, is_busy, plan_step
from engine.stats import EngineStats
from engine.types import AudioChunk, RequestId

log = logging.getLogger("voxgate.engine")

#: an item the backend could not run is tried again after this even if nothing moved
WAIT_RETRY_S = 0.05


@dataclass(slots=True)
class _Step:
    """A step running in a lane: its batch, when it started, and whether it is busy (`is_busy`)."""

    batch: list[BackendRequest]
    started: float
    is_busy: bool


Running = dict[asyncio.Future[list[StepResult]], _Step]
#: routed items on their way to the consumers: a request's chunk, or the error that ends it
Deliveries = list[tuple[RequestHandle, AudioChunk | BaseException]]


class StepLoop:
    """The loop over one backend; `run` is its task, on the engine's loop thread."""

    def __init__(self, backend: Backend, scheduler: Scheduler, requests: RequestTable,
                 stats: EngineStats, worker: Executor, lanes: Executor, num_lanes: int,
                 look_ahead_s: float, max_prepare_per_step: int, lane_slack_s: float) -> None:
        self.backend, self.scheduler, self.requests = backend, scheduler, requests
        self.stats = stats
        self.worker, self.lanes, self.num_lanes = worker, lanes, num_lanes
        self.look_ahead_s = look_ahead_s
        self.max_prepare_per_step = max_prepare_per_step
        self.lane_slack_s = lane_slack_s
        self.wake = asyncio.Event()  # set on the loop's own event loop only (engine/loop_thread.py)
        self.num_failed_steps_in_row = 0
        #: what was routed (chunks, and errors that end a request) since it was last sent
        self.outbox: Deliveries = []
        #: hands a batch to the consumers: on their event loop, from the loop's thread once it
        #: runs (engine/loop_thread.py), else at once (the caller is on it)
        self.send: Callable[[Deliveries], None] = deliver

    def retire(self, request_id: RequestId) -> None:
        """Take a request out of the scheduler; the worker releases it before its next step."""
        item = self.scheduler.remove(request_id)
        if item is not None:
            self.requests.to_release.append(item)
        self.requests.waiting.clear()  # a request left: what waited for room may fit now

    def fail(self, handle: RequestHandle, exc: BaseException) -> None:
        """End a request with an error (engine errors as they are, others as `internal`)."""
        self.requests.end(handle)
        self.stats.num_failed += 1
        if not isinstance(exc, EngineError):
            log.error("request %s failed: %r", handle.request.request_id, exc)
            wrapped = BackendFailure("speech synthesis failed for this segment")
            wrapped.__cause__ = exc
            exc = wrapped
        self.outbox.append((handle, exc))

    async def run(self) -> None:
        """The loop, on the engine's own thread and event loop (engine/loop_thread.py)."""
        loop = asyncio.get_running_loop()
        running: Running = {}
        requests = self.requests
        lock = requests.lock
        try:
            while True:
                with lock:
                    fresh = self._take_incoming(time.monotonic())
                if fresh:
                    prepared = await loop.run_in_executor(self.worker, self._prepare_all, fresh)
                    with lock:
                        for handle, outcome in zip(fresh, prepared, strict=True):
                            self._admit_prepared(handle, outcome)
                    self.send_outbox()
                timeout, has_incoming = None, False
                with lock:
                    self._start_steps(loop, running)
                    releases = [] if running else requests.take_releases()
                    if not running and not releases:
                        # Cleared on this loop before it looks: a wake posted from the gateway's
                        # loop runs here later, after this, so none is lost.
                        self.wake.clear()
                        timeout = self._next_wake_s(time.monotonic())
                        has_incoming = bool(requests.incoming)
                if not running:
                    if releases:  # shielded: a stop cancelling the loop keeps it
                        await asyncio.shield(loop.run_in_executor(
                            self.worker, self.release_all, releases))
                        continue
                    if not has_incoming:  # else: prepare the next few first
                        await self._sleep(timeout)
                    with lock:
                        requests.waiting.clear()  # what the backend could not run is tried again
                    continue
                for future in await self._wait_steps(running):
                    step = running.pop(future)
                    results = await self._results(future, step.batch)
                    with lock:
                        requests.in_flight.difference_update(item.request_id for item in step.batch)
                        self._route(step.batch, results, time.monotonic() - step.started)
                    self.send_outbox()
        finally:
            # A step handed to a thread runs to its end, and the releases it makes first with it
            # (cancelled before its thread took it, they would be lost): the engine's stop waits
            # for the threads, and nobody reads the results.
            for future in running:
                future.add_done_callback(_ignore)

    def _start_steps(self, loop: asyncio.AbstractEventLoop, running: Running) -> None:
        """Under the lock: set each request's due time, then start a step in each free lane
        while there is work to run."""
        requests = self.requests
        now = time.monotonic()
        clock.set_dues(self.scheduler.items(), requests.handles, now)
        horizon = self.look_ahead_s

        def is_ahead(item: BackendRequest) -> bool:
            return clock.is_ahead(item, now, horizon)

        while len(running) < self.num_lanes:
            due_by = now + self.lane_slack_s if running else None
            batch = self.scheduler.schedule(now, requests.is_runnable, is_ahead, due_by)
            if not batch:
                break
            requests.in_flight.update(item.request_id for item in batch)
            releases = requests.take_releases()
            is_step_busy = self.plan(batch, running)
            future = loop.run_in_executor(self.lanes, self._work, releases, batch)
            running[future] = _Step(batch, time.monotonic(), is_step_busy)

    def send_outbox(self) -> None:
        """Hand what was routed since the last call to the consumers, as one batch."""
        if self.outbox:
            batch, self.outbox = self.outbox, []
            self.send(batch)

    def plan(self, batch: list[BackendRequest], running: Running) -> bool:
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
        live.update(context_of(item.request) for item in self.requests.to_release)
        for item, plan in zip(batch, plan_step(batch, now, beside, live), strict=True):
            item.plan = plan
        return is_busy(batch, now, self.backend.busy_lead_s)

    async def _wait_steps(self, running: Running) -> set[asyncio.Future[list[StepResult]]]:
        """The steps that ended (`running` holds one or more); back early for new work or a
        clock with lanes (new requests are prepared on the worker while the lanes step)."""
        if self.num_lanes == 1:  # the worker is busy: nothing else could run
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            return done
        with self.requests.lock:
            self.wake.clear()
            now = time.monotonic()
            timeout = self._next_wake_s(now)
            if len(running) < self.num_lanes:  # back when held work falls due
                held = self._held_s(now)
                if held is not None:
                    timeout = held if timeout is None else min(timeout, held)
        woken: asyncio.Future[Any] = asyncio.ensure_future(self.wake.wait())
        waiting: list[asyncio.Future[Any]] = [*running, woken]
        try:
            done, _ = await asyncio.wait(waiting, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        return {future for future in running if future in done}

    async def _results(self, future: asyncio.Future[list[StepResult]],
                       batch: list[BackendRequest]) -> list[StepResult]:
        """A finished step's results; a failed step of two or more is re-run item by item."""
        try:
            results = future.result()
            if len(results) != len(batch):
                raise BackendFailure(
                    f"backend returned {len(results)} results for {len(batch)} items")
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
            return await loop.run_in_executor(self.lanes, self._step_isolated, batch)

    def _held_s(self, now: float) -> float | None:
        """Seconds until work held back from a free lane (`lane_slack_s`) falls due."""
        dues = [due_of(item) for item in self.scheduler.items() if self.requests.is_runnable(item)]
        return max(min(dues) - self.lane_slack_s - now, 0.005) if dues else None

    async def _sleep(self, timeout: float | None) -> None:
        """Wait for new work, a read, a cancel, or until a clock makes a request runnable."""
        try:
            await asyncio.wait_for(self.wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _work(self, releases: list[BackendRequest],
              batch: list[BackendRequest]) -> list[StepResult]:
        """Worker thread: free what was cancelled since the last step, then step."""
        self.release_all(releases)
        return self.backend.step(batch)

    def release_all(self, items: list[BackendRequest]) -> None:
        for item in items:
            try:
                self.backend.release(item)
            except Exception:  # a faulty release must not stop the loop
                log.exception("backend release failed for %s", item.request_id)

    def _take_incoming(self, now: float) -> list[RequestHandle]:
        """The new requests to prepare now: due within the look-ahead, most urgent first."""
        fresh, self.requests.incoming = clock.take_incoming(
            self.requests.incoming, now, self.look_ahead_s, self.max_prepare_per_step)
        return fresh

    def _admit_prepared(self, handle: RequestHandle,
                        outcome: BackendRequest | BaseException) -> None:
        if handle.is_cancelled:
            if isinstance(outcome, BackendRequest):
                self.requests.to_release.append(outcome)
        elif isinstance(outcome, BackendRequest):
            try:
                self.scheduler.add(outcome)
            except OverflowError as exc:
                self.requests.to_release.append(outcome)
                self.fail(handle, EngineBusyError(str(exc)))
                return
            handle.est_s = outcome.est_audio_s
        else:
            self.fail(handle, outcome)

    def _next_wake_s(self, now: float) -> float | None:
        """Seconds until some request's lead falls under the look-ahead (None: only events wake).

        A request in a running step is left out: the step's end wakes the loop for it
        (else its lead, below the look-ahead until the step routes audio, would wake the
        loop every few milliseconds for the whole step). A request the backend could not
        run is tried again within `WAIT_RETRY_S`, whatever else happens.
        """
        requests = self.requests
        idle = [item for item in self.scheduler.items()
                if item.request_id not in requests.in_flight]
        if not requests.waiting:
            return clock.next_wake_s(idle, requests.handles, now, self.look_ahead_s)
        idle = [item for item in idle if item.request_id not in requests.waiting]
        wake = clock.next_wake_s(idle, requests.handles, now, self.look_ahead_s)
        return WAIT_RETRY_S if wake is None else min(wake, WAIT_RETRY_S)

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

    def _route(self, batch: list[BackendRequest], results: list[StepResult],
               elapsed: float) -> None:
        audio_s = 0.0
        has_moved = False
        requests = self.requests
        rate = self.backend.sample_rate
        now = time.monotonic()
        for item, result in zip(batch, results, strict=True):
            audio_s += len(result.pcm) / rate
            handle = requests.handles.get(item.request_id)
            if handle is None or handle.is_cancelled:
                continue
            if result.error is not None:
                self.retire(item.request_id)
                self.fail(handle, result.error)
                continue
            if result.waiting is not None:  # not run: counted, and left out until work moves
                self.stats.count_wait(result.waiting)
                requests.waiting.add(item.request_id)
                continue
            chunk = AudioChunk(item.request_id, np.asarray(result.pcm, dtype=np.float32),
                               rate, result.is_finished, result.words,
                               step_ms=1000.0 * elapsed)
            if handle.made_s == 0.0 and handle.prev is None and len(chunk.pcm):
                # a context's first audio: how long after it was needed (engine/stats.py)
                self.stats.observe_first_audio(max(0.0, now - handle.start()))
            handle.made_s += chunk.duration_ms / 1000.0
            handle.est_s = item.est_audio_s  # a backend may know the length better once it ran
            if result.is_finished:
                self.retire(item.request_id)
                handle.is_finished = True
                requests.end(handle)
                self.stats.num_finished += 1
            if len(chunk.pcm) or chunk.is_last:
                handle.num_unread += 1
                self.outbox.append((handle, chunk))
                has_moved = True
        if has_moved and requests.waiting:
            requests.waiting.clear()  # audio was made: what waited may run now
        self.scheduler.record_step(batch, elapsed, audio_s, time.monotonic())
        self.stats.num_steps += 1
        self.stats.audio_seconds += audio_s
        self.stats.busy_seconds += elapsed
        self.stats.last_step_seconds = elapsed
        self.stats.observe_step(elapsed)
        self.stats.last_batch_size = len(batch)


def _ignore(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # read, so that a step that failed as the engine stopped logs nothing


def post(handle: RequestHandle, item: BaseException | None) -> None:
    """Put a terminal item, displacing the oldest chunk if the queue is full (the consumers'
    event loop only); nothing is put after it."""
    if handle.is_closed:
        return
    handle.is_closed = True
    if handle.queue.full():
        handle.queue.get_nowait()
    handle.queue.put_nowait(item)


def deliver(batch: Deliveries) -> None:
    """On the consumers' event loop: each routed item into its request's queue, in order.

    A chunk never finds its queue full: the loop steps a request only while fewer than
    `QUEUE_DEPTH` of its chunks are unread (engine/requests.py). A request ended meanwhile
    (cancelled: its queue is closed) gets nothing more.
    """
    for handle, item in batch:
        if handle.is_closed:
            continue
        if isinstance(item, AudioChunk):
            handle.queue.put_nowait(item)
        else:
            post(handle, item)

