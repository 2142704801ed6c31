"""Token-to-wave's flow with the K/V cache (CosyVoice 3): voices' prompts once, one chunk per tick.

`CachedFlow` turns what t2w/streams.py knows (a stream's tokens, its voice,
the chunk to emit) into the rows a `ChunkSolver` computes, and computes
voices' prompts. The decisions (docs/cosyvoice-design.md, "The flow's K/V cache"):

- The prompt is trimmed from the front to whole 25-token chunks (its last
  tokens kept, with their mel), so the answer starts on a chunk boundary and
  no chunk mixes prompt and answer. A prompt under 25 tokens keeps none: the
  voice then speaks from its x-vector alone, as a plain voice does.
- A prompt's chunks are computed as if nothing followed it: the last 3 prompt
  tokens' condition sees zeros where upstream's whole-sequence pass sees the
  answer's first 3 tokens (the pre-lookahead). That is the price of sharing
  the prompt between streams; the answer's own condition is upstream's
  (its window reaches 2 tokens back into the prompt).
- A tick computes one chunk per stream: the chunk holding the stream's next
  token. A chunk that does not fill its 50 frames (the first hop, 15 tokens;
  the last chunk) is computed with its keys masked past its end, and the
  first hop's chunk is computed again, whole, at the next tick.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from engine.backends.cosyvoice.flow_runtime.kv_cache import (
    ZERO_SLOT,
    CacheShape,
    FlowKVCache,
    RowPlace,
)
from engine.backends.cosyvoice.flow_runtime.solve_graphs import ChunkRow, ChunkSolver
from engine.backends.cosyvoice.models.flow_dit_chunk import CHUNK_TOKENS, LEFT_TOKENS, WINDOW_TOKENS
from engine.backends.cosyvoice.t2w.chunking import MAX_PROMPT_TOKENS

MAX_PROMPT_CHUNKS = MAX_PROMPT_TOKENS // CHUNK_TOKENS  # a 30 s reference: 30 chunks
VOICE_SLOTS = 64  # tail slots set aside for voices' prompts beyond the streams'


@dataclass(frozen=True, slots=True)
class TrimmedPrompt:
    tokens: list[int]  # a multiple of 25 tokens (the prompt's last ones)
    mel: torch.Tensor  # [<= 2 x tokens, 80] their frames
    embedding: torch.Tensor


def trim_prompt(prompt: Any, max_chunks: int) -> TrimmedPrompt:
    """A FlowPrompt cut from the front to whole chunks (at most `max_chunks`)."""
    n = int(prompt.tokens.shape[0])
    keep = min(n // CHUNK_TOKENS, max_chunks) * CHUNK_TOKENS
    dropped = 2 * (n - keep)  # mel frames before the kept tokens
    return TrimmedPrompt([int(t) for t in prompt.tokens[n - keep:].tolist()], prompt.mel[dropped:],
                         prompt.embedding)


def history_chunks(history_tokens: int | None) -> int | None:
    """Whole chunks that keep at least `history_tokens` tokens of history (None: all)."""
    return None if history_tokens is None else -(-history_tokens // CHUNK_TOKENS)


def blocks_for_bytes(shape: CacheShape, cache_bytes: float, history_tokens: int | None) -> int:
    """How many blocks `cache_bytes` holds, with the streams' and voices' tail slots counted."""
    history = history_chunks(history_tokens)
    per_stream = (history if history is not None else 1) + 1
    per_block = shape.bytes_per_block + shape.bytes_per_slot / per_stream + shape.bytes_per_slot
    return max(0, int((cache_bytes - 2 * shape.bytes_per_slot) // per_block))


def cache_blocks(cache_gib: float, shape: CacheShape, history_tokens: int | None,
                 device: torch.device, num_streams: int, reserve_gib: float) -> int:
    """Blocks for a cache of `cache_gib` (0: sized here). GPU: what is free now less `reserve_gib`
    (the solve's graphs and activations). CPU: every stream slot's ring and two whole prompts,
    at most 4 GiB."""
    if cache_gib > 0:
        return blocks_for_bytes(shape, cache_gib * 2 ** 30, history_tokens)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return blocks_for_bytes(shape, free - reserve_gib * 2 ** 30, history_tokens)
    history = history_chunks(history_tokens)
    wanted = num_streams * ((history if history is not None else 1) + 1) + 2 * MAX_PROMPT_CHUNKS + 1
    return min(wanted, blocks_for_bytes(shape, 4 * 2 ** 30, history_tokens))


def window(sequence: list[int], start: int, num_present: int) -> tuple[list[int], int, int]:
    """The token window of the chunk starting at token `start` of a sequence whose first
    `num_present` tokens exist -> (ids, first present, end present) in window indices."""
    lo = start - LEFT_TOKENS
    ids = [sequence[i] if 0 <= i < num_present else 0 for i in range(lo, lo + WINDOW_TOKENS)]
    return ids, max(0, -lo), min(WINDOW_TOKENS, max(0, num_present - lo))


class CachedFlow:
    def __init__(self, flow: Any, cache: FlowKVCache, solver: ChunkSolver) -> None:
        self.flow, self.cache, self.solver = flow, cache, solver
        self._voice_lock = threading.Lock()  # one voice's prompt computed at a time

    @classmethod
    def build(cls, flow: Any, num_blocks: int, history_tokens: int | None, max_streams: int,
              use_graphs: bool, block_step: int = 4) -> CachedFlow:
        """A cache of `num_blocks` chunks for `flow` (its dtype and device), and its solver of up
        to `max_streams` streams a call. `history_tokens`: at least that many tokens of history
        kept (whole chunks); None: all, while memory allows."""
        history = history_chunks(history_tokens)
        per_stream = (history if history is not None else 1) + 1
        if num_blocks < per_stream + 1:
            raise ValueError(f"expected a flow cache of at least {per_stream + 1} blocks, got "
                             f"{num_blocks}")
        num_slots = num_blocks // per_stream + min(VOICE_SLOTS, num_blocks) + 2
        cache = FlowKVCache(CacheShape.of(flow), num_blocks, num_slots, flow.noise.device, history,
                            MAX_PROMPT_CHUNKS)
        return cls(flow, cache, ChunkSolver(flow, cache, max_streams, use_graphs, block_step))

    def trim(self, prompt: Any) -> TrimmedPrompt:
        return trim_prompt(prompt, self.cache.max_prompt_chunks)

    def ensure_voice(self, prompt: Any) -> None:
        """The voice's prompt chunks in the cache: computed now (one chunk per solve) unless
        resident.

        Raises EngineBusyError when the cache cannot hold them.
        """
        with self._voice_lock:
            is_ready, blocks, slot = self.cache.voice(prompt)
            if is_ready:
                return
            try:
                trim = self.trim(prompt)
                frames = 2 * CHUNK_TOKENS
                mel = trim.mel.to(self.solver.device, self.solver.dtype)
                for k, block in enumerate(blocks):
                    ids, first, end = window(trim.tokens, k * CHUNK_TOKENS, len(trim.tokens))
                    cond = torch.zeros(80, frames, dtype=self.solver.dtype,
                                       device=self.solver.device)
                    part = mel[k * frames:(k + 1) * frames].T
                    cond[:, :part.shape[1]] = part
                    place = RowPlace(blocks[:k], block, ZERO_SLOT if k == 0 else slot, slot)
                    self.solver.solve([ChunkRow(ids, first, end, k * frames, frames, place,
                                                trim.embedding, cond)])
            except BaseException:
                self.cache.forget_voice(prompt)
                raise
            self.cache.voice_ready(prompt)

    def row(self, stream_id: str, trim: TrimmedPrompt, tokens: list[int], offset: int, end: int,
            num_present: int) -> tuple[ChunkRow, int]:
        """The row of a stream's next chunk: answer tokens [offset, end) emitted, `num_present`
        answer tokens visible (lookahead included). -> (row, first chunk frame to emit)."""
        cell = offset // CHUNK_TOKENS * CHUNK_TOKENS
        if not cell <= offset < end <= cell + CHUNK_TOKENS:
            raise ValueError(f"expected a chunk inside one {CHUNK_TOKENS}-token cell, got tokens "
                             f"{offset}-{end}")
        p = len(trim.tokens)
        ids, first, last = window(trim.tokens + tokens, p + cell, p + num_present)
        place = self.cache.place(stream_id, is_complete=end == cell + CHUNK_TOKENS)
        row = ChunkRow(ids, first, last, 2 * (p + cell), 2 * (end - cell), place, trim.embedding)
        return row, 2 * (offset - cell)
