"""The flow's K/V cache (CosyVoice 3): whole 50-frame chunks per (Euler step, layer, CFG row).

The DiT streams chunk-causally (models/flow_dit_chunk.py), so the keys and
values of a whole chunk never change once computed. This module holds them,
and says who owns which:

- a voice owns its prompt's chunks (the prompt trimmed from the front to whole
  chunks, so no chunk mixes prompt and answer), computed once and shared by
  every stream that speaks with it; counted by its streams, kept while idle and
  evicted (least recently used) only when an admission needs the memory, freed
  for good by `forget_voice` (the voice is removed);
- a stream owns `history_chunks` history blocks (a ring: the oldest is reused
  when a chunk completes) and the block of the chunk in progress, reserved at
  admission, so a running stream never needs more memory. With unbounded
  history (None) a stream grows its ring from free blocks, up to
  `max_history_chunks`, and reuses its oldest once none is free.

Memory is the limit, not arithmetic (docs/cosyvoice-design.md, "The flow's K/V
cache"): a frame costs steps x layers x 2 rows x K and V x heads x dim_head
elements, 1.72 MiB at CosyVoice 3's size in bf16 (10 x 22 x 2 x 2 x 1024 x 2 B);
a block (one chunk) 86 MiB. `num_admissible` says how many more streams fit,
so the backend's scheduler holds back what does not (and the engine's
admission counts `stream_capacity`); `add_stream` raises EngineBusyError,
never an out-of-memory error, when one does not fit.

Layout (one pool for every owner, so the shared prompt is never copied):

    k, v:  [steps, layers, heads, 2 * num_blocks, 50, dim_head]
           row r of block b at r * num_blocks + b
    tails: [steps, 2 convolutions, 2 * num_slots, 30, dim]
           row r of slot s at r * num_slots + s

A call gathers a row's blocks along one dimension, which gives
[heads, rows x blocks, 50, dim_head]: viewed as [rows, heads, keys, dim_head],
what attention reads, with no second copy. Reserved: block 0 (scratch that
padding rows write), tail slot 0 (zeros: the left of a sequence, never
written) and tail slot 1 (scratch for rows whose chunk is not complete).
A stream that is dropped while its chunk computes on the flow's thread gives
its memory back when that chunk is committed (`begin` / `end`), so no later
owner's blocks are written by a chunk already in flight.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.backends.cosyvoice.models.flow_dit_chunk import CHUNK_TOKENS, Attend
from engine.errors import EngineBusyError

ZERO_SLOT, SCRATCH_SLOT, SCRATCH_BLOCK = 0, 1, 0


@dataclass(frozen=True, slots=True)
class CacheShape:
    steps: int
    layers: int
    heads: int
    dim_head: int
    dim: int
    dtype: torch.dtype
    chunk_frames: int = 2 * CHUNK_TOKENS
    conv_tail: int = 30  # the position convolutions' kernel (31) - 1

    @classmethod
    def of(cls, flow: Any, dtype: torch.dtype | None = None) -> CacheShape:
        """The cache shape of a CosyVoice 3 FlowModel (its DiT and its 10 Euler steps)."""
        dit = flow.decoder.estimator
        block = dit.transformer_blocks[0]
        dim = block.attn.to_q.in_features
        inner = block.attn.to_q.out_features
        return cls(flow.decoder.n_timesteps, len(dit.transformer_blocks), block.attn.heads,
                   inner // block.attn.heads, dim, dtype or block.attn.to_q.weight.dtype,
                   conv_tail=dit.input_embed.conv_pos_embed.kernel - 1)

    @property
    def bytes_per_frame(self) -> int:
        """K and V of one frame: every step, layer and CFG row."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        return self.steps * self.layers * 2 * 2 * self.heads * self.dim_head * item

    @property
    def bytes_per_block(self) -> int:
        return self.chunk_frames * self.bytes_per_frame

    @property
    def bytes_per_slot(self) -> int:
        """Both position convolutions' left context, every step and CFG row."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        return self.steps * 2 * 2 * self.conv_tail * self.dim * item


@dataclass(slots=True)
class _Voice:
    prompt: Any  # the FlowPrompt it was made from: keeps the id (the key) from being reused
    blocks: list[int]
    slot: int  # ZERO_SLOT for a prompt of no whole chunk
    num_streams: int = 0
    last_used: int = 0
    is_ready: bool = False
    is_forgotten: bool = False


@dataclass(slots=True)
class _Stream:
    voice_key: int
    current: int  # the block the chunk in progress writes
    slot: int
    spare: list[int] = field(default_factory=list)  # reserved blocks the ring has not used yet
    history: deque[int] = field(default_factory=deque)  # whole chunks, oldest first
    num_complete: int = 0


@dataclass(frozen=True, slots=True)
class RowPlace:
    """Where one tick's row reads and writes: blocks before the chunk, its block, tail slots."""

    table: list[int]
    write_block: int
    tail_read: int
    tail_write: int


