"""Static-shape decode steps for the speech LM, captured as CUDA graphs per batch-size bucket.

At real sizes a decode step is launch-bound (24 layers of small kernels: the
anchor is 5.7-12 ms eager against 1.27-4.7 ms with graphs, docs/benchmarks.md,
"Anchors"; this build's figures are under "LM decode step" there), so the
GPU path replays one captured graph per (batch bucket, KV-length bucket)
instead (gpt-fast / nano-vllm style), every bucket captured at load (`capture_all`).
The graph holds the whole step of decode_step.py: the sampling of each row's
token (greedy or RAS) and its forward, so a step is one host-to-device copy
of the step's inputs, one replay and one read of the chosen tokens. A graph
needs fixed shapes and addresses, which the dynamic path (runner.py) does not
have: it reads exactly the batch's cache rows and `max(position) + 1` keys.
Here instead:

- the step runs cache rows [0, b) for the smallest bucket b above the
  highest slot of the batch (slots are handed out lowest-first, so active
  streams sit at the bottom): attention reads a view of the cache, never a
  gather. Rows that are not in the batch are idle (`ACTIVE` 0): they compute a
  throwaway output, write a throwaway key and value at position `max_len - 1`
  and keep their log-probs and window; the stray key is harmless because
  every forward writes its own position before it reads it, so a stale entry
  is always overwritten before any query can see it;
- keys are read up to a multiple of `kv_bucket` (the mask hides the rest);
- inputs are copied into static buffers; the graph writes the chosen tokens
  into a static output buffer and updates the runner's log-probs and windows
  in place.

`mode="static"` runs the same function eagerly (any device): CPU tests prove it
computes what the dynamic path does, and the GPU path differs only by capture.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.backends.cosyvoice.buckets import bucket_of, row_buckets
from engine.backends.cosyvoice.lm.decode_step import (
    POSITION,
    STEP_WIDTH,
    DecodesSpeech,
    DecodeState,
    Vocabulary,
    decode_rows,
)
from engine.backends.cosyvoice.lm.sampling import RasConfig
from engine.backends.cosyvoice.models.qwen2 import SlotKVCache

DECODE_MODES = ("dynamic", "static", "cuda_graphs")


class StaticDecoder:
    """One decode step for any subset of slots, with shapes drawn from a few buckets."""

    def __init__(self, lm: DecodesSpeech, cache: SlotKVCache, state: DecodeState, vocab: Vocabulary,
                 ras: RasConfig, use_graphs: bool, kv_bucket: int = 256) -> None:
        """`lm` decodes into `cache` (whose dtype its weights share); `state` is the runner's."""
        k0, _ = cache.layer(0)
        self.lm, self.cache, self.state, self.vocab, self.ras = lm, cache, state, vocab, ras
        self.device, self.dtype, self.max_len = k0.device, k0.dtype, cache.max_len
        if use_graphs and self.device.type != "cuda":
            raise ValueError(f"expected a CUDA device for CUDA graphs, got {self.device}")
        if kv_bucket < 1:
            raise ValueError(f"expected kv_bucket >= 1, got {kv_bucket}")
        self.use_graphs = use_graphs
        max_b, max_len, dev = cache.max_batch, cache.max_len, self.device
        self.batch_buckets = row_buckets(max_b)  # 1, 2, 4, ... 64, then multiples of 32
        self.kv_buckets = [k for k in range(kv_bucket, max_len, kv_bucket)] + [max_len]
        # the step's inputs: written on the host, copied in one transfer (pinned on a GPU)
        self.host_in = torch.zeros(max_b, STEP_WIDTH, dtype=torch.long,
                                   pin_memory=dev.type == "cuda")
        self._host_view = self.host_in.numpy()
        # [S, STEP_WIDTH]
        self.step_in = torch.zeros(max_b, STEP_WIDTH, dtype=torch.long, device=dev)
        self.step_in[:, POSITION] = max_len - 1
        self.rows = torch.arange(max_b, device=dev)  # [S]
        self.chosen = torch.zeros(max_b, dtype=torch.long, device=dev)  # [S]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the graphs' shared memory pool
        self.num_eager = 0  # graph-mode steps of a bucket not captured (none after capture_all)

    def _body(self, b: int, kv: int) -> None:
        """Rows [0, b): choose and feed each active row's token (decode_step.py)."""
        chosen, logp, window = decode_rows(
            self.lm, self.cache, self.state, self.vocab, self.ras, slice(0, b), self.rows[:b],
            self.step_in[:b], kv, (0, b), self.dtype)
        self.chosen[:b] = chosen
        self.state.logp[:b] = logp
        self.state.history[:b] = window

    def capture(self, b: int, kv: int) -> None:
        """Record the graph of bucket (b, kv): warm-up on a side stream, then capture.

        Every row is idle while it is recorded (the warm-up runs the body for real),
        so no stream's log-probs or window change.
        """
        if (b, kv) in self.graphs:
            return
        self._idle(b)
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
        """Capture every (batch, KV) bucket now, at load, so serving never captures; returns the
        count."""
        for b in self.batch_buckets:
            for kv in self.kv_buckets:
                self.capture(b, kv)
        self._idle(self.cache.max_batch)
        return len(self.graphs)

    def _idle(self, b: int) -> None:
        self._host_view[:b] = 0
        self._host_view[:b, POSITION] = self.max_len - 1
        self.step_in[:b].copy_(self.host_in[:b])

    def buckets_for(self, slots: list[int], positions: list[int]) -> tuple[int, int]:
        return (bucket_of(max(slots) + 1, self.batch_buckets),
                bucket_of(max(positions) + 1, self.kv_buckets))

    def step(self, slots: list[int], inputs: np.ndarray) -> np.ndarray:
        """One step for cache rows `slots`, inputs [B, STEP_WIDTH] (decode_step.py) -> chosen tokens
        [B]."""
        b, kv = self.buckets_for(slots, [int(p) for p in inputs[:, POSITION]])
        view = self._host_view
        view[:b] = 0
        view[:b, POSITION] = self.max_len - 1
        view[slots] = inputs
        with torch.inference_mode():
            self.step_in[:b].copy_(self.host_in[:b], non_blocking=True)
            graph = self.graphs.get((b, kv)) if self.use_graphs else None
            if graph is not None:
                graph.replay()
            else:  # never a capture while serving: it would stall every stream and flush the cache
                self.num_eager += self.use_graphs
                self._body(b, kv)
            chosen = self.chosen[:b].cpu().numpy()  # the one sync of the step
        return chosen[slots]
