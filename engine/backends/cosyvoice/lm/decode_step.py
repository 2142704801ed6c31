"""One decode step on the device: choose each stream's token, then feed it, with no host sync
between.

A step used to choose tokens on the host side of a sync (the log-probs of the
last forward were masked and sampled by eager ops, `.tolist()` read the choice
back, and only then were the tokens embedded and fed): on a GPU that made the
sampling's ~30 small kernels and two host round trips part of every step.
Here the whole step is one function of device tensors, so graphs.py captures
it as ONE CUDA graph per bucket (sampling included), and the host reads the
chosen tokens once, after the replay:

1. each row's pending log-probs (`DecodeState.logp`, from the previous
   forward or the prefill) get the minimum-length mask (sampling.py);
2. its token is drawn (greedy or RAS, with the counter-based uniforms of its
   seed and token count), or taken as given (`FORCED`: teacher forcing);
3. the token is embedded and fed at the row's position; the new log-probs and
   the RAS window are written back for rows that go on. A row that chose a
   stop id feeds a throwaway token at its position, which the stream never
   counts as cached: the next forward on that slot overwrites it.

Per-step inputs arrive as one int64 row per slot (`STEP_WIDTH` columns), so a
step copies one small host buffer to the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.backends.cosyvoice.lm.sampling import (
    RasConfig,
    mask_min_length,
    sample_rows,
    uniforms_of,
)
from engine.backends.cosyvoice.models.qwen2 import CacheView, SlotKVCache

# columns of a step's input row; FLAGS holds the bits below
ACTIVE, POSITION, COUNTER, FLAGS, TOKEN = range(5)
STEP_WIDTH = 5
BELOW_MIN, GREEDY, FORCED = 1, 2, 4


class DecodesSpeech(Protocol):
    """What a decode step calls on the speech LM (models/speech_lm.SpeechLM)."""

    def token_embeds(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def forward_hidden(self, embeds: torch.Tensor, view: CacheView) -> torch.Tensor: ...

    def head_logp(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class DecodeState:
    """The runner's per-slot tensors a step reads and updates (S slots, V rows, W window)."""

    logp: torch.Tensor  # [S, V] float32: the pending next-token log-probs
    history: torch.Tensor  # [S, W] int64: the last W tokens (-1 before the first), for RAS
    seed_words: torch.Tensor  # [S, 2] int64: each stream's seed (sampling.seed_words)
    strict: torch.Tensor  # [1] bool: below the minimum length, forbid every stop id (not only 6561)


@dataclass(slots=True, frozen=True)
class Vocabulary:
    """The ids a step needs: speech tokens are below `speech_token_size`; `mask_index` is masked
    below the minimum length (sampling.py)."""

    speech_token_size: int
    mask_index: int


def decode_rows(lm: DecodesSpeech, cache: SlotKVCache, state: DecodeState, vocab: Vocabulary,
                ras: RasConfig, rows: torch.Tensor | slice, slots: torch.Tensor,
                step_in: torch.Tensor, kv_len: int, row_range: tuple[int, int] | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step for the cache rows `slots` [B] (the state read at `rows`: an index or a slice).

    step_in: [B, STEP_WIDTH] int64. Returns (chosen [B] int64, log-probs [B, V], window [B, W]),
    the last two as the rows should be written back (unchanged where a row stopped or is idle).
    """
    active = step_in[:, ACTIVE] > 0
    flags = step_in[:, FLAGS]
    below_min = (flags & BELOW_MIN) > 0
    pending = state.logp[rows]  # [B, V]
    history = state.history[rows]  # [B, W]
    logp = mask_min_length(pending, below_min, vocab.mask_index)
    stops = logp[:, vocab.speech_token_size:]
    logp[:, vocab.speech_token_size:] = torch.where(below_min[:, None] & state.strict,
                                                    float("-inf"), stops)
    uniforms = uniforms_of(state.seed_words[rows], step_in[:, COUNTER])  # [B, 2]
    sampled = sample_rows(logp, history, (flags & GREEDY) > 0, ras, uniforms)
    chosen = torch.where((flags & FORCED) > 0, step_in[:, TOKEN], sampled)  # [B]
    is_stop = chosen >= vocab.speech_token_size
    goes_on = active & ~is_stop
    fed = torch.where(is_stop, torch.zeros_like(chosen), chosen)
    embeds = lm.token_embeds(fed).to(dtype)  # [B, 1, D]
    view = CacheView(cache, slots, step_in[:, POSITION:POSITION + 1], kv_len=kv_len,
                     row_range=row_range)
    hidden = lm.forward_hidden(embeds, view)  # [B, 1, D]
    new_logp = lm.head_logp(hidden[:, -1])  # [B, V] float32
    window = torch.cat([history[:, 1:], chosen[:, None]], dim=1)
    return (chosen, torch.where(goes_on[:, None], new_logp, pending),
            torch.where(goes_on[:, None], window, history))
