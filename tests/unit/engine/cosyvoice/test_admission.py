"""The engine's admission and the cosyvoice scheduler agree: a burst of contexts past what the
sequence table holds (the LM's slots, or the flow cache's streams) is refused as busy by the engine,
and what it admits runs, never held inside the backend (no wait reported, no preemption)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.backends.cosyvoice.backend import CosyVoiceBackend
from engine.engine import Engine, EngineConfig
from engine.errors import EngineBusyError
from engine.scheduler import SchedulerConfig
from engine.types import AudioChunk, RequestId, SynthesisRequest
from tests.support.cosyvoice_parity import one_torch_thread  # noqa: F401 (autouse)
from tests.support.cosyvoice_steps import make_backend
from tests.unit.engine.cosyvoice.test_flow_cache_backend import room_for_two_streams

BURST = 5
TEXT = "Hello there, how are you?"


async def collect(stream: AsyncIterator[AudioChunk]) -> list[AudioChunk]:
    return [chunk async for chunk in stream]


def burst(backend: CosyVoiceBackend) -> tuple[list[str], list[str], list[list[AudioChunk]], Engine]:
    """BURST contexts at once, each with one segment: the admitted, the refused, their audio."""
    async def scenario() -> tuple[list[str], list[str], list[list[AudioChunk]], Engine]:
        # asked for more than the memory holds: the table's figure wins
        config = EngineConfig(scheduler=SchedulerConfig(max_contexts=64), warmup_text="")
        engine = Engine(backend, config)
        await engine.start()
        try:
            admitted, refused = [], []
            for n in range(BURST):
                key = f"burst/{n}"
                try:
                    engine.admit(key)
                except EngineBusyError as exc:
                    assert exc.code == "busy"
                    refused.append(key)
                    continue
                admitted.append(key)
            streams = [engine.submit(SynthesisRequest(RequestId(f"{key}:0"), TEXT, "default",
                                                      context_key=key)) for key in admitted]
            audio = await asyncio.gather(*(collect(stream) for stream in streams))
            for key in admitted:
                engine.release_context(key)
        finally:
            await engine.stop()
        return admitted, refused, list(audio), engine

    return asyncio.run(asyncio.wait_for(scenario(), 180))


@pytest.mark.parametrize("bound", ["lm slots", "flow cache"])
def test_a_burst_past_capacity_is_refused_as_busy_and_never_held_inside_the_backend(
        tmp_path_factory: pytest.TempPathFactory, bound: str) -> None:
    base = tmp_path_factory.getbasetemp()
    if bound == "lm slots":
        backend = make_backend(base, load=False, max_batch_size=2, max_streams=2)
    else:
        backend, _ = room_for_two_streams(base, load=False)
    admitted, refused, audio, engine = burst(backend)
    assert len(admitted) == 2 and len(refused) == BURST - 2
    assert engine.scheduler.stats.num_refused == BURST - 2
    assert all(c and c[-1].is_last and sum(len(chunk.pcm) for chunk in c) for c in audio)
    assert engine.stats.waits == {}, "a request the engine sent was held inside the backend"
    assert backend.num_preemptions == 0
    assert (len(backend.table), backend.table.num_slots, backend.table.num_flows) == (0, 0, 0)
