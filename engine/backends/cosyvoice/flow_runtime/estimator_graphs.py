"""The torch flow estimator replayed as CUDA graphs, one per (mode, row bucket, frame bucket).

The path for a GPU without TensorRT. A DiT pass at serving sizes launches a
few hundred small kernels (22 blocks); replaying a captured graph removes the
launch cost (gpt-fast / nano-vllm style, as lm/graphs.py does for the LM). A
graph has fixed shapes and addresses, so each call is padded up to a bucket:

- rows (CFG rows, twice the streams) to the next bucket (powers of two to 64,
  then multiples of 32: buckets.row_buckets); the padding
  rows get mask 1 everywhere (a row with no valid frame would make attention
  softmax over nothing, NaN) and zeros elsewhere, and are thrown away;
- frames to the next multiple of `frame_step`, masked out. Right padding is
  exact: the estimator's convolutions are causal and masked, attention masks
  padded keys, and the chunked mask depends on absolute positions only
  (tests/unit/engine/cosyvoice/test_flow.py proves it for ragged batches; the tests here
  for the bucket padding itself).

`use_graphs=False` runs the same padded static path eagerly on any device, so
CPU tests cover everything but the capture. The loader captures the buckets
of the streaming mode at load (`capture_all`); a call never captures (a
capture stalls every stream and empties the allocator's cache): a bucket
without a graph runs the static path eagerly.

Only buckets of at most `max_graph_row_frames` (CFG rows x frames) get a graph.
A graph removes launch cost, which counts only while the GPU's work is short:
on an H200 (docs/benchmarks.md, "Flow estimator pass"; 480 frames) graphs took
a pass from 14.2 to 4.4 ms at 1 stream (2 rows) but 59.7 to 58.6 ms at 32 (64
rows), and about 1% above: less than a padded bucket costs (up to 31 rows and 63
frames of padding). Capturing every bucket meant 377 graphs at the default
limits, each after two warm-up passes up to 256 rows x 1,856 frames: the
first device run's load took 200 s. A call past the limit runs the plain
estimator on its exact shape, unpadded (`num_plain`). A shape limit never fails a
call: more rows than the largest bucket are split into calls that fit
(`split_rows`), more frames run the plain estimator. One lock: a graph's static buffers
serve one call at a time, and on a GPU each call's work also waits for the
previous call's (an event), since callers on other CUDA streams (threads)
would otherwise overwrite the buffers while the GPU still reads them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from engine.backends.cosyvoice.buckets import bucket_of, row_buckets

Bucket = tuple[bool, int, int]  # (streaming, rows, frames)


def frame_buckets(max_frames: int, frame_step: int) -> list[int]:
    """Multiples of `frame_step` up to `max_frames` (the last bucket)."""
    if frame_step < 1 or max_frames < 2:
        raise ValueError(f"expected frame_step >= 1 and max_frames >= 2, got {frame_step}, "
                         f"{max_frames}")
    return list(range(frame_step, max_frames, frame_step)) + [max_frames]


def pad_inputs(inputs: tuple[torch.Tensor, ...], rows: int,
               frames: int) -> tuple[torch.Tensor, ...]:
    """(x, mask, mu, t, spks, cond) of B rows and T frames -> the same padded to `rows` x
    `frames`."""
    static = empty_static(rows, frames, inputs[0].dtype, inputs[0].device)
    load_static(static, inputs)
    return static


def empty_static(rows: int, frames: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
    def z(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    # x, mask, mu, t, spks, cond; t float32 (the estimator forms its time embedding in float32)
    t = torch.zeros(rows, dtype=torch.float32, device=device)
    return (z(rows, 80, frames), z(rows, 1, frames), z(rows, 80, frames), t, z(rows, 80),
            z(rows, 80, frames))


def load_static(static: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]) -> None:
    """Copy a call's inputs into the top-left corner of a bucket's buffers; padding as the docstring
    says."""
    b, t = inputs[0].shape[0], inputs[0].shape[2]
    rows, frames = static[0].shape[0], static[0].shape[2]
    if b > rows or t > frames:
        raise ValueError(f"expected at most {rows} rows and {frames} frames, got {b} and {t}")
    for buf, a in zip(static, inputs, strict=True):
        buf.zero_()
        if buf.dim() == 3:
            buf[:b, :, :t].copy_(a)
        else:
            buf[:b].copy_(a)
    static[1][b:].fill_(1.0)  # padding rows: every frame valid, so no all-masked softmax


class GraphedEstimator(nn.Module):
    """The torch estimator through bucketed static buffers, replayed as CUDA graphs (or eagerly)."""

    def __init__(self, estimator: nn.Module, max_rows: int = 256, max_frames: int = 1024,
                 frame_step: int = 64, use_graphs: bool = True,
                 max_graph_row_frames: int = 0) -> None:
        super().__init__()
        param = next(estimator.parameters())
        if use_graphs and param.device.type != "cuda":
            raise ValueError("expected the estimator on a CUDA device for CUDA graphs, got "
                             f"{param.device}")
        if max_graph_row_frames < 0:
            raise ValueError("expected max_graph_row_frames >= 0 (0: every bucket), got "
                             f"{max_graph_row_frames}")
        self.estimator = estimator
        self.use_graphs = use_graphs
        self.max_graph_row_frames = max_graph_row_frames
        self.rows = row_buckets(max_rows)
        self.frames = frame_buckets(max_frames, frame_step)
        self.static: dict[Bucket, tuple[torch.Tensor, ...]] = {}
        self.outputs: dict[Bucket, torch.Tensor] = {}
        self.graphs: dict[Bucket, Any] = {}  # torch.cuda.CUDAGraph per bucket
        # calls with more frames than the largest bucket: the plain estimator
        self.num_fallbacks = 0
        # graph-mode calls of a graph bucket without its graph (none after capture_all)
        self.num_eager = 0
        self.num_plain = 0  # graph-mode calls past `max_graph_row_frames`: the plain estimator
        self._pool: Any = None  # the graphs' shared memory pool
        self._largest: tuple[torch.Tensor, ...] | None = None  # input buffers of the largest bucket
        self._lock = threading.Lock()
        self._done: Any = None  # torch.cuda.Event recorded after the last call's use of the buffers

    def bucket_for(self, rows: int, frames: int, streaming: bool) -> Bucket | None:
        if rows > self.rows[-1] or frames > self.frames[-1]:
            return None
        return streaming, bucket_of(rows, self.rows), bucket_of(frames, self.frames)

    def _static_for(self, bucket: Bucket, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A bucket's inputs: views of the top-left corner of one set of largest-bucket buffers
        (every call loads its whole view before it runs, so buckets can share the memory)."""
        if self._largest is None:
            self._largest = empty_static(self.rows[-1], self.frames[-1], like.dtype, like.device)
            self._largest[1].fill_(1.0)
        if bucket not in self.static:
            rows, frames = bucket[1], bucket[2]
            self.static[bucket] = tuple(a[:rows, :, :frames] if a.dim() == 3 else a[:rows]
                                        for a in self._largest)
        return self.static[bucket]

    def has_graph_size(self, bucket: Bucket) -> bool:
        """Whether a bucket is small enough for a graph to pay (`max_graph_row_frames`)."""
        return not self.max_graph_row_frames or bucket[1] * bucket[2] <= self.max_graph_row_frames

    def capture_all(self, like: torch.Tensor, streaming: bool = True) -> int:
        """Capture every graph bucket of a mode now (start-up) rather than on first use (a
        serving-time stall); returns how many."""
        buckets = [(streaming, rows, frames) for rows in self.rows for frames in self.frames]
        buckets = [bucket for bucket in buckets if self.has_graph_size(bucket)]
        for bucket in buckets:
            with self._lock:
                self.capture(bucket, like)
        return len(buckets)

    def _run_static(self, bucket: Bucket) -> torch.Tensor:
        out: torch.Tensor = self.estimator(*self.static[bucket], bucket[0])
        return out

    def capture(self, bucket: Bucket, like: torch.Tensor) -> None:
        """Record the graph of a bucket: warm-up on a side stream, then capture into the shared
        pool."""
        if bucket in self.graphs:
            return
        self._static_for(bucket, like)[1].fill_(1.0)  # valid inputs for the warm-up passes
        device = like.device
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                self._run_static(bucket)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            self.outputs[bucket] = self._run_static(bucket)
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[bucket] = graph

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        # x, mu, cond: [B, 80, T]; mask: [B, 1, T]; t: [B]; spks: [B, 80] -> [B, 80, T]
        b, frames = x.shape[0], x.shape[2]
        inputs = (x, mask, mu, t, spks, cond)
        if frames > self.frames[-1]:
            self.num_fallbacks += 1
            out: torch.Tensor = self.estimator(*inputs, streaming)
            return out
        if b > self.rows[-1]:
            return split_rows(lambda *part: self(*part, streaming), inputs, self.rows[-1])
        bucket = self.bucket_for(b, frames, streaming)
        assert bucket is not None
        if self.use_graphs and not self.has_graph_size(bucket):  # compute-bound: no padding
            self.num_plain += 1
            with torch.inference_mode():
                plain: torch.Tensor = self.estimator(*inputs, streaming)
            return plain
        with self._lock, torch.inference_mode():
            if self._done is not None:  # the last call may have been enqueued on another stream
                torch.cuda.current_stream(x.device).wait_event(self._done)
            load_static(self._static_for(bucket, x), inputs)
            self.num_eager += self.use_graphs and bucket not in self.graphs
            if bucket in self.graphs:
                # Graphs share one pool: another bucket's replay may overwrite this output's
                # memory, so it is read (cloned) at once, under the lock.
                self.graphs[bucket].replay()
                result = self.outputs[bucket]
            else:
                result = self._run_static(bucket)
            out = result[:b, :, :frames].clone()
            if x.is_cuda:
                if self._done is None:
                    self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._done.record(torch.cuda.current_stream(x.device))
            return out


def split_rows(run: Any, inputs: tuple[torch.Tensor, ...], max_rows: int) -> torch.Tensor:
    """(x, mask, mu, t, spks, cond) of more than `max_rows` rows run as calls of at most that many.

    Rows are independent (each attends only to itself), so the pieces joined
    are the whole call's output.
    """
    parts = [run(*(a[i:i + max_rows] for a in inputs))
             for i in range(0, inputs[0].shape[0], max_rows)]
    return torch.cat(parts, dim=0)
