"""CosyVoice 3's vocoder step (t2w/vocoder.v3_step) replayed as CUDA graphs at a stream's usual
shapes.

With the flow's K/V cache a stream's chunks are 50 frames on the grid, and the
vocoder re-vocodes a bounded context before them (`hift_context_frames`, 24,
plus the 8 frames it holds back), so after its first two chunks every call of
a stream has one shape: 82 mel frames, 29 of them with their f0 known. The
first hop (30 frames, nothing known) and the chunk that completes it (50) have
shapes of their own. `steady_shapes` lists these; a graph per (rows bucket,
shape) is captured at load, and a call at one of them replays it, its rows
padded (zero mel, which vocodes to finite samples and is thrown away). Other
calls (the last chunk of a stream, a speed other than 1, a context's next
segment) run `v3_step` eagerly: a few per stream.

`use_graphs=False` runs the same padded static path eagerly on any device, so
CPU tests check it (`num_static`); `num_eager` counts calls at shapes without
a graph. One lock, as flow_runtime/solve_graphs.py: the static buffers serve
one call at a time.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from engine.backends.cosyvoice.buckets import bucket_of, row_buckets
from engine.backends.cosyvoice.models.hift import HiFT
from engine.backends.cosyvoice.t2w.vocoder import v3_step

Shape = tuple[int, int]  # (mel frames, frames with known f0)


def steady_shapes(first_hop_tokens: int | None, context: int, hold: int = 8, f0_look: int = 3,
                  chunk_frames: int = 50) -> list[Shape]:
    """The (frames, known f0) of a stream's non-final vocoder calls at speed 1 with the cache:
    its first hop, the chunk that completes it, then every chunk after (one shape)."""
    ends = ([2 * first_hop_tokens] if first_hop_tokens and 2 * first_hop_tokens < chunk_frames
            else [])
    ends += [chunk_frames * k for k in (1, 2, 3)]
    shapes: list[Shape] = []
    done = f0_done = 0
    for end in ends:
        start = max(0, done - context)
        shape = (end - start, f0_done - start)
        if shape not in shapes:
            shapes.append(shape)
        done, f0_done = end - hold, end - f0_look
    return shapes


class VocoderGraphs:
    def __init__(self, hift: HiFT, max_rows: int, shapes: list[Shape], use_graphs: bool) -> None:
        device = hift.window.device
        if use_graphs and device.type != "cuda":
            raise ValueError(f"expected the vocoder on a CUDA device for CUDA graphs, got {device}")
        self.hift, self.shapes = hift, list(shapes)
        self.use_graphs, self.device = use_graphs, device
        self.rows = row_buckets(max_rows)
        dtype, most = hift.window.dtype, self.rows[-1]
        self.static: dict[Shape, tuple[torch.Tensor, ...]] = {
            (frames, known): (torch.zeros(most, 80, frames, dtype=dtype, device=device),
                              torch.zeros(most, known, dtype=dtype, device=device),
                              torch.zeros(most, hift.m_source.dim, dtype=torch.float64,
                                          device=device),
                              torch.zeros(most, dtype=torch.long, device=device))
            for frames, known in self.shapes}
        self.outputs: dict[tuple[int, Shape], tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[tuple[int, Shape], Any] = {}
        self._pool: Any = None
        self._lock = threading.Lock()
        self.num_replays = 0
        # calls run eagerly by design (use_graphs=False), padded as a graph would be
        self.num_static = 0
        self.num_eager = 0  # calls at shapes without a graph (last chunks, other speeds), unpadded

    def _body(self, rows: int, shape: Shape) -> tuple[torch.Tensor, ...]:
        mel, kept, phase0, starts = (a[:rows] for a in self.static[shape])
        return v3_step(self.hift, mel, kept, phase0, starts, False)

    def step(self, hift: HiFT, mel: torch.Tensor, kept: torch.Tensor, phase0: torch.Tensor,
             starts: torch.Tensor,
             finalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """vocoder.v3_step's signature: a replay where the shape has a graph, else v3_step."""
        shape = (mel.shape[2], kept.shape[1])
        if finalize or shape not in self.static or mel.shape[0] > self.rows[-1]:
            self.num_eager += 1
            return v3_step(hift, mel, kept, phase0, starts, finalize)
        n = mel.shape[0]
        rows = bucket_of(n, self.rows)
        with self._lock:
            for buffer, value in zip(self.static[shape], (mel, kept, phase0, starts), strict=True):
                buffer[:rows].zero_()
                buffer[:n].copy_(value)
            graph = self.graphs.get((rows, shape)) if self.use_graphs else None
            if graph is not None:
                graph.replay()
                out = self.outputs[(rows, shape)]
                self.num_replays += 1
            else:
                out = self._body(rows, shape)
                self.num_eager += self.use_graphs
                self.num_static += not self.use_graphs
            wav, f0, cycles = (o[:n].clone() for o in out)
            return wav, f0, cycles

    def capture(self, rows: int, shape: Shape) -> None:
        if (rows, shape) in self.graphs:
            return
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                self._body(rows, shape)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            self.outputs[(rows, shape)] = self._body(rows, shape)
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[(rows, shape)] = graph

    def capture_all(self) -> int:
        """Every (rows bucket, shape) now, at load; returns the count."""
        with self._lock:
            for shape in self.shapes:
                for rows in self.rows:
                    self.capture(rows, shape)
        return len(self.graphs)