class FlowKVCache:
    def __init__(self, shape: CacheShape, num_blocks: int, num_slots: int,
                 device: torch.device | str,
                 history_chunks: int | None, max_prompt_chunks: int,
                 max_history_chunks: int = 40) -> None:
        if num_blocks < 3 or num_slots < 3:
            raise ValueError(f"expected at least 3 blocks and 3 tail slots, got {num_blocks} and "
                             f"{num_slots}")
        if history_chunks is not None and history_chunks < 0:
            raise ValueError(f"expected history_chunks >= 0 or None, got {history_chunks}")
        self.shape, self.num_blocks, self.num_slots = shape, num_blocks, num_slots
        self.history_chunks = history_chunks
        self.max_history_chunks = (history_chunks if history_chunks is not None
                                   else max_history_chunks)
        self.max_prompt_chunks = max_prompt_chunks
        s = shape
        kv = (s.steps, s.layers, s.heads, 2 * num_blocks, s.chunk_frames, s.dim_head)
        self.k = torch.zeros(kv, dtype=s.dtype, device=device)
        self.v = torch.zeros(kv, dtype=s.dtype, device=device)
        self.tails = torch.zeros(s.steps, 2, 2 * num_slots, s.conv_tail, s.dim, dtype=s.dtype,
                                 device=device)
        self._free_blocks = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))
        self._free_slots = list(range(num_slots - 1, SCRATCH_SLOT, -1))
        self._voices: dict[int, _Voice] = {}
        self._streams: dict[str, _Stream] = {}
        self._in_flight: set[str] = set()
        self._dropped_in_flight: set[str] = set()
        self._clock = itertools.count(1)
        self._lock = threading.RLock()

    # -- sizes and admission ----------------------------------------------------------------------

    @property
    def max_row_blocks(self) -> int:
        """The most key blocks one row attends over: a whole prompt, a full ring, its own chunk."""
        return self.max_prompt_chunks + self.max_history_chunks + 1

    @property
    def blocks_per_stream(self) -> int:
        """What admission reserves: the ring and the chunk in progress (unbounded history: one to
        start)."""
        return (self.history_chunks if self.history_chunks is not None else 1) + 1

    @property
    def bytes_per_stream(self) -> int:
        return self.blocks_per_stream * self.shape.bytes_per_block + self.shape.bytes_per_slot

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def voice_chunks(self, prompt: Any) -> int:
        """Whole chunks of a prompt: its tokens trimmed from the front, at most
        `max_prompt_chunks`."""
        return min(int(prompt.tokens.shape[0]) // CHUNK_TOKENS, self.max_prompt_chunks)

    def _evictable(self, keep: int | None) -> list[tuple[int, int]]:
        return sorted((v.last_used, key) for key, v in self._voices.items()
                      if key != keep and v.num_streams == 0 and v.is_ready)

    def _room(self, keep: int | None) -> tuple[int, int]:
        """Blocks and slots free, or freeable by evicting idle voices other than `keep`."""
        idle = [self._voices[key] for _, key in self._evictable(keep)]
        return (len(self._free_blocks) + sum(len(v.blocks) for v in idle),
                len(self._free_slots) + sum(v.slot != ZERO_SLOT for v in idle))

    def num_admissible(self, prompts: list[Any]) -> int:
        """How many of these streams (in order; one a prompt) fit now, together: a voice not
        resident needs its prompt's chunks once; idle voices they do not speak with can make
        room."""
        with self._lock:
            wanted = {id(p) for p in prompts}
            idle = [self._voices[key] for _, key in self._evictable(None) if key not in wanted]
            blocks = len(self._free_blocks) + sum(len(v.blocks) for v in idle)
            slots = len(self._free_slots) + sum(v.slot != ZERO_SLOT for v in idle)
            resident = set(self._voices)
            for n, prompt in enumerate(prompts):
                chunks = 0 if id(prompt) in resident else self.voice_chunks(prompt)
                need_blocks, need_slots = self.blocks_per_stream + chunks, 1 + (chunks > 0)
                if blocks < need_blocks or slots < need_slots:
                    return n
                blocks, slots = blocks - need_blocks, slots - need_slots
                resident.add(id(prompt))
            return len(prompts)

    def stream_capacity(self) -> int:
        """Streams held now plus how many more of a resident voice fit (the engine's admission
        figure)."""
        with self._lock:
            blocks, slots = self._room(None)
            return len(self._streams) + min(blocks // self.blocks_per_stream, slots)

    def info(self) -> dict[str, float]:
        """Figures for logs and benches: GiB per stream, per frame (MiB), in use and in all."""
        gib = 2.0 ** 30
        s = self.shape
        used = (self.num_blocks - 1 - len(self._free_blocks)) * s.bytes_per_block
        return {"mib_per_frame": s.bytes_per_frame / 2.0 ** 20,
                "gib_per_stream": self.bytes_per_stream / gib,
                "gib_total": (self.k.nbytes + self.v.nbytes + self.tails.nbytes) / gib,
                "gib_used": used / gib,
                "num_streams": float(len(self._streams)),
                "stream_capacity": float(self.stream_capacity())}

    # -- owners ------------------------------------------------------------------------------------

    def _take(self, blocks: int, slots: int, keep: int | None) -> tuple[list[int], list[int]]:
        room_blocks, room_slots = self._room(keep)
        if room_blocks < blocks or room_slots < slots:
            raise EngineBusyError(f"the flow cache is full: expected {blocks} free blocks and "
                                  f"{slots} tail slots, got {room_blocks} and {room_slots}; try "
                                  "again shortly")
        for _, key in self._evictable(keep):
            if len(self._free_blocks) >= blocks and len(self._free_slots) >= slots:
                break
            self._free_voice(key)
        taken_blocks = [self._free_blocks.pop() for _ in range(blocks)]
        return taken_blocks, [self._free_slots.pop() for _ in range(slots)]

    def _free_voice(self, key: int) -> None:
        voice = self._voices.pop(key)
        self._free_blocks += voice.blocks
        if voice.slot != ZERO_SLOT:
            self._free_slots.append(voice.slot)

    def voice(self, prompt: Any) -> tuple[bool, list[int], int]:
        """(is_ready, prompt blocks, tail slot) of a voice, its memory taken now if it has none.

        Not ready: the caller computes the prompt's chunks into those blocks, then `voice_ready`.
        """
        with self._lock:
            key = id(prompt)
            v = self._voices.get(key)
            if v is None:
                chunks = self.voice_chunks(prompt)
                blocks, slots = self._take(chunks, int(chunks > 0), key)
                v = self._voices[key] = _Voice(prompt, blocks, slots[0] if slots else ZERO_SLOT)
            v.last_used = next(self._clock)
            return v.is_ready, list(v.blocks), v.slot

    def voice_ready(self, prompt: Any) -> None:
        with self._lock:
            self._voices[id(prompt)].is_ready = True

    def forget_voice(self, prompt: Any) -> None:
        """The voice is removed: its memory goes now, or when its last stream ends."""
        with self._lock:
            v = self._voices.get(id(prompt))
            if v is None:
                return
            if v.num_streams == 0:
                self._free_voice(id(prompt))
            else:
                v.is_forgotten = True

    def has_voice(self, prompt: Any) -> bool:
        with self._lock:
            v = self._voices.get(id(prompt))
            return v is not None and v.is_ready

    def add_stream(self, stream_id: str, prompt: Any) -> None:
        """Reserve a stream's ring and tail slot (its voice must be resident: `voice`)."""
        with self._lock:
            if stream_id in self._streams:
                raise ValueError(f"expected a new stream id, got {stream_id!r} (already cached)")
            v = self._voices[id(prompt)]
            blocks, slots = self._take(self.blocks_per_stream, 1, id(prompt))
            v.num_streams += 1
            v.last_used = next(self._clock)
            self._streams[stream_id] = _Stream(id(prompt), blocks[0], slots[0], spare=blocks[1:])

    def release_stream(self, stream_id: str) -> None:
        """Free a stream's memory (its end, or a cancel); while its chunk is in flight, at `end`."""
        with self._lock:
            if stream_id in self._in_flight:
                self._dropped_in_flight.add(stream_id)
                return
            s = self._streams.pop(stream_id, None)
            if s is None:
                return
            self._free_blocks += [s.current, *s.spare, *s.history]
            self._free_slots.append(s.slot)
            v = self._voices[s.voice_key]
            v.num_streams -= 1
            if v.num_streams == 0 and v.is_forgotten:
                self._free_voice(s.voice_key)

    def has_stream(self, stream_id: str) -> bool:
        return stream_id in self._streams

    def begin(self, stream_ids: list[str]) -> None:
        with self._lock:
            self._in_flight.update(stream_ids)

    def end(self, stream_ids: list[str]) -> None:
        with self._lock:
            self._in_flight.difference_update(stream_ids)
            dropped = self._dropped_in_flight & set(stream_ids)
            self._dropped_in_flight -= dropped
            for sid in dropped:
                self.release_stream(sid)

    def place(self, stream_id: str, is_complete: bool) -> RowPlace:
        """Where a stream's next chunk reads and writes; `is_complete`: it fills its 50 frames."""
        with self._lock:
            s = self._streams[stream_id]
            v = self._voices[s.voice_key]
            read = s.slot if s.num_complete else v.slot
            return RowPlace([*v.blocks, *s.history], s.current, read,
                            s.slot if is_complete else SCRATCH_SLOT)

    def complete_chunk(self, stream_id: str) -> None:
        """The chunk in progress is whole: it joins the history, and the next chunk gets a block."""
        with self._lock:
            s = self._streams.get(stream_id)
            if s is None:
                return
            s.num_complete += 1
            s.history.append(s.current)
            if s.spare:
                s.current = s.spare.pop()
            elif (self.history_chunks is None and len(s.history) <= self.max_history_chunks
                  and self._free_blocks):
                s.current = self._free_blocks.pop()
            else:
                s.current = s.history.popleft()  # the ring: the oldest chunk leaves
            if len(s.history) > self.max_history_chunks:
                self._free_blocks.append(s.history.popleft())

    # -- what a solve reads and writes -------------------------------------------------------------

    def attend(self, step: int, write: torch.Tensor, table: torch.Tensor,
               key_mask: torch.Tensor) -> Attend:
        """Attention of one Euler step over the pool.

        write [R]: each row's pool index (row * num_blocks + block) for its chunk's keys and values;
        table [R, nb]: the pool indices of the blocks it attends over, its own among them;
        key_mask [R, 1, 1, nb * 50] bool: which of those keys are real.
        """
        def run(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            rows, heads, _, dim_head = q.shape
            keys, values = self.k[step, layer], self.v[step, layer]  # [H, 2 * NB, C, dh]
            keys.index_copy_(1, write, k.transpose(0, 1))
            values.index_copy_(1, write, v.transpose(0, 1))
            flat = table.reshape(-1)
            gk = keys.index_select(1, flat).view(heads, rows, -1, dim_head).transpose(0, 1)
            gv = values.index_select(1, flat).view(heads, rows, -1, dim_head).transpose(0, 1)
            return F.scaled_dot_product_attention(q, gk, gv, attn_mask=key_mask)

        return run

    def read_tails(self, step: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [R] (row * num_slots + slot) -> both convolutions' tails [R, 30, D]."""
        tails = self.tails[step]
        return tails[0].index_select(0, slots), tails[1].index_select(0, slots)

    def write_tails(self, step: int, slots: torch.Tensor, tail1: torch.Tensor,
                    tail2: torch.Tensor) -> None:
        self.tails[step, 0].index_copy_(0, slots, tail1)
        self.tails[step, 1].index_copy_(0, slots, tail2)
