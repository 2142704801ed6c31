"""The engine loop on a scripted backend: routing, cancel within a step, fault isolation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.backend import BackendRequest, StepPlan, StepResult, due_of
from engine.engine import Engine, EngineConfig
from engine.errors import BackendFailure, EngineBusyError, UnknownVoiceError
from engine.loop import _Step
from engine.scheduler import SchedulerConfig
from engine.types import RequestId, SynthesisRequest
from tests.support.scripted_backend import ScriptedBackend
from tests.support.wait import async_wait_until


def request(name: str, text: str = "hello", voice: str = "v",
            context: str = "") -> SynthesisRequest:
    return SynthesisRequest(RequestId(name), text, voice, context_key=context)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))


async def started(backend: ScriptedBackend, **config) -> Engine:  # type: ignore[no-untyped-def]
    engine = Engine(backend, EngineConfig(scheduler=SchedulerConfig(**config), warmup_text=""))
    await engine.start()
    return engine


def test_requests_from_many_callers_are_batched_and_routed_to_their_owner() -> None:
    async def scenario() -> tuple[dict, ScriptedBackend]:
        # The loop runs on its own thread: the first request may start alone; its step's
        # 10 ms is time enough for the other callers to arrive and share the next ones.
        backend = ScriptedBackend(max_batch_size=4, chunks_per_request=3, step_delay_s=0.01)
        engine = await started(backend, max_batch_size=4)

        async def collect(name: str) -> int:
            return sum([len(c.pcm) async for c in engine.submit(request(name))])

        names = [f"r{n}" for n in range(6)]
        totals = dict(zip(names, await asyncio.gather(*(collect(n) for n in names)), strict=True))
        await engine.stop()
        return totals, backend

    totals, backend = run(scenario())
    assert set(totals.values()) == {3 * 1600}
    assert max(len(b) for b in backend.batches) > 1, "requests were never batched"


def test_each_chunk_carries_the_time_of_the_step_that_made_it() -> None:
    async def scenario() -> tuple[list, Engine]:
        backend = ScriptedBackend(chunks_per_request=3, step_delay_s=0.02)
        engine = await started(backend)
        chunks = [c async for c in engine.submit(request("alone"))]
        await engine.stop()
        return chunks, engine

    chunks, engine = run(scenario())
    assert len(chunks) == 3 and all(c.step_ms >= 20.0 for c in chunks)  # each step sleeps 20 ms
    # one request, one chunk a step: its chunks' step times are all the engine was busy
    assert sum(c.step_ms for c in chunks) == pytest.approx(1000.0 * engine.stats.busy_seconds)


def test_cancel_during_a_step_drops_its_result_and_frees_it_before_the_next_step() -> None:
    async def scenario() -> tuple[list, ScriptedBackend, Engine]:
        backend = ScriptedBackend(chunks_per_request=50)
        backend.gate = threading.Event()
        engine = await started(backend)
        got: list = []

        async def consume() -> None:
            async for chunk in engine.submit(request("victim")):
                got.append(chunk)

        task = asyncio.create_task(consume())
        await asyncio.get_running_loop().run_in_executor(None, backend.step_started.wait, 5)
        engine.cancel(RequestId("victim"))       # while its step is running
        backend.gate.set()
        await asyncio.wait_for(task, 5)           # the consumer ends quietly
        other = [c async for c in engine.submit(request("other"))]
        assert other and other[-1].is_last
        await engine.stop()
        return got, backend, engine

    got, backend, engine = run(scenario())
    assert got == []
    assert "victim" in backend.released
    assert all("victim" not in batch for batch in backend.batches[1:])
    assert engine.stats.num_cancelled == 1


def test_a_cancel_during_a_batched_step_fails_no_step_and_reruns_nothing() -> None:
    async def scenario() -> tuple[list, ScriptedBackend, Engine]:
        backend = ScriptedBackend(max_batch_size=4, chunks_per_request=3)
        backend.gate = threading.Event()
        engine = await started(backend, max_batch_size=4)
        backend.batches.clear()
        victim = engine.submit(request("victim"))
        survivor = engine.submit(request("survivor"))
        victim_task = asyncio.create_task(victim.__anext__())
        survivor_task = asyncio.create_task(_collect(survivor))
        await asyncio.get_running_loop().run_in_executor(None, backend.step_started.wait, 5)
        engine.cancel(RequestId("victim"))     # while the step walks both states
        backend.gate.set()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(victim_task, 5)
        got = await asyncio.wait_for(survivor_task, 5)
        await engine.stop()
        return got, backend, engine

    got, backend, engine = run(scenario())
    assert backend.batches[0] == ["victim", "survivor"], \
        "both were in the step that was cancelled into"
    assert [len(b) for b in backend.batches] == [2, 1, 1], "a step was re-run item by item"
    assert engine.stats.num_failed == 0 and engine.num_failed_steps_in_row == 0
    assert got and got[-1].is_last and sum(len(c.pcm) for c in got) == 3 * 1600
    assert backend.released.count("victim") == 1
    assert backend.release_threads <= backend.step_threads, "release ran off the worker thread"


def test_a_new_turn_waits_behind_at_most_one_step_of_look_ahead_work() -> None:
    async def scenario() -> list[str]:
        # Four readers far ahead of their listeners (10 s each, look-ahead 0.2 s) keep the box busy.
        backend = ScriptedBackend(max_batch_size=8, chunks_per_request=100, chunk_s=0.1,
                                  step_delay_s=0.005)
        engine = Engine(backend, EngineConfig(scheduler=SchedulerConfig(max_batch_size=8),
                                              warmup_text="", look_ahead_s=0.2))
        await engine.start()
        readers = [asyncio.create_task(_collect(engine.submit(request(f"bg{n}"))))
                   for n in range(4)]
        await async_wait_until(lambda: len(backend.batches) >= 20, timeout=10.0, interval=0.005,
                               message="the readers made fewer than 20 steps")
        mark = len(backend.events)
        first = await engine.submit(request("new")).__anext__()
        assert first.pcm.size
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await engine.stop()
        return backend.events[mark:]

    events = run(scenario())
    before_prepare = events[: events.index("prepare:new")]
    assert sum(e.startswith("step:") for e in before_prepare) <= 1, \
        "its prepare waited behind look-ahead steps"
    after = events[events.index("prepare:new") + 1:]
    first_step = next(i for i, e in enumerate(after) if "new" in e)
    assert sum(e.startswith("step:") for e in after[:first_step]) <= 1, \
        "its first piece waited behind look-ahead"
    assert all(e.count(",") == 0 for e in before_prepare + after[:first_step]
               if e.startswith("step:")), \
        "look-ahead work ran in batches, not alone"


async def _collect(stream) -> list:  # type: ignore[no-untyped-def]
    return [chunk async for chunk in stream]


def test_a_failing_request_ends_alone_and_the_others_are_served() -> None:
    async def scenario() -> list:
        backend = ScriptedBackend(max_batch_size=4)
        engine = await started(backend, max_batch_size=4)

        async def collect(name: str, text: str) -> object:
            try:
                return [c async for c in engine.submit(request(name, text))]
            except BackendFailure as exc:
                return exc

        results = await asyncio.gather(collect("ok1", "fine"), collect("bad", "FAIL"),
                                       collect("ok2", "fine"))
        results.append(await collect("crash", "CRASH whole step"))
        results.append(await collect("after", "still serving"))
        await engine.stop()
        return results

    ok1, bad, ok2, crash, after = run(scenario())
    assert isinstance(bad, BackendFailure) and isinstance(crash, BackendFailure)
    for good in (ok1, ok2, after):
        assert isinstance(good, list) and good[-1].is_last


def test_unknown_voice_is_reported_to_that_request() -> None:
    async def scenario() -> None:
        engine = await started(ScriptedBackend())
        with pytest.raises(UnknownVoiceError):
            async for _ in engine.submit(request("x", voice="nobody")):
                pass
        await engine.stop()

    run(scenario())


def test_a_reader_that_does_not_read_holds_back_only_its_own_request() -> None:
    async def scenario() -> tuple[int, int]:
        backend = ScriptedBackend(chunks_per_request=200, chunk_s=0.01)
        engine = await started(backend)
        stalled = engine.submit(request("stalled"))
        first = await stalled.__anext__()       # then never read again
        assert len(first.pcm)
        done = [c async for c in engine.submit(request("reader"))]
        steps_of_stalled = sum(1 for b in backend.batches if "stalled" in b)
        await stalled.aclose()
        await engine.stop()
        return len(done), steps_of_stalled

    num_chunks, stalled_steps = run(scenario())
    assert num_chunks == 200
    assert stalled_steps <= 17  # its queue of 16 filled, then it was not stepped


def test_admission_answers_busy_past_the_limit() -> None:
    async def scenario() -> None:
        engine = await started(ScriptedBackend(), max_contexts=1)
        engine.admit("a")
        with pytest.raises(EngineBusyError, match="capacity"):
            engine.admit("b")
        engine.release_context("a")
        engine.admit("b")
        await engine.stop()

    run(scenario())


def test_voice_features_run_on_the_backends_own_executor_while_a_step_holds_the_worker() -> None:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    class CloningBackend(ScriptedBackend):
        def __init__(self) -> None:
            super().__init__(chunks_per_request=1)
            self.cpu = ThreadPoolExecutor(1, thread_name_prefix="cloning-cpu")
            self.feature_threads: list[str] = []

        def voice_features_executor(self) -> ThreadPoolExecutor:
            return self.cpu

        def make_voice_features(self, audio: np.ndarray, sample_rate: int,
                                transcript: str) -> bytes:
            self.feature_threads.append(threading.current_thread().name)
            return b"features"

    async def scenario() -> tuple[bytes | None, CloningBackend]:
        backend = CloningBackend()
        backend.gate = threading.Event()
        engine = await started(backend)
        stream = engine.submit(request("speaking"))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.get_running_loop().run_in_executor(None, backend.step_started.wait, 5)
        # The worker is inside a step (held by the gate): registration must not wait for it.
        features = await asyncio.wait_for(
            engine.make_voice_features(np.zeros(16000, np.float32), 16000, "Hi."), 5)
        backend.gate.set()
        await asyncio.wait_for(first, 5)
        await engine.stop()
        backend.cpu.shutdown()
        return features, backend

    features, backend = run(scenario())
    assert features == b"features"
    assert backend.feature_threads and backend.feature_threads[0].startswith("cloning-cpu")


class LaneBackend(ScriptedBackend):
    """A scripted backend whose steps may run side by side (as piper's do): two lanes.

    A request named in `gates` blocks in its step until its gate opens; `events`
    records begin/end of each step and each release, and `violations` any
    release of a request while a step of it runs.
    """

    concurrent_steps = True
    parallelism = 2
    serial_items = True

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.gates: dict[str, threading.Event] = {}
        self.running: set[str] = set()
        self.lock = threading.Lock()
        self.log: list[str] = []
        self.violations: list[str] = []
        self.plans: list[tuple[str, StepPlan | None]] = []  # each item's plan, by step

    def step(self, batch):  # type: ignore[no-untyped-def]
        names = [str(item.request_id) for item in batch]
        with self.lock:
            assert not self.running.intersection(names), "a request ran in two steps at once"
            self.running.update(names)
            self.log += [f"begin:{n}" for n in names]
            self.plans += [(str(item.request_id), item.plan) for item in batch]
        try:
            for name in names:
                if name in self.gates:
                    self.gates[name].wait(10)
            return super().step(batch)
        finally:
            with self.lock:
                self.running.difference_update(names)
                self.log += [f"end:{n}" for n in names]

    def release(self, item):  # type: ignore[no-untyped-def]
        with self.lock:
            if str(item.request_id) in self.running:
                self.violations.append(str(item.request_id))
            self.log.append(f"release:{item.request_id}")
        super().release(item)


async def blocked_in_a_lane(name: str) -> tuple[LaneBackend, Engine, asyncio.Task]:
    """A lane engine whose request `name` is blocked inside its first step (until its gate
    opens)."""
    backend = LaneBackend(chunks_per_request=5)
    engine = await started(backend)
    backend.gates[name] = threading.Event()
    task = asyncio.create_task(_collect(engine.submit(request(name))))
    await async_wait_until(lambda: f"begin:{name}" in backend.log, timeout=10.0, interval=0.005,
                           message=f"{name} never began its step")
    return backend, engine, task


def test_with_lanes_a_long_step_holds_back_no_other_request() -> None:
    async def scenario() -> tuple[list[str], LaneBackend]:
        backend, engine, slow = await blocked_in_a_lane("slow")
        # slow still blocked
        fast = await asyncio.wait_for(_collect(engine.submit(request("fast"))), 5)
        assert fast and fast[-1].is_last
        log = list(backend.log)
        backend.gates["slow"].set()
        await asyncio.wait_for(slow, 5)
        await engine.stop()
        return log, backend

    log, backend = run(scenario())
    assert log.count("begin:fast") == 5 and "end:slow" not in log, \
        "fast waited for the slow step beside it"
    assert len(backend.step_threads) == 2, "steps did not run on two lanes"


def test_with_lanes_the_loop_sleeps_while_the_only_request_is_in_its_step() -> None:
    # The request's lead stays under the look-ahead until its step routes audio; that
    # must not wake the loop every few milliseconds for as long as the step runs.
    async def scenario() -> tuple[int, int]:
        backend, engine, slow = await blocked_in_a_lane("slow")
        schedule, calls = engine.scheduler.schedule, [0]

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[0] += 1
            return schedule(*args, **kwargs)

        engine.scheduler.schedule = counted  # type: ignore[method-assign]
        # The window is the subject: a loop that woke every few milliseconds while the step
        # ran would schedule tens of times in it; one that sleeps, at most twice.
        await asyncio.sleep(0.3)
        during = calls[0]
        backend.gates["slow"].set()
        await asyncio.wait_for(slow, 5)
        after = calls[0]
        await engine.stop()
        return during, after

    during, after = run(scenario())
    assert during <= 2, "the loop kept waking while the step ran"
    assert after > during, "the count saw no scheduling at all: it measured nothing"


def test_with_lanes_a_cancel_during_a_step_releases_after_that_step_and_fails_nothing() -> None:
    async def scenario() -> tuple[LaneBackend, Engine, list]:
        backend, engine, victim = await blocked_in_a_lane("victim")
        engine.cancel(RequestId("victim"))  # its step is running in one lane
        # the other lane steps
        other = await asyncio.wait_for(_collect(engine.submit(request("other"))), 5)
        backend.gates["victim"].set()
        await asyncio.wait_for(victim, 5)
        # released by the next step or the idle loop
        await async_wait_until(lambda: "release:victim" in backend.log, timeout=5.0,
                               message="the cancelled request was never released")
        await engine.stop()
        return backend, engine, other

    backend, engine, other = run(scenario())
    assert other and other[-1].is_last
    assert backend.violations == [], "a request was released while its step ran"
    assert backend.log.index("release:victim") > backend.log.index("end:victim")
    assert backend.log.count("begin:victim") == 1, "the cancelled request was stepped again"
    assert engine.stats.num_failed == 0 and engine.num_failed_steps_in_row == 0


def test_with_lanes_a_step_beside_one_due_soon_is_told_so_by_the_engine() -> None:
    # The engine decides, the backend runs: the step of "fast" starts while "slow" (due now:
    # busy) holds the other lane, and its plan says so; the first step of "slow" ran alone.
    async def scenario() -> LaneBackend:
        backend, engine, slow = await blocked_in_a_lane("slow")
        fast = await asyncio.wait_for(_collect(engine.submit(request("fast"))), 5)
        assert fast and fast[-1].is_last
        backend.gates["slow"].set()
        await asyncio.wait_for(slow, 5)
        await engine.stop()
        return backend

    plans = run(scenario()).plans
    slow_first = next(plan for name, plan in plans if name == "slow")
    fast_first = next(plan for name, plan in plans if name == "fast")
    assert slow_first is not None and slow_first.is_alone and not slow_first.is_contended
    assert slow_first.is_lone, "the only talking context was not planned as such"
    assert fast_first is not None and not fast_first.is_alone and fast_first.is_contended
    assert not fast_first.is_lone, "another context with work held a lane"


def test_each_step_is_planned_from_the_running_steps_and_the_contexts_with_work() -> None:
    # No loop runs and no thread steps: the plan is driven by hand, as the loop would.
    backend = LaneBackend()
    engine = Engine(backend, EngineConfig(warmup_text=""))
    now = time.monotonic()

    def held(name: str, context: str, due_in: float) -> BackendRequest:
        item = BackendRequest(SynthesisRequest(RequestId(name), "hi", "v", context_key=context),
                              due=now + due_in)
        engine.scheduler.add(item)
        return item

    mine, my_next = held("a1", "s1", 0.0), held("a2", "s1", 5.0)
    assert engine.loop.plan([mine], {}) is True  # due now: busy
    assert mine.plan == StepPlan(due_of(mine), is_alone=True, is_contended=False, is_lone=True)
    other = held("b1", "s2", 3.0)  # another session's segment, prepared: s1 no longer talks alone
    loop = asyncio.new_event_loop()
    try:
        beside_ahead = {loop.create_future(): _Step([other], now, is_busy=False)}
        assert engine.loop.plan([my_next], beside_ahead) is False  # due in 5 s: look-ahead work
        assert my_next.plan == StepPlan(due_of(my_next), is_alone=False, is_contended=False)
        engine.loop.plan([mine], {loop.create_future(): _Step([other], now, is_busy=True)})
        assert mine.plan == StepPlan(due_of(mine), is_alone=False, is_contended=True)
        ended = loop.create_future()
        ended.set_result([])  # a step that returned runs beside nothing, routed or not
        engine.loop.plan([mine], {ended: _Step([other], now, is_busy=True)})
        assert mine.plan is not None and mine.plan.is_alone and not mine.plan.is_contended
    finally:
        loop.close()
    engine.loop.retire(other.request_id)  # finished: s2 talks until its release is made
    engine.loop.plan([mine], {})
    assert mine.plan is not None and not mine.plan.is_lone
    # made before the step
    assert [item.request_id for item in engine.requests.take_releases()] == ["b1"]
    engine.loop.plan([mine], {})
    assert mine.plan is not None and mine.plan.is_lone


def test_the_callers_config_is_left_as_given_and_the_effective_one_is_shown() -> None:
    scheduler = SchedulerConfig(max_batch_size=16, parallelism=1, serial_items=False)
    config = EngineConfig(scheduler=scheduler, warmup_text="")
    laned = Engine(LaneBackend(max_batch_size=4), config)
    plain = Engine(ScriptedBackend(max_batch_size=4), config)  # the same config, reused
    assert (scheduler.max_batch_size, scheduler.parallelism,
            scheduler.serial_items) == (16, 1, False)
    assert config.scheduler is scheduler
    assert laned.num_lanes == 2 and plain.num_lanes == 1
    effective = laned.scheduler_config  # a step per lane, one request each
    assert (effective.max_batch_size, effective.parallelism, effective.serial_items) == (4, 1, True)
    assert laned.scheduler.config is effective
    effective = plain.scheduler_config
    assert (effective.max_batch_size, effective.parallelism,
            effective.serial_items) == (4, 1, False)


class RoomBackend(ScriptedBackend):
    """One request at a time holds the backend's only room (as a stream holds a flow cache's
    blocks); another reports it waits, until `room` is set free (by the test, or a release)."""

    def __init__(self) -> None:
        super().__init__(max_batch_size=4, chunks_per_request=2)
        self.holder: str | None = "someone else"
        self.num_all_waited = 0  # steps in which no item ran

    def step(self, batch: list[BackendRequest]) -> list[StepResult]:
        results: list[StepResult] = []
        for item in batch:
            if self.holder is None:
                self.holder = str(item.request_id)
            if self.holder != str(item.request_id):
                results.append(StepResult(waiting="room"))
            else:
                (result,) = super().step([item])
                results.append(result)
        self.num_all_waited += all(r.waiting for r in results)
        return results

    def release(self, item: BackendRequest) -> None:
        if self.holder == str(item.request_id):
            self.holder = None
        super().release(item)


def test_what_the_backend_cannot_run_is_counted_and_tried_again_now_and_then_never_spun() -> None:
    async def scenario() -> tuple[list, RoomBackend, Engine]:
        backend = RoomBackend()
        engine = await started(backend, max_batch_size=4)
        stream = engine.submit(request("waits"))
        await asyncio.sleep(0.3)  # the room is held elsewhere meanwhile: nothing else to run
        backend.holder = None
        got = await asyncio.wait_for(_collect(stream), 5)
        await engine.stop()
        return got, backend, engine

    got, backend, engine = run(scenario())
    assert got and got[-1].is_last
    assert engine.stats.waits["room"] >= 2  # counted every time it waited
    assert backend.num_all_waited <= 12, "a step of nothing but waits came back at once, again"


def test_a_contexts_first_audio_is_timed_and_its_later_segments_are_not() -> None:
    async def scenario() -> Engine:
        backend = ScriptedBackend(chunks_per_request=2, step_delay_s=0.03)
        engine = await started(backend)
        engine.admit("c")
        streams = [engine.submit(request(name, context="c")) for name in ("c-0", "c-1")]
        streams.append(engine.submit(request("solo")))  # a request on its own: its first audio

        async def drain(stream) -> None:  # type: ignore[no-untyped-def]
            async for _ in stream:
                pass

        await asyncio.gather(*(drain(s) for s in streams))
        engine.release_context("c")
        await engine.stop()
        return engine

    stats = run(scenario()).stats
    assert sum(stats.first_audio_bucket_counts) == 2  # "c-0" and "solo", not "c-1"
    # each was needed at its submission and made by a step of at least 30 ms
    assert stats.first_audio_seconds >= 2 * 0.03
