"""`Engine.stop` ends every thread the engine started, and every one its backend started
(`Backend.close`): no thread named voxgate-* is alive after it, for piper and for cosyvoice (a tiny
random model with its flow thread on, as on a GPU)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from engine.backend import Backend
from engine.backends import create_backend
from engine.engine import Engine, EngineConfig
from engine.types import AudioChunk, RequestId, SynthesisRequest


def voxgate_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("voxgate-") and t.is_alive())


async def collect(stream: AsyncIterator[AudioChunk]) -> list[AudioChunk]:
    return [chunk async for chunk in stream]


def speak_then_stop(backend: Backend, voice: str) -> tuple[list[str], list[str]]:
    """Threads named voxgate-* while the engine speaks, and after it stopped."""
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
            during = voxgate_threads()
        finally:
            await engine.stop()
        return during, voxgate_threads()

    return asyncio.run(asyncio.wait_for(scenario(), 120))


def test_after_stop_no_piper_engine_thread_is_alive() -> None:
    assert voxgate_threads() == []
    backend = create_backend("piper", num_threads=1, num_parallel_calls=2)
    during, after = speak_then_stop(backend, "joe")
    assert "voxgate-engine_0" in during and any(name.startswith("voxgate-lane") for name in during)
    assert after == []


def test_after_stop_no_cosyvoice_engine_thread_is_alive(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    import torch

    from tests.support.cosyvoice_steps import make_backend

    assert voxgate_threads() == []
    threads = torch.get_num_threads()  # the tiny model loads with one: put back after
    try:
        backend = make_backend(tmp_path_factory.getbasetemp(), load=False, flow_thread="on")
        during, after = speak_then_stop(backend, "default")
    finally:
        torch.set_num_threads(threads)
    assert {"voxgate-engine_0", "voxgate-cosyvoice-flow"} <= set(during)
    assert any(name.startswith("voxgate-cosyvoice-cpu") for name in during)
    assert after == []
