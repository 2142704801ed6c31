"""`Engine.stop` ends every thread the engine started, and every one its backend started
(`Backend.close`): no thread named voxgate-* that the engine's life started is alive after it, for
piper and for cosyvoice (a tiny random model with its flow thread on, as on a GPU). Threads of other
tests' backends, alive in the same process before, are not this engine's and are left out."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from engine.backend import Backend
from engine.backends import create_backend
from engine.engine import Engine, EngineConfig
from engine.types import AudioChunk, RequestId, SynthesisRequest


def voxgate_threads(before: set[threading.Thread]) -> list[str]:
    """The names of the voxgate-* threads alive now that were not alive `before`."""
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("voxgate-") and t.is_alive() and t not in before)


async def collect(stream: AsyncIterator[AudioChunk]) -> list[AudioChunk]:
    return [chunk async for chunk in stream]


def speak_then_stop(backend: Backend, voice: str) -> tuple[list[str], list[str]]:
    """The voxgate-* threads started since the engine was made: as it speaks, and after its stop."""
    before = set(threading.enumerate())

    async def scenario() -> tuple[list[str], list[str]]:
        engine = Engine(backend, EngineConfig(warmup_text=""))
        await engine.start()
        try:
            for n in range(2):  # two at once: the lanes and pools are used
                engine.admit(f"c{n}")
            streams = [engine.submit(SynthesisRequest(RequestId(f"s{n}"), "Hello there.", voice,
                                                      context_key=f"c{n}")) for n in range(2)]
            chunks = await asyncio.gather(*(collect(stream) for stream in streams))
            assert all(c and c[-1].is_last for c in chunks)
            during = voxgate_threads(before)
        finally:
            await engine.stop()
        return during, voxgate_threads(before)

    return asyncio.run(asyncio.wait_for(scenario(), 120))


def test_after_stop_no_piper_engine_thread_is_alive() -> None:
    backend = create_backend("piper", num_threads=1, num_parallel_calls=2)
    during, after = speak_then_stop(backend, "joe")
    assert {"voxgate-engine_0", "voxgate-engine-loop"} <= set(during)
    assert any(name.startswith("voxgate-lane") for name in during)
    assert after == []


def test_after_stop_no_cosyvoice_engine_thread_is_alive(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    import torch

    from tests.support.cosyvoice_steps import make_backend

    threads = torch.get_num_threads()  # the tiny model loads with one: put back after
    try:
        backend = make_backend(tmp_path_factory.getbasetemp(), load=False, flow_thread="on")
        during, after = speak_then_stop(backend, "default")
    finally:
        torch.set_num_threads(threads)
    assert {"voxgate-engine_0", "voxgate-engine-loop", "voxgate-cosyvoice-flow"} <= set(during)
    assert any(name.startswith("voxgate-cosyvoice-cpu") for name in during)
    assert after == []
