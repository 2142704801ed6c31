"""The flow's tick over the K/V cache against the recompute path, per stream count, and the
attention layouts.

Random weights at the real CosyVoice 3 flow size (DiT 22 x 1024, 16 heads of 64,
ff x2; pre-lookahead 1024), `--dtype` bf16 by default. Every stream speaks with
one voice of `--prompt-tokens` (75: a 3 s reference, 3 chunks) and has
`--history-tokens` (100) of history. Per stream count N:

- recompute: what the flow did before the cache, one `FlowModel.infer` of N rows
  of prompt + history + a 25-token chunk + 3 lookahead (2N CFG rows x ~400
  frames, ten Euler steps), the estimator through its CUDA graphs where a
  bucket is under `--max-graph-row-frames` (the loader's default), else eager;
- cached: one `ChunkSolver.solve` of N chunks of 50 frames over the cache (each
  stream's ring full), the whole solve replayed as one CUDA graph (captured first);
- per tick: ms, and audio seconds per wall second (a tick makes 1 s per stream).

The cached ticks run first, then the vocoder, then the recompute path (up to
`--max-recompute-streams`: at 256 streams one such call takes seconds), so a
budget that runs out loses the figures of the path before the cache first.

Then the attention of one layer and step over the cache, two layouts at the
same shapes: `paged` (this build: one pool, the voice's prompt blocks shared,
each row's blocks gathered, then SDPA with a key mask) and `contiguous` (a
fixed buffer per stream holding its own copy of the prompt, SDPA reads it as
is), with what each holds per stream. Memory: the cache's bytes per frame,
GiB per stream, and the streams an H200's memory left after the models holds.
Last, CosyVoice 3's vocoder at a stream's steady shape (82 mel frames, 29 of
them with known f0), eager against its CUDA graphs (t2w/vocoder_graphs.py),
which also proves on the device that its graphs capture.

One device call (its --budget-s ends it cleanly; results rewritten after each case):

    python -m bench.gpu_flow_cache --json /tmp/flow_cache.json

CPU smoke run (tiny DiT, static path; tests/unit/bench/test_gpu_scripts.py runs it):

    python -m bench.gpu_flow_cache --smoke
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.gpu_common import DTYPES, Results, device_name, median_ms
from engine.backends.cosyvoice.buckets import bucket_of
from engine.backends.cosyvoice.flow_runtime.estimator_graphs import GraphedEstimator
from engine.backends.cosyvoice.flow_runtime.estimator_onnx import use_estimator
from engine.backends.cosyvoice.flow_runtime.solve_graphs import ChunkRow
from engine.backends.cosyvoice.models.flow import FlowModel, FlowRow
from engine.backends.cosyvoice.models.hift import HiFT, HiFTConfig
from engine.backends.cosyvoice.t2w.cached_flow import CachedFlow, history_chunks, window
from engine.backends.cosyvoice.t2w.streams import FlowPrompt
from engine.backends.cosyvoice.t2w.vocoder import v3_step
from engine.backends.cosyvoice.t2w.vocoder_graphs import VocoderGraphs, steady_shapes

REAL = {"dim": 1024, "depth": 22, "heads": 16, "dim_head": 64, "pre": 1024, "hift": 512}
TINY = {"dim": 64, "depth": 2, "heads": 4, "dim_head": 16, "pre": 64, "hift": 32}
# an H200's memory; what the models, graphs and activations take beside
H200_GIB, MODELS_GIB = 139.0, 10.0


def random_flow(size: dict[str, int], device: torch.device, dtype: torch.dtype) -> FlowModel:
    """A CosyVoice 3 FlowModel with random weights at `size`, made on `device` (no checkpoint)."""
    section = {"output_size": 80, "token_mel_ratio": 2, "pre_lookahead_len": 3, "vocab_size": 6561,
               "input_size": 80, "spk_embed_dim": 192,
               "pre_lookahead_layer": {"in_channels": 80, "channels": size["pre"],
                                       "pre_lookahead_len": 3},
               "decoder": {"cfm_params": {"inference_cfg_rate": 0.7, "t_scheduler": "cosine",
                                          "solver": "euler"},
                           "estimator": {"dim": size["dim"], "depth": size["depth"],
                                         "heads": size["heads"],
                                         "dim_head": size["dim_head"], "ff_mult": 2, "mel_dim": 80,
                                         "mu_dim": 80, "spk_dim": 80, "static_chunk_size": 50}}}
    torch.manual_seed(0)
    with torch.device(device):
        flow = FlowModel(3, section)
    return flow.to(device, dtype).eval()


def recompute_ms(flow: FlowModel, n: int, args: argparse.Namespace, device: torch.device) -> float:
    """One flow call as before the cache: N rows of prompt + history + chunk + lookahead,
    recomputed."""
    tokens = args.prompt_tokens + args.history_tokens + 25 + 3
    gen = torch.Generator().manual_seed(n)
    prompt = FlowPrompt(torch.randint(0, 6561, (args.prompt_tokens,), generator=gen),
                        torch.randn(2 * args.prompt_tokens, 80, generator=gen).to(device),
                        torch.randn(192, generator=gen).to(device))
    rows = [FlowRow(torch.randint(0, 6561, (tokens,), generator=gen), prompt.mel, prompt.embedding,
                    3, torch.arange(2 * (tokens - 3))) for _ in range(n)]
    frames = -(-2 * tokens // 64) * 64
    graphed = GraphedEstimator(flow.decoder.estimator, 2 * n, frames,
                               use_graphs=device.type == "cuda",
                               max_graph_row_frames=args.max_graph_row_frames)
    bucket = graphed.bucket_for(2 * n, 2 * (tokens - 3), True)
    if graphed.use_graphs and bucket is not None and graphed.has_graph_size(bucket):
        graphed.capture(bucket, torch.zeros(1, dtype=flow.spk_embed_affine_layer.weight.dtype,
                                            device=device))
    dit = use_estimator(flow, graphed)
    try:
        return median_ms(lambda: flow.infer(rows, streaming=True), device, args.steps, args.warmup)
    finally:
        use_estimator(flow, dit)


def cached_rows(cached: CachedFlow, prompt: FlowPrompt, n: int, tag: str) -> list[ChunkRow]:
    """N streams of one voice, each with a full ring of history (its contents do not change the
    time)."""
    cache = cached.cache
    trim = cached.trim(prompt)
    rows = []
    for i in range(n):
        sid = f"{tag}-{i}"
        cache.add_stream(sid, prompt)
        for _ in range(cache.max_history_chunks):
            cache.complete_chunk(sid)
        start = len(trim.tokens) + 25 * (cache.max_history_chunks + 1)
        tokens = list(range(start + 28))
        ids, first, end = window(tokens, start, start + 28)
        place = cache.place(sid, is_complete=True)
        rows.append(ChunkRow(ids, first, end, 2 * start, 50, place, trim.embedding))
    return rows


def attention_ms(cached: CachedFlow, rows: list[ChunkRow], prompt_blocks: int, device: torch.device,
                 args: argparse.Namespace) -> dict[str, float]:
    """One layer and step of attention over the cache: the pool gathered, or a per-stream copy."""
    cache, n = cached.cache, len(rows)
    shape = cache.shape
    heads, dim_head, frames = shape.heads, shape.dim_head, shape.chunk_frames
    blocks = [[*r.place.table, r.place.write_block] for r in rows]
    nb = max(len(b) for b in blocks)
    table = torch.tensor([b + [0] * (nb - len(b)) for b in blocks], device=device)
    table = torch.cat([table, table + cache.num_blocks])  # [2N, nb]: both CFG rows
    q = torch.randn(2 * n, heads, frames, dim_head, device=device, dtype=shape.dtype)
    mask = torch.ones(2 * n, 1, 1, nb * frames, dtype=torch.bool, device=device)
    pool_k, pool_v = cache.k[0, 0], cache.v[0, 0]

    def paged() -> torch.Tensor:
        flat = table.reshape(-1)
        k = pool_k.index_select(1, flat).view(heads, 2 * n, -1, dim_head).transpose(0, 1)
        v = pool_v.index_select(1, flat).view(heads, 2 * n, -1, dim_head).transpose(0, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    own_k = torch.randn(2 * n, heads, nb * frames, dim_head, device=device, dtype=shape.dtype)
    own_v = torch.randn_like(own_k)

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, own_k, own_v, attn_mask=mask)

    with torch.inference_mode():
        out = {"paged_ms": median_ms(paged, device, args.steps, args.warmup),
               "contiguous_ms": median_ms(contiguous, device, args.steps, args.warmup)}
    per_block = shape.bytes_per_block / 2 ** 30
    out["paged_gib_per_stream"] = (nb - prompt_blocks) * per_block
    out["contiguous_gib_per_stream"] = nb * per_block
    out["passes_per_tick"] = shape.steps * shape.layers
    return out


def cached_ticks(flow: FlowModel, streams: list[int], args: argparse.Namespace,
                 device: torch.device,
                 result: dict[str, Any], part: Callable[[str, Callable[[], Any]], Any]) -> None:
    """The cached tick at each stream count, and the attention layouts; rows into `result`."""
    ring = history_chunks(args.history_tokens) or 0
    prompt_blocks = args.prompt_tokens // 25
    blocks = max(streams) * (ring + 1) + prompt_blocks + 1
    cached = CachedFlow.build(flow, blocks, args.history_tokens, max(streams),
                              use_graphs=device.type == "cuda")
    result["memory"] = cached.cache.info() | {"blocks": blocks}
    gen = torch.Generator().manual_seed(0)
    prompt = FlowPrompt(torch.randint(0, 6561, (args.prompt_tokens,), generator=gen),
                        torch.randn(2 * args.prompt_tokens, 80, generator=gen).to(device),
                        torch.randn(192, generator=gen).to(device))
    part("voice prompt", partial(cached.ensure_voice, prompt))

    def tick(n: int) -> dict[str, Any]:
        rows = cached_rows(cached, prompt, n, f"s{n}")
        solver = cached.solver
        try:
            if solver.use_graphs:
                solver.capture(solver.bucket_for(rows))
            ms = median_ms(partial(solver.solve, rows), device, args.steps, args.warmup)
            return {"ms": ms, "attention": attention_ms(cached, rows, prompt_blocks, device, args)}
        finally:
            for i in range(n):
                cached.cache.release_stream(f"s{n}-{i}")

    for n in streams:
        out = part(f"cached {n}", partial(tick, n))
        row: dict[str, Any] = {"streams": n, "cached_ms": None, "recompute_ms": None}
        if out is not None:
            row["cached_ms"] = out["ms"]
            result["attention"].append({"streams": n, **out["attention"]})
        result["rows"].append(row)


def vocoder_ms(size: dict[str, int], streams: list[int], device: torch.device,
               args: argparse.Namespace
               ) -> dict[str, Any]:
    """HiFT (v3, random weights at `size`) at its steady shape: eager v3_step against the graphs."""
    hift = HiFT(HiFTConfig(causal=True, base_channels=size["hift"],
                           f0_cond_channels=size["hift"])).to(device)
    hift.fuse_weight_norm()
    hift.eval()
    shapes = steady_shapes(15, 24)
    frames, known = shapes[-1]
    graphs = VocoderGraphs(hift, max(streams), shapes, use_graphs=device.type == "cuda")
    out: dict[str, Any] = {"graphs": 0, "rows": []}
    for n in streams:
        if graphs.use_graphs:  # the buckets measured only (the loader captures every one)
            graphs.capture(bucket_of(n, graphs.rows), (frames, known))
            out["graphs"] = len(graphs.graphs)
        gen = torch.Generator().manual_seed(n)
        mel = torch.randn(n, 80, frames, generator=gen).to(device) - 4.0
        kept = (100 + 100 * torch.rand(n, known, generator=gen)).to(device)
        phase0 = torch.zeros(n, hift.m_source.dim, dtype=torch.float64, device=device)
        starts = torch.arange(n, device=device) * 480 * 50
        with torch.inference_mode():
            inputs = (mel, kept, phase0, starts, False)
            eager = median_ms(partial(v3_step, hift, *inputs), device, args.steps, args.warmup)
            graphed = median_ms(partial(graphs.step, hift, *inputs), device, args.steps,
                                args.warmup)
        out["rows"].append({"streams": n, "eager_ms": eager, "graphs_ms": graphed})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny DiT on the CPU (CI)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--streams", default="1,8,32,64,128,256")
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--history-tokens", type=int, default=100)
    parser.add_argument("--max-graph-row-frames", type=int, default=8192,
                        help="the recompute path's graphs")
    parser.add_argument("--max-recompute-streams", type=int, default=128,
                        help="the recompute path only up to this many streams (256: ~5 s a call on "
                             "an H200)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        size, device, dtype = TINY, torch.device(args.device or "cpu"), torch.float32
        args.streams, args.steps, args.warmup = "1,2", 2, 1
        torch.set_num_threads(1)
    else:
        size, device, dtype = REAL, torch.device(args.device or "cuda"), DTYPES[args.dtype]
    streams = [int(n) for n in args.streams.split(",")]
    flow = random_flow(size, device, dtype)
    result: dict[str, Any] = {"device": device_name(device), "dtype": str(dtype), "size": size,
                              "prompt_tokens": args.prompt_tokens,
                              "history_tokens": args.history_tokens,
                              "rows": [], "attention": [], "errors": []}
    results = Results(result, args.json, args.budget_s, started)
    part = results.part

    # what this build runs first (the budget may end the run): the cache is freed before the rest
    cached_ticks(flow, streams, args, device, result, part)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["vocoder"] = part("vocoder", partial(vocoder_ms, size, streams, device, args))
    for row in result["rows"]:  # the path before the cache, largest last (its slowest call)
        if row["streams"] <= args.max_recompute_streams:
            row["recompute_ms"] = part(f"recompute {row['streams']}",
                                       partial(recompute_ms, flow, row["streams"], args, device))
    for row in result["rows"]:
        for key in ("recompute", "cached"):
            ms = row[f"{key}_ms"]
            row[f"{key}_audio_s_per_s"] = row["streams"] * 1000.0 / ms if ms else None
    results.save()
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    mem = result.get("memory", {})
    print(f"CosyVoice 3 flow {result['size']['depth']} x {result['size']['dim']}, random weights, "
          f"{result['dtype']}, {result['device']}; prompt {result['prompt_tokens']} tokens, "
          f"history {result['history_tokens']}")
    if mem:
        print(f"cache: {mem['mib_per_frame']:.2f} MiB a frame, {mem['gib_per_stream']:.3f} GiB a "
              f"stream; an H200 ({H200_GIB:.0f} GiB) less {MODELS_GIB:.0f} GiB holds about "
              f"{int((H200_GIB - MODELS_GIB) / mem['gib_per_stream'])} streams of one voice")
    print("| streams | recompute ms/tick | cached ms/tick | recompute audio-s/s | cached audio-s/s "
          "|")
    print("|---:|---:|---:|---:|---:|")

    def cell(v: float | None, fmt: str) -> str:
        return format(v, fmt) if v else "-"

    for r in result["rows"]:
        print(f"| {r['streams']} | {cell(r['recompute_ms'], '.1f')} | "
              f"{cell(r.get('cached_ms'), '.1f')} | {cell(r['recompute_audio_s_per_s'], '.0f')} | "
              f"{cell(r['cached_audio_s_per_s'], '.0f')} |")
    print("attention, one layer and step (a tick has steps x layers of them):")
    print("| streams | paged ms | contiguous ms | paged GiB/stream | contiguous GiB/stream |")
    print("|---:|---:|---:|---:|---:|")
    for a in result["attention"]:
        print(f"| {a['streams']} | {a['paged_ms']:.3f} | {a['contiguous_ms']:.3f} | "
              f"{a['paged_gib_per_stream']:.3f} | {a['contiguous_gib_per_stream']:.3f} |")
    vocoder = result.get("vocoder") or {"rows": []}
    if vocoder["rows"]:
        print(f"vocoder at its steady shape (82 frames), {vocoder['graphs']} graphs captured:")
        print("| streams | eager ms | graphs ms |\n|---:|---:|---:|")
    for v in vocoder["rows"]:
        print(f"| {v['streams']} | {v['eager_ms']:.2f} | {v['graphs_ms']:.2f} |")
    for error in result["errors"]:
        print(f"FAILED {error}")


if __name__ == "__main__":
    main()
