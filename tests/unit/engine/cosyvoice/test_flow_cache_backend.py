"""The flow's K/V cache through the cosyvoice backend: what admission reads (`context_capacity`,
`flow_cache_info`), a full cache makes a stream wait, said so, rather than run out of memory, and a
removed voice frees its prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.backends.cosyvoice.backend import CosyVoiceBackend
from engine.backends.cosyvoice.sequences import SeqState
from engine.backends.cosyvoice.t2w.cached_flow import CachedFlow
from engine.engine import Engine, EngineConfig
from engine.errors import EngineBusyError
from engine.scheduler import SchedulerConfig
from engine.types import RequestId, SynthesisRequest
from tests.support.cosyvoice_parity import one_torch_thread  # noqa: F401 (autouse)
from tests.support.cosyvoice_steps import Requests, make_backend, run
from tests.support.cosyvoice_tiny import REFERENCE_TEXT

prepare = Requests("fc")


def cached_of(backend: CosyVoiceBackend) -> CachedFlow:
    assert backend.model is not None and backend.model.t2w.cached is not None
    return backend.model.t2w.cached


def room_for_two_streams(base: Path, load: bool = True) -> tuple[CosyVoiceBackend, int]:
    """A backend whose flow cache holds two streams of the default voice and no more, and the blocks
    that takes: two streams, the default voice's prompt, the scratch block (loaded unless `load` is
    False)."""
    probe = cached_of(make_backend(base)).cache
    shape, per_stream = probe.shape, probe.blocks_per_stream
    prompt_blocks = len(probe._voices[next(iter(probe._voices))].blocks)
    blocks = 2 * per_stream + prompt_blocks + 1
    per_block = shape.bytes_per_block + shape.bytes_per_slot / per_stream + shape.bytes_per_slot
    gib = (blocks * per_block + 2 * shape.bytes_per_slot + 1) / 2 ** 30
    return make_backend(base, load=load, flow_cache_gib=str(gib)), blocks


def test_a_cosyvoice_3_backend_runs_its_flow_over_the_cache_and_says_how_much_it_holds(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    backend = make_backend(tmp_path_factory.getbasetemp())
    cached = cached_of(backend)
    info = backend.flow_cache_info()
    assert info["gib_per_stream"] > 0 and info["stream_capacity"] >= 16 and info["num_streams"] == 0
    voice = backend.model.default_voice.flow if backend.model else None
    assert cached.cache.has_voice(voice)  # the default voice's prompt was computed at load
    before = cached.solver.num_solves
    item = prepare(backend, "Hello world.")
    tokens, pcm = run(backend, [item])[item.request_id]
    assert len(pcm) == len(tokens) * 960 and cached.solver.num_solves > before
    assert cached.cache.num_streams == backend.table.num_flows == len(backend.table) == 0
    assert backend.context_capacity() == min(backend.resolved.num_streams, info["stream_capacity"])


def test_a_stream_the_cache_cannot_hold_waits_says_why_and_starts_once_one_ends(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    backend, blocks = room_for_two_streams(tmp_path_factory.getbasetemp())
    cache = cached_of(backend).cache
    assert cache.num_blocks == blocks and backend.context_capacity() == 2
    items = [prepare(backend, "Hello there, how are you today?", due=float(n)) for n in range(3)]
    results = backend.step(items)
    assert cache.num_streams == 2 and backend.table.num_flows == 2  # no out-of-memory
    # the one due last waits, and says so
    assert [r.waiting for r in results] == [None, None, "flow_cache"]
    third = items[2].state
    assert third is not None and third.state is SeqState.WAITING and not results[2].is_finished
    backend.release(items[0])  # a cancel frees its cache
    assert cache.num_streams == 1 and backend.table.num_flows == 1
    assert [r.waiting for r in backend.step(items[1:])] == [None, None]  # it starts now
    spoken = run(backend, items[1:])
    assert all(len(tokens) > 0 for tokens, _ in spoken.values())
    assert cache.num_streams == 0 and len(backend.table) == 0


def test_a_removed_voice_frees_its_cached_prompt(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.support.cosyvoice_tiny import voiced

    backend = make_backend(tmp_path_factory.getbasetemp())
    cache = cached_of(backend).cache
    features = backend.make_voice_features(voiced(2.0, 16000), 16000, REFERENCE_TEXT)
    backend.add_voice("mine", features, {})
    free = cache.num_free_blocks
    item = backend.prepare(SynthesisRequest(RequestId("fc-voice"), "Hello world.", "mine"))
    run(backend, [item])
    voice = backend.get_voice("mine").flow
    assert cache.has_voice(voice) and cache.num_free_blocks < free  # computed at its first stream
    backend.remove_voice("mine")
    assert not cache.has_voice(voice) and cache.num_free_blocks == free


def test_the_engine_refuses_a_context_the_flow_cache_cannot_hold_as_busy(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    backend, _ = room_for_two_streams(tmp_path_factory.getbasetemp())
    # asked for more than the memory holds: the memory's figure wins
    engine = Engine(backend, EngineConfig(scheduler=SchedulerConfig(max_contexts=64)))
    assert backend.context_capacity() == 2 and engine.scheduler.max_contexts() == 2
    engine.admit("s/a")
    engine.admit("s/b")
    with pytest.raises(EngineBusyError) as refused:
        engine.admit("s/c")
    assert refused.value.code == "busy"
    engine.release_context("s/a")  # a context that ends gives its place back
    engine.admit("s/c")
