"""One flow tick over the K/V cache: a 50-frame chunk per stream, the whole 10-step solve as ONE
graph.

A tick computes, for each of B streams (or voice prompts), one chunk: its
token condition (models/flow_dit_chunk.chunk_mu), its noise at its absolute
frames, then the 10 Euler steps with classifier-free guidance, each a DiT pass
of 2B rows x 50 frames that writes the chunk's keys and values into the cache
and attends over the row's cached blocks (flow_runtime/kv_cache.py). The shapes are
fixed by two buckets only: streams (buckets.row_buckets) and key blocks (a
multiple of `block_step`, up to a whole prompt, a full ring and the chunk).
History length enters only through each row's key count, so on a GPU every
tick is the replay of a graph captured at load (`capture_all`), none eager.

`use_graphs=False` runs the same body eagerly on any device, with the same
static buffers, padding and buckets, so CPU tests check everything but the
capture; the counters tell how each call ran (`num_replays`, `num_static`,
`num_eager`: a graph-mode call of a bucket that has no graph, never after
`capture_all`).

Padding rows (up to the stream bucket) and padded table entries point at the
scratch block, whose contents are finite; a padding row attends over its own
chunk. One lock: the static buffers serve one call at a time, and on a GPU
each call waits for the last one's work (an event), as callers on other CUDA
streams would otherwise overwrite the buffers while the GPU still reads them.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.backends.cosyvoice.buckets import bucket_of, row_buckets
from engine.backends.cosyvoice.flow_runtime.kv_cache import (
    SCRATCH_BLOCK,
    SCRATCH_SLOT,
    ZERO_SLOT,
    FlowKVCache,
    RowPlace,
)
from engine.backends.cosyvoice.models.flow import NOISE_FRAMES
from engine.backends.cosyvoice.models.flow_dit import DiTEstimator
from engine.backends.cosyvoice.models.flow_dit_chunk import WINDOW_TOKENS, chunk_mu, chunk_velocity

# columns of a row's integers after its window of tokens
FIRST, END, START, KEYS, WRITE, TAIL_READ, TAIL_WRITE = range(WINDOW_TOKENS, WINDOW_TOKENS + 7)
TABLE = WINDOW_TOKENS + 7
Bucket = tuple[int, int]  # (streams, key blocks)


@dataclass(slots=True)
class ChunkRow:
    """One chunk to compute: a stream's next chunk or one of a voice prompt's.

    tokens: the WINDOW_TOKENS ids from chunk start - 2 to chunk end + 3 (any id where absent);
    [first_present, end_present): the window's tokens that exist (first_present 2 at a
        sequence start);
    start_frame: the chunk's first absolute frame; num_frames: its real frames (1-50);
    embedding [192] and cond [80, 50] (a prompt's mel; None: zeros) on the model's device.
    """

    tokens: list[int]
    first_present: int
    end_present: int
    start_frame: int
    num_frames: int
    place: RowPlace
    embedding: torch.Tensor
    cond: torch.Tensor | None = None


def block_buckets(max_blocks: int, step: int) -> list[int]:
    if step < 1 or max_blocks < 1:
        raise ValueError(f"expected block_step >= 1 and max_blocks >= 1, got {step}, {max_blocks}")
    return list(range(step, max_blocks, step)) + [max_blocks]


class ChunkSolver:
    def __init__(self, flow: Any, cache: FlowKVCache, max_streams: int, use_graphs: bool,
                 block_step: int = 4) -> None:
        dit = flow.decoder.estimator
        if not isinstance(dit, DiTEstimator):
            raise TypeError("expected CosyVoice 3's DiT estimator for the K/V cache, got "
                            f"{type(dit).__name__}")
        device = flow.noise.device
        if use_graphs and device.type != "cuda":
            raise ValueError(f"expected the flow on a CUDA device for CUDA graphs, got {device}")
        self.flow, self.dit, self.cache, self.use_graphs = flow, dit, cache, use_graphs
        self.device, self.dtype = device, flow.spk_embed_affine_layer.weight.dtype
        self.frames = cache.shape.chunk_frames
        self.stream_buckets = row_buckets(max_streams)
        self.block_buckets = block_buckets(cache.max_row_blocks, block_step)
        self.times, self.dts = _euler_schedule(flow.decoder, device)
        self.cfg_rate = float(flow.decoder.cfg_rate)
        max_b, max_nb = self.stream_buckets[-1], self.block_buckets[-1]
        self.template = torch.zeros(TABLE + max_nb, dtype=torch.long)  # a padding row
        self.template[KEYS], self.template[WRITE] = self.frames, SCRATCH_BLOCK
        self.template[TAIL_READ], self.template[TAIL_WRITE] = ZERO_SLOT, SCRATCH_SLOT
        self.ints = self.template.repeat(max_b, 1).to(device)  # [S, TABLE + NB]
        self.cond = torch.zeros(max_b, 80, self.frames, dtype=self.dtype, device=device)
        embed_dim = flow.spk_embed_affine_layer.in_features
        self.embedding = torch.zeros(max_b, embed_dim, dtype=self.dtype, device=device)
        self.out = torch.zeros(max_b, 80, self.frames, device=device)  # float32, as the ODE state
        self.window = torch.arange(WINDOW_TOKENS, device=device)[None]
        self.frame_index = torch.arange(self.frames, device=device)[None]
        self.key_index = torch.arange(max_nb * self.frames, device=device)[None]
        self.graphs: dict[Bucket, Any] = {}  # torch.cuda.CUDAGraph per bucket
        self._pool: Any = None
        # calls (a call of more rows than the largest bucket counts once per part)
        self.num_solves = 0
        self.num_replays = 0
        self.num_static = 0  # calls run eagerly by design (use_graphs=False)
        self.num_eager = 0  # graph-mode calls of a bucket without its graph: none after capture_all
        self._lock = threading.Lock()
        self._done: Any = None

    # -- the body ----------------------------------------------------------------------------------

    def _body(self, b: int, nb: int) -> None:
        """Rows [0, b) of the static buffers, nb key blocks each -> self.out[:b] (every step, one
        chunk)."""
        flow, dit, cache, frames = self.flow, self.dit, self.cache, self.frames
        ints = self.ints[:b]
        first = ints[:, FIRST:FIRST + 1]
        present = (self.window >= first) & (self.window < ints[:, END:END + 1])
        mu = chunk_mu(flow.input_embedding, flow.pre_lookahead_layer, ints[:, :WINDOW_TOKENS],
                      present, first)
        absolute = ints[:, START:START + 1] + self.frame_index  # [b, C]
        x = flow.noise[:, absolute % NOISE_FRAMES].permute(1, 0, 2)  # [b, 80, C] float32
        spks = flow.spk_embed_affine_layer(F.normalize(self.embedding[:b], dim=1))
        upper = (torch.arange(2 * b, device=self.device) >= b).long()  # the unconditioned rows
        write = ints[:, WRITE].repeat(2) + upper * cache.num_blocks
        table = ints[:, TABLE:TABLE + nb].repeat(2, 1) + upper[:, None] * cache.num_blocks
        is_key = self.key_index[:, :nb * frames] < ints[:, KEYS:KEYS + 1]
        key_mask = is_key.repeat(2, 1)[:, None, None]
        tail_read = ints[:, TAIL_READ].repeat(2) + upper * cache.num_slots
        tail_write = ints[:, TAIL_WRITE].repeat(2) + upper * cache.num_slots
        rope = dit.rotary_embed.tables_at(absolute.repeat(2, 1))
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        spks2 = torch.cat([spks, torch.zeros_like(spks)])
        cond = self.cond[:b]
        cond2 = torch.cat([cond, torch.zeros_like(cond)])
        r = self.cfg_rate
        for step, (t, dt) in enumerate(zip(self.times, self.dts, strict=True)):
            tails = cache.read_tails(step, tail_read)
            v, tail1, tail2 = chunk_velocity(dit, torch.cat([x, x]).to(self.dtype), cond2, mu2,
                                             spks2, t, rope,
                                             tails, cache.attend(step, write, table, key_mask))
            cache.write_tails(step, tail_write, tail1, tail2)
            v = v.float()
            x = x + dt * ((1.0 + r) * v[:b] - r * v[b:])
        self.out[:b] = x

    # -- calls -------------------------------------------------------------------------------------

    def bucket_for(self, rows: list[ChunkRow]) -> Bucket:
        blocks = max(len(r.place.table) + 1 for r in rows)
        return bucket_of(len(rows), self.stream_buckets), bucket_of(blocks, self.block_buckets)

    def _load(self, rows: list[ChunkRow], bucket: Bucket) -> None:
        b, nb = bucket
        host = self.template[:TABLE + nb].repeat(b, 1)
        for i, r in enumerate(rows):
            if len(r.tokens) != WINDOW_TOKENS or not 0 < r.num_frames <= self.frames:
                raise ValueError(f"expected {WINDOW_TOKENS} window tokens and 1-{self.frames} "
                                 f"frames, got {len(r.tokens)} and {r.num_frames}")
            host[i, :WINDOW_TOKENS] = torch.tensor(r.tokens)
            table = [*r.place.table, r.place.write_block]
            host[i, FIRST], host[i, END] = r.first_present, r.end_present
            host[i, START] = r.start_frame
            host[i, KEYS] = (len(table) - 1) * self.frames + r.num_frames
            host[i, WRITE], host[i, TAIL_READ], host[i, TAIL_WRITE] = (
                r.place.write_block, r.place.tail_read, r.place.tail_write)
            host[i, TABLE:TABLE + len(table)] = torch.tensor(table)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.ints[:b, :TABLE + nb].copy_(host, non_blocking=True)
        self.cond[:b].zero_()
        self.embedding[:b].zero_()
        self.embedding[:len(rows)] = torch.stack([r.embedding.to(self.device, self.dtype)
                                                  for r in rows])
        for i, r in enumerate(rows):
            if r.cond is not None:
                self.cond[i].copy_(r.cond)

    def solve(self, rows: list[ChunkRow]) -> torch.Tensor:
        """Mel [len(rows), 80, 50] float32 of each row's chunk (frames past num_frames: padding)."""
        if not rows:
            return torch.zeros(0, 80, self.frames, device=self.device)
        most = self.stream_buckets[-1]
        if len(rows) > most:
            return torch.cat([self.solve(rows[i:i + most]) for i in range(0, len(rows), most)])
        bucket = self.bucket_for(rows)
        with self._lock, torch.inference_mode():
            # the last call may have been enqueued on another CUDA stream
            if self._done is not None:
                torch.cuda.current_stream(self.device).wait_event(self._done)
            self._load(rows, bucket)
            self.num_solves += 1
            graph = self.graphs.get(bucket) if self.use_graphs else None
            if graph is not None:
                graph.replay()
                self.num_replays += 1
            else:  # never a capture while serving: it would stall every stream
                self.num_eager += self.use_graphs
                self.num_static += not self.use_graphs
                self._body(*bucket)
            out = self.out[:len(rows)].clone()
            if self.device.type == "cuda":
                if self._done is None:
                    self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._done.record(torch.cuda.current_stream(self.device))
            return out

    # -- capture -----------------------------------------------------------------------------------

    def buckets(self) -> list[Bucket]:
        return [(b, nb) for b in self.stream_buckets for nb in self.block_buckets]

    def capture(self, bucket: Bucket) -> None:
        """Record a bucket's graph: warm-up on a side stream, then capture into the shared pool.
        Padding rows only: what they write goes to the scratch block and slot."""
        if bucket in self.graphs:
            return
        self.ints[:bucket[0]] = self.template.to(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                self._body(*bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            self._body(*bucket)
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[bucket] = graph

    def capture_all(self) -> int:
        """Every (streams, key blocks) bucket now, at load: serving never captures. Returns the
        count."""
        with self._lock:
            for bucket in self.buckets():
                self.capture(bucket)
        return len(self.graphs)


def _euler_schedule(cfm: Any,
                    device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each step's time [1] and step size (0-d), float32, by the very operations CFM.forward
    uses."""
    t_span = torch.linspace(0, 1, cfm.n_timesteps + 1, device=device, dtype=torch.float32)
    if cfm.cosine:
        t_span = 1 - torch.cos(t_span * 0.5 * math.pi)
    times, dts = [], []
    t, dt = t_span[0], t_span[1] - t_span[0]
    for step in range(1, len(t_span)):
        times.append(t.reshape(1))
        dts.append(dt)
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    return times, dts
