"""The flow's K/V cache (CosyVoice 3): the cached solve against the whole-history chunk-causal
solve, shared voice prompts, memory freed and refused, and every tick a graph replay."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.backends.cosyvoice.flow_runtime.solve_graphs import ChunkSolver
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.flow import FlowModel, FlowRow, build_flow
from engine.backends.cosyvoice.models.hift import HiFT, build_hift
from engine.backends.cosyvoice.t2w.cached_flow import CachedFlow, TrimmedPrompt, trim_prompt
from engine.backends.cosyvoice.t2w.streams import FlowPrompt, T2WConfig, TokenToWave, WaveChunk
from engine.errors import EngineBusyError
from tests.support.cosyvoice_parity import (
    assert_close_report,
    fixture_dir,
    one_torch_thread,  # noqa: F401 (autouse)
)
from tests.support.cosyvoice_tiny import tiny_model_dir

WHOLE = T2WConfig(max_history_tokens=None)
MODELS = ["tiny_random", "upstream_fixture"]


@pytest.fixture(scope="module", params=MODELS)
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[FlowModel, HiFT, FlowPrompt, list[int]]]:
    """(flow, hift, a 50-token voice prompt, a 240-token answer) of the tiny random model or the
    fixture."""
    if request.param == "upstream_fixture":
        model_dir = load_model_dir(fixture_dir(3))
        ref = torch.load(model_dir.path / "reference.pt", weights_only=True)
        tokens = torch.cat([ref["prompt_speech_token"][0], ref["flow_token"][0]])  # 50
        mel = torch.cat([ref["prompt_feat"][0], ref["flow_mel"][0].T])  # 100 frames
        prompt = FlowPrompt(tokens, mel, ref["embedding"][0])
        answer = ref["lm_greedy_tokens"].tolist()
    else:
        model_dir = load_model_dir(tiny_model_dir(tmp_path_factory.getbasetemp(), 3))
        gen = torch.Generator().manual_seed(11)
        prompt = FlowPrompt(torch.randint(0, 6561, (62,), generator=gen),
                            torch.randn(124, 80, generator=gen), torch.randn(192, generator=gen))
        answer = torch.randint(0, 6561, (240,), generator=gen).tolist()
    hift = build_hift(model_dir)
    hift.cfg.noise_scale = 0.0
    yield build_flow(model_dir), hift, prompt, answer


def cached_t2w(flow: FlowModel, hift: HiFT, config: T2WConfig = WHOLE, blocks: int = 64,
               max_streams: int = 4, use_graphs: bool = False) -> TokenToWave:
    cached = CachedFlow.build(flow, blocks, config.max_history_tokens, max_streams, use_graphs)
    return TokenToWave(flow, hift, config, cached=cached)


def stream_all(t2w: TokenToWave, sid: str, tokens: list[int], step: int = 5) -> list[WaveChunk]:
    chunks: list[WaveChunk] = []
    for i in range(0, len(tokens), step):
        t2w.feed(sid, tokens[i:i + step])
        if i + step >= len(tokens):
            t2w.finish(sid)
        chunks += t2w.run(t2w.ready())
    while t2w.has_stream(sid):
        chunks += t2w.run([sid])
    return chunks


def whole_history_solve(flow: FlowModel, trim: TrimmedPrompt, answer: list[int], num_present: int,
                        end: int) -> torch.Tensor:
    """The reference: the plain estimator over prompt + every answer token so far, chunk-causal,
    the prompt's condition made from the prompt alone (as the cache shares it) -> mel of answer [0,
    end)."""
    p = len(trim.tokens)
    tokens = torch.tensor(trim.tokens + answer[:num_present])
    n = torch.tensor([tokens.shape[0]])
    with torch.inference_mode():
        mu = flow.encode(tokens[None], n, n, True)
        if p:
            alone = torch.tensor(trim.tokens)[None]
            encoded = flow.encode(alone, torch.tensor([p]), torch.tensor([p]), True)
            mu = torch.cat([encoded, mu[:, :, 2 * p:]], 2)
        frames = 2 * (p + end)
        cond = torch.zeros(1, 80, frames)
        cond[0, :, :trim.mel.shape[0]] = trim.mel.T
        spks = flow.spk_embed_affine_layer(F.normalize(trim.embedding[None], dim=1))
        mel = flow.decoder(flow.noise[None, :, :frames], torch.ones(1, 1, frames),
                           mu[:, :, :frames], spks, cond, True)
    return mel[0, :, 2 * p:]


def test_with_history_kept_whole_the_cached_solve_equals_the_whole_history_chunk_causal_solve(
        models: Any) -> None:
    flow, hift, prompt, answer = models
    t2w = cached_t2w(flow, hift)
    t2w.add_stream("a", prompt)
    chunks = stream_all(t2w, "a", answer)
    # the first hop, then its chunk whole
    assert [c.num_tokens for c in chunks] == [15, 10] + [25] * 8 + [15]
    trim, offset = trim_prompt(prompt, 30), 0
    assert len(trim.tokens) == 50  # trimmed from the front to whole chunks
    for k, chunk in enumerate(chunks):
        end = offset + chunk.num_tokens
        want = whole_history_solve(flow, trim, answer, min(len(answer), end + 3),
                                   end)[:, 2 * offset:]
        assert_close_report(f"flow_cache.chunk[{k}]", chunk.mel, want, 1e-4)
        offset = end
    solver = t2w.cached.solver if t2w.cached else None
    # 2 prompt chunks, then a solve a run
    assert solver is not None and solver.num_static == 2 + len(chunks)


def test_an_answer_ending_just_past_the_grid_takes_one_more_run_never_two_chunks_at_once(
        models: Any) -> None:
    flow, hift, prompt, answer = models
    t2w = cached_t2w(flow, hift)
    t2w.add_stream("a", prompt)
    # all at once: the last chunk could reach 52
    chunks = stream_all(t2w, "a", answer[:52], step=52)
    assert [(c.num_tokens, c.is_final) for c in chunks] == [(15, False), (10, False), (25, False),
                                                            (2, True)]
    trim, offset = trim_prompt(prompt, 30), 0
    for chunk in chunks:
        end = offset + chunk.num_tokens
        want = whole_history_solve(flow, trim, answer[:52], min(52, end + 3), end)[:, 2 * offset:]
        assert_close_report("flow_cache.end_past_grid", chunk.mel, want, 1e-4)
        offset = end


def test_a_prompt_shared_by_two_streams_gives_each_what_it_gets_alone(models: Any) -> None:
    flow, hift, prompt, answer = models
    alone = {}
    for sid, tokens in (("a", answer[:90]), ("b", answer[100:160])):
        single = cached_t2w(flow, hift)
        single.add_stream(sid, prompt)
        alone[sid] = stream_all(single, sid, tokens, step=7)
    t2w = cached_t2w(flow, hift)
    assert t2w.cached is not None
    cache = t2w.cached.cache
    free = cache.num_free_blocks
    t2w.add_stream("a", prompt)
    t2w.add_stream("b", prompt)
    # the prompt's 2 chunks, once
    assert free - cache.num_free_blocks == 2 + 2 * cache.blocks_per_stream
    got: dict[str, list[WaveChunk]] = {"a": [], "b": []}
    answers = {"a": answer[:90], "b": answer[100:160]}
    for i in range(0, 90, 7):
        for sid, tokens in answers.items():
            if i < len(tokens):
                t2w.feed(sid, tokens[i:i + 7])
                if i + 7 >= len(tokens):
                    t2w.finish(sid)
        while ready := t2w.ready():
            for chunk in t2w.run(ready):
                got[chunk.stream_id].append(chunk)
    assert cache.num_streams == 0
    for sid in ("a", "b"):
        assert [c.num_tokens for c in got[sid]] == [c.num_tokens for c in alone[sid]]
        for k, (g, w) in enumerate(zip(got[sid], alone[sid], strict=True)):
            assert_close_report(f"flow_cache.shared[{sid}][{k}].mel", g.mel, w.mel, 1e-5)
            assert_close_report(f"flow_cache.shared[{sid}][{k}].audio", g.audio, w.audio, 1e-5)


def test_drop_frees_the_streams_cache_at_once_or_when_its_chunk_in_flight_is_done(
        models: Any) -> None:
    flow, hift, prompt, answer = models
    t2w = cached_t2w(flow, hift, T2WConfig(max_history_tokens=50))
    assert t2w.cached is not None
    cache = t2w.cached.cache
    t2w.add_stream("voice", prompt)  # makes the voice resident
    t2w.drop("voice")
    before = (cache.num_free_blocks, cache.num_free_slots)
    t2w.add_stream("a", prompt)
    # 50 tokens of history: a ring of 2 chunks, and the chunk in progress
    assert cache.blocks_per_stream == 3
    assert (cache.num_free_blocks, cache.num_free_slots) == (before[0] - 3, before[1] - 1)
    t2w.feed("a", answer[:80])
    for _ in range(3):
        t2w.run(t2w.ready())
    t2w.drop("a")
    assert (cache.num_free_blocks, cache.num_free_slots) == before and not cache.has_stream("a")
    t2w.add_stream("b", prompt)
    t2w.feed("b", answer[:20])
    plans = t2w.plan(t2w.ready())  # as the flow's thread does: "b" is now in flight
    t2w.drop("b")
    assert cache.num_free_blocks == before[0] - 3  # not under the chunk being computed
    assert t2w.commit(plans, t2w.compute(plans)) == []  # dropped: its chunk is thrown away
    cache.end([p.stream_id for p in plans])
    assert (cache.num_free_blocks, cache.num_free_slots) == before


def test_a_stream_the_cache_cannot_hold_is_refused_as_busy(models: Any) -> None:
    flow, hift, prompt, _ = models
    config = T2WConfig(max_history_tokens=25)  # 2 blocks a stream
    t2w = cached_t2w(flow, hift, config, blocks=9)
    assert t2w.cached is not None
    cache = t2w.cached.cache
    assert cache.num_blocks == 9  # the scratch block, 2 for the prompt, 3 streams of 2
    assert t2w.num_can_add([prompt]) == 1
    for sid in ("a", "b", "c"):
        t2w.add_stream(sid, prompt)
    assert cache.stream_capacity() == 3 and t2w.num_can_add([prompt]) == 0
    with pytest.raises(EngineBusyError, match="the flow cache is full"):
        t2w.add_stream("d", prompt)
    assert not t2w.has_stream("d") and cache.num_streams == 3
    other = FlowPrompt(prompt.tokens[:25], prompt.mel[:50], prompt.embedding)
    t2w.drop("c")
    # a new voice needs its prompt's chunk too
    assert t2w.num_can_add([prompt]) == 1 and t2w.num_can_add([other]) == 0
    t2w.drop("b")
    assert t2w.num_can_add([other]) == 1
    t2w.add_stream("e", other)


def test_an_idle_voice_stays_until_its_memory_is_needed_and_goes_with_the_voice(
        models: Any) -> None:
    flow, hift, prompt, _ = models
    t2w = cached_t2w(flow, hift, T2WConfig(max_history_tokens=25), blocks=7)
    assert t2w.cached is not None
    cache, solver = t2w.cached.cache, t2w.cached.solver
    t2w.add_stream("a", prompt)
    t2w.drop("a")
    assert cache.has_voice(prompt) and cache.num_free_blocks == 4  # 6 usable - the prompt's 2
    solves = solver.num_solves
    t2w.add_stream("b", prompt)  # found, not computed again
    assert solver.num_solves == solves
    t2w.drop("b")
    other = FlowPrompt(prompt.tokens[:50], prompt.mel[:100] * 0.5, prompt.embedding)
    t2w.add_stream("c", other)  # its 2 chunks and 2 blocks fit beside the idle voice
    assert cache.has_voice(prompt) and cache.num_free_blocks == 0
    t2w.add_stream("d", other)  # 2 more: the idle voice makes room
    assert not cache.has_voice(prompt) and cache.has_voice(other)
    for sid in ("c", "d"):
        t2w.drop(sid)
    t2w.forget_voice(other)
    assert not cache.has_voice(other) and cache.num_free_blocks == 6


def test_a_prompt_shorter_than_a_chunk_keeps_none_and_speaks_from_the_x_vector(models: Any) -> None:
    flow, hift, prompt, answer = models
    short = FlowPrompt(prompt.tokens[:20], prompt.mel[:40], prompt.embedding)
    t2w = cached_t2w(flow, hift)
    t2w.add_stream("a", short)
    chunks = stream_all(t2w, "a", answer[:60])
    trim = trim_prompt(short, 30)
    assert trim.tokens == [] and trim.mel.shape == (0, 80)
    offset = 0
    for chunk in chunks:
        end = offset + chunk.num_tokens
        want = whole_history_solve(flow, trim, answer[:60], min(60, end + 3), end)[:, 2 * offset:]
        assert_close_report("flow_cache.no_prompt", chunk.mel, want, 1e-4)
        offset = end


def test_a_bounded_history_ring_departs_only_after_its_first_cut_and_little(models: Any) -> None:
    """25 tokens of history: a chunk sees the prompt, the one chunk before it and itself."""
    flow, hift, prompt, answer = models
    runs = {}
    for history in (None, 25):
        t2w = cached_t2w(flow, hift, T2WConfig(max_history_tokens=history))
        t2w.add_stream("a", prompt)
        runs[history] = torch.cat([c.mel for c in stream_all(t2w, "a", answer)], dim=1)
    whole, ring = runs[None], runs[25]
    # chunks 0 and 1 (tokens 0-50) see every chunk before them either way
    assert_close_report("flow_cache.ring_before_cut", ring[:, :100], whole[:, :100], 1e-5)
    rel = float((ring - whole).pow(2).mean().sqrt() / whole.std())
    assert 0 < rel < 0.25, f"relative rms departure {rel:.3%}"


def test_sharing_the_prompt_departs_from_upstreams_whole_sequence_condition_only_slightly(
        models: Any) -> None:
    """The prompt's last 3 tokens see zeros, not the answer's first 3 (the cost of sharing it)."""
    flow, hift, prompt, answer = models
    t2w = cached_t2w(flow, hift)
    t2w.add_stream("a", prompt)
    mel = torch.cat([c.mel for c in stream_all(t2w, "a", answer[:100])], dim=1)
    trim = trim_prompt(prompt, 30)
    tokens = torch.tensor(trim.tokens + answer[:100])
    row = FlowRow(tokens, trim.mel, trim.embedding, 0, torch.arange(2 * tokens.shape[0]))
    upstream = flow.infer([row], streaming=True)[0][:, 2 * len(trim.tokens):]
    rel = float((mel[:, 50:] - upstream[:, 50:]).pow(2).mean().sqrt() / upstream.std())
    assert rel < 0.05, f"relative rms departure {rel:.3%} from the whole-sequence condition"


def test_the_cache_is_cosyvoice_3s_only(tmp_path_factory: pytest.TempPathFactory) -> None:
    flow = build_flow(load_model_dir(fixture_dir(2)))
    with pytest.raises(TypeError, match="CosyVoice 3's DiT"):
        ChunkSolver(flow, None, 4, False)  # type: ignore[arg-type]


def test_the_first_hop_must_fit_one_chunk_with_the_cache(models: Any) -> None:
    flow, hift, _, _ = models
    with pytest.raises(ValueError, match="first_hop_tokens <= 25"):
        cached_t2w(flow, hift, T2WConfig(first_hop_tokens=30))


# stand-in for torch.cuda.CUDAGraph (no CUDA here): replays the recorded body eagerly
class _RecordedGraph:
    def __init__(self, solver: ChunkSolver, bucket: tuple[int, int]) -> None:
        self.solver, self.bucket = solver, bucket

    def replay(self) -> None:
        self.solver._body(*self.bucket)


def recording_captures(solver: ChunkSolver) -> list[tuple[int, int]]:
    """Graph mode on; each capture records its bucket and a stand-in graph that runs the static
    body."""
    captured: list[tuple[int, int]] = []

    def capture(bucket: tuple[int, int]) -> None:
        captured.append(bucket)
        solver.graphs[bucket] = _RecordedGraph(solver, bucket)

    solver.use_graphs = True
    solver.capture = capture  # type: ignore[method-assign]
    return captured


def test_every_tick_of_a_steady_run_is_a_graph_replay_and_none_runs_eager(models: Any) -> None:
    flow, hift, prompt, answer = models
    static = cached_t2w(flow, hift, T2WConfig(max_history_tokens=50))
    graphed = cached_t2w(flow, hift, T2WConfig(max_history_tokens=50))
    assert graphed.cached is not None
    solver = graphed.cached.solver
    captured = recording_captures(solver)
    assert solver.stream_buckets == [1, 2, 4]
    assert solver.block_buckets == [4, 8, 12, 16, 20, 24, 28, 32, 33]
    assert solver.capture_all() == 3 * 9 and len(captured) == 27  # at load, every bucket
    voices = [prompt, FlowPrompt(prompt.tokens[:30], prompt.mel[:60] * 0.7, prompt.embedding * 0.5)]
    out: dict[str, list[torch.Tensor]] = {}
    for t2w in (static, graphed):
        for i in range(3):  # 3 streams: a bucket of 4 with a padding row
            t2w.add_stream(f"s{i}", voices[i % 2])
        for i in range(0, 120, 6):
            for k in range(3):
                t2w.feed(f"s{k}", answer[40 * k + i:40 * k + i + 6])
            if i + 6 >= 120:
                for k in range(3):
                    t2w.finish(f"s{k}")
            for chunk in t2w.run(t2w.ready()):
                out.setdefault(f"{id(t2w)}:{chunk.stream_id}", []).append(chunk.mel)
    assert len(captured) == 27  # nothing captured while serving
    # 3 prompt chunks (2 + 1), then 6 runs of 3 streams (15, 10, 25, 25, 25, 20 tokens): all replays
    assert solver.num_eager == 0 and solver.num_static == 0
    assert solver.num_replays == solver.num_solves == 9
    for k in range(3):
        got = torch.cat(out[f"{id(graphed)}:s{k}"], dim=1)
        want = torch.cat(out[f"{id(static)}:s{k}"], dim=1)
        assert got.shape == (80, 240)
        assert_close_report(f"flow_cache.graphed[s{k}]", got, want, 1e-6)
