"""The engine loop on its own thread: it steps while the gateway's event loop is busy, each step's
results reach that loop as one callback, and stop leaves no thread of it behind."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from engine.engine import Engine, EngineConfig
from engine.loop import deliver
from engine.loop_thread import THREAD_NAME
from engine.scheduler import SchedulerConfig
from engine.types import RequestId, SynthesisRequest
from tests.support.scripted_backend import ScriptedBackend


def request(name: str) -> SynthesisRequest:
    return SynthesisRequest(RequestId(name), "hello", "v")


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))


async def started(backend: ScriptedBackend) -> Engine:
    engine = Engine(backend, EngineConfig(scheduler=SchedulerConfig(max_batch_size=4),
                                          warmup_text=""))
    await engine.start()
    return engine


def loop_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The loop threads alive now that were not `before` (other tests' engines are not ours)."""
    return [t for t in threading.enumerate()
            if t.name == THREAD_NAME and t.is_alive() and t not in before]


def test_the_loop_runs_on_its_own_thread_and_stop_ends_it() -> None:
    async def scenario() -> tuple[set[str], int, int]:
        before = set(threading.enumerate())
        backend = ScriptedBackend(chunks_per_request=2)
        engine = await started(backend)
        during = len(loop_threads(before))
        prepared_on: set[str] = set()
        prepare = backend.prepare

        def recorded(req: SynthesisRequest) -> Any:
            prepared_on.add(threading.current_thread().name)
            return prepare(req)

        backend.prepare = recorded  # type: ignore[method-assign]
        chunks = [c async for c in engine.submit(request("a"))]
        assert chunks[-1].is_last and engine.is_healthy
        await engine.stop()
        assert not engine.is_healthy
        return prepared_on, during, len(loop_threads(before))

    prepared_on, during, after = run(scenario())
    assert during == 1 and after == 0
    assert threading.current_thread().name not in prepared_on  # never on the gateway's loop
    assert all(name.startswith("voxgate-engine") for name in prepared_on)


def test_the_engine_steps_while_the_gateways_event_loop_is_blocked() -> None:
    async def scenario() -> tuple[int, int]:
        backend = ScriptedBackend(chunks_per_request=100, chunk_s=0.01, step_delay_s=0.005)
        engine = await started(backend)
        stream = engine.submit(request("a"))
        first = await stream.__anext__()
        assert len(first.pcm)
        before = len(backend.batches)
        time.sleep(0.3)  # the gateway's loop is busy: no turn of it for 0.3 s
        during = len(backend.batches) - before
        await stream.aclose()
        await engine.stop()
        return before, during

    _, during = run(scenario())
    # Its queue of 16 fills with no reader; the steps that fill it need no turn of the loop.
    assert during >= 10, "the engine waited for the gateway's event loop"


def test_each_step_reaches_the_gateways_loop_as_one_callback() -> None:
    async def scenario() -> tuple[list[int], ScriptedBackend, dict[str, int]]:
        backend = ScriptedBackend(max_batch_size=4, chunks_per_request=3)
        backend.gate = threading.Event()  # the first step waits until every request is in
        engine = await started(backend)
        loop = asyncio.get_running_loop()
        handoffs: list[int] = []  # items per hand-off of routed results
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            if callback is deliver:
                handoffs.append(len(args[0]))
            return call_soon_threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        streams = [engine.submit(request(f"r{n}")) for n in range(4)]
        tasks = [asyncio.ensure_future(_collect(s)) for s in streams]
        await loop.run_in_executor(None, backend.step_started.wait, 5)
        backend.gate.set()
        got = await asyncio.gather(*tasks)
        await engine.stop()
        return handoffs, backend, {f"r{n}": len(c) for n, c in enumerate(got)}

    handoffs, backend, counts = run(scenario())
    assert counts == {f"r{n}": 3 for n in range(4)}
    assert len(handoffs) == len(backend.batches), "not one hand-off per step"
    assert sum(handoffs) == 12 and max(handoffs) == 4, "a batched step's chunks went one by one"


async def _collect(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]
