"""Static-shape decode steps for the speech LM, captured as CUDA graphs per batch-size bucket.

At real sizes a decode step is launch-bound (24 layers of small kernels:
DESIGN.md's anchor, 5.7-12 ms eager against 1.3-4.7 ms with graphs), so the
GPU path replays one captured graph per (batch bucket, KV-length bucket)
instead (gpt-fast / nano-vllm style), every bucket captured at load (`capture_all`). A graph needs fixed shapes and
addresses, which the dynamic path (runner.py) does not have: it reads exactly
the batch's cache rows and `max(position) + 1` keys. Here instead:

- the step runs cache rows [0, b) for the smallest bucket b above the
  highest slot of the batch (slots are handed out lowest-first, so active
  streams sit at the bottom): attention reads a view of the cache, never a
  gather. Rows that are not in the batch compute a throwaway output and write
  a throwaway key and value at position `max_len - 1`; that is harmless because
  every forward writes its own position before it reads it, so a stale entry
  is always overwritten before any query can see it;
- keys are read up to a multiple of `kv_bucket` (the mask hides the rest);
- inputs are copied into static buffers; the graph writes log-probs into a
  static output buffer.

`mode="static"` runs the same function eagerly (any device): CPU tests prove it
computes what the dynamic path does, and the GPU path differs only by capture.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.backends.cosyvoice.buckets import bucket_of, row_buckets
from engine.backends.cosyvoice.models.qwen2 import CacheView, SlotKVCache


class DecodesSpeech(Protocol):
    """What a decode step calls on the speech LM (models/speech_lm.SpeechLM)."""

    def token_embeds(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def forward_hidden(self, embeds: torch.Tensor, view: CacheView) -> torch.Tensor: ...

    def head_logp(self, hidden: torch.Tensor) -> torch.Tensor: ...

DECODE_MODES = ("dynamic", "static", "cuda_graphs")


class StaticDecoder:
    """One decode step for any subset of slots, with shapes drawn from a few buckets."""

    def __init__(self, lm: DecodesSpeech, cache: SlotKVCache, num_rows: int, use_graphs: bool,
                 kv_bucket: int = 256) -> None:
        """`lm` decodes into `cache` (whose dtype its weights share); `num_rows` log-probs per token."""
        k0, _ = cache.layer(0)
        self.lm, self.cache = lm, cache
        self.device, self.dtype, self.max_len = k0.device, k0.dtype, cache.max_len
        if use_graphs and self.device.type != "cuda":
            raise ValueError(f"expected a CUDA device for CUDA graphs, got {self.device}")
        if kv_bucket < 1:
            raise ValueError(f"expected kv_bucket >= 1, got {kv_bucket}")
        self.use_graphs = use_graphs
        max_b, max_len, dev = cache.max_batch, cache.max_len, self.device
        self.batch_buckets = row_buckets(max_b)  # 1, 2, 4, ... 64, then multiples of 32
        self.kv_buckets = [k for k in range(kv_bucket, max_len, kv_bucket)] + [max_len]
        self.tokens = torch.zeros(max_b, dtype=torch.long, device=dev)  # [S]
        self.positions = torch.full((max_b, 1), max_len - 1, dtype=torch.long, device=dev)  # [S, 1]
        self.rows = torch.arange(max_b, device=dev)  # [S]
        self.out = torch.zeros(max_b, num_rows, device=dev)  # [S, V] float32
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the graphs' shared memory pool
        self.num_eager = 0  # graph-mode steps of a bucket not captured (none after capture_all)

    def _body(self, b: int, kv: int) -> None:
        """Rows [0, b): embed the static tokens, one forward, log-probs into `out`."""
        lm = self.lm
        embeds = lm.token_embeds(self.tokens[:b]).to(self.dtype)  # [b, 1, D]
        view = CacheView(self.cache, self.rows[:b], self.positions[:b], kv_len=kv,
                         row_range=(0, b))
        hidden = lm.forward_hidden(embeds, view)  # [b, 1, D]
        self.out[:b] = lm.head_logp(hidden[:, -1])

    def capture(self, b: int, kv: int) -> None:
        """Record the graph of bucket (b, kv): warm-up on a side stream, then capture."""
        if (b, kv) in self.graphs:
            return
        self.positions.fill_(self.max_len - 1)  # warm-up writes land where nothing reads
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):
                self._body(b, kv)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            self._body(b, kv)
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[(b, kv)] = graph

    def capture_all(self) -> int:
        """Capture every (batch, KV) bucket now, at load, so serving never captures; returns the count."""
        for b in self.batch_buckets:
            for kv in self.kv_buckets:
                self.capture(b, kv)
        self.positions.fill_(self.max_len - 1)
        self.tokens.zero_()
        return len(self.graphs)

    def buckets_for(self, slots: list[int], positions: list[int]) -> tuple[int, int]:
        return (bucket_of(max(slots) + 1, self.batch_buckets),
                bucket_of(max(positions) + 1, self.kv_buckets))

    def run(self, slots: list[int], positions: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] for cache rows `slots` at `positions` -> log-probs [B, V] (float32)."""
        b, kv = self.buckets_for(slots, positions)
        index = torch.tensor(slots, device=self.device)
        with torch.inference_mode():
            self.tokens[:b].zero_()
            self.positions[:b].fill_(self.max_len - 1)
            self.tokens[index] = tokens.to(self.tokens.device)
            self.positions[index, 0] = torch.tensor(positions, device=self.device)
            graph = self.graphs.get((b, kv)) if self.use_graphs else None
            if graph is not None:
                graph.replay()
            else:  # never a capture while serving: it would stall every stream and flush the cache
                self.num_eager += self.use_graphs
                self._body(b, kv)
            return self.out[index].clone()
