"""Choosing the next speech token for a batch of streams at once.

Upstream samples one stream at a time with "repetition-aware sampling"
(RAS, VALL-E 2 section 3.3; `ras_sampling` in cosyvoice/utils/common.py):

1. nucleus sampling: walk the tokens by descending probability (stable sort),
   keeping each while the probability mass kept *before* it is < top_p and
   fewer than top_k are kept; draw one of the kept tokens by probability;
2. if that token occurs in the stream's last `win_size` tokens at least
   `win_size * tau_r` times, forbid it and draw from the whole distribution.

Before either, while a stream is shorter than its minimum length, index
`speech_token_size` (6561) is forbidden; upstream masks exactly that index in
both versions (for CosyVoice 3 it is sos, not eos: other stop ids may still win).

Here the same rules run as tensor ops over [B, V]; each row draws by inverse
CDF. Greedy decoding is argmax after the same masking.

Randomness is per stream and counter-based: a stream's k-th token reads
uniforms that are a hash of (its seed, k), computed on the device for the
whole batch at once (`draw_uniforms`). So a stream samples the same tokens
whatever else shares its batch, and after preemption it resumes exactly where
it was; upstream's shared global generator gives neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class RasConfig:
    """RAS parameters, as the yaml's `llm.sampling` gives them."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.win_size < 1:
            raise ValueError(f"win_size must be >= 1, got {self.win_size}")
        if self.tau_r < 0:
            raise ValueError(f"tau_r must be >= 0, got {self.tau_r}")

    @classmethod
    def from_hparams(cls, sampling: Any) -> RasConfig:
        """From `hparams["llm"]["sampling"]` (a `!name:...ras_sampling` node); defaults if
        absent."""
        if not isinstance(sampling, dict):
            return cls()
        target = str(sampling.get("_target", ""))
        if target and not target.endswith("ras_sampling"):
            raise ValueError(f"expected llm.sampling to be ras_sampling, got {target}")
        defaults = cls()
        return cls(
            top_p=float(sampling.get("top_p", defaults.top_p)),
            top_k=int(sampling.get("top_k", defaults.top_k)),
            win_size=int(sampling.get("win_size", defaults.win_size)),
            tau_r=float(sampling.get("tau_r", defaults.tau_r)),
        )


_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # spreads consecutive draw indices over the hash's input
NUM_DRAWS = 2  # uniforms per token: the nucleus draw and the RAS fallback draw


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without int64 overflow.

    The constant is split in 16-bit halves so that no product exceeds 2**48.
    """
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (MurmurHash3's finalizer constants): [..] int64 -> [..] int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def draw_uniforms(
    seeds: Sequence[int], counters: Sequence[int], device: torch.device | str = "cpu",
    num_draws: int = NUM_DRAWS,
) -> torch.Tensor:
    """Uniforms in (0, 1) [B, num_draws] from each row's (seed, counter): a pure function of both.

    Seeds are any Python ints (taken mod 2**64); counters count a stream's tokens.
    """
    if len(seeds) != len(counters):
        raise ValueError(f"expected one counter per seed ({len(seeds)}), got {len(counters)}")
    words = torch.tensor([seed_words(s) for s in seeds], dtype=torch.long).reshape(-1, 2).to(device)
    return uniforms_of(words, torch.tensor(list(counters), dtype=torch.long).to(device), num_draws)


def seed_words(seed: int) -> tuple[int, int]:
    """A seed (any Python int, taken mod 2**64) as its low and high 32-bit words."""
    return seed & _MASK32, (seed >> 32) & _MASK32


def uniforms_of(words: torch.Tensor, counters: torch.Tensor,
                num_draws: int = NUM_DRAWS) -> torch.Tensor:
    """`draw_uniforms` from device tensors: seed words [B, 2] (`seed_words`), counters [B] (int64).

    No host value is read, so a CUDA graph can capture it (lm/graphs.py draws inside the step).
    """
    key = _mix32(words[:, 0] ^ _mix32(words[:, 1] ^ _mix32(counters & _MASK32)))  # [B]
    draws = torch.arange(1, num_draws + 1, device=words.device) * _GOLDEN32 & _MASK32  # [num_draws]
    bits = _mix32((key[:, None] + draws) & _MASK32)  # [B, num_draws]
    return ((bits >> 8).float() + 0.5) / float(1 << 24)  # 24 bits: exact in float32


def _categorical(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalized non-negative weights [B, N] with uniforms u [B] -> [B].

    Inverse CDF; `right=True` never lands on a zero-weight entry: its CDF equals its left
    neighbour's.
    """
    cdf = weights.float().cumsum(dim=-1)  # [B, N]
    index = torch.searchsorted(cdf, u.to(cdf.device)[:, None] * cdf[:, -1:], right=True)[:, 0]
    return index.clamp(max=cdf.shape[-1] - 1)


def mask_min_length(logp: torch.Tensor, below_min: torch.Tensor, index: int) -> torch.Tensor:
    """logp: [B, V]; rows where below_min [B] is true get -inf at `index` (a copy)."""
    masked = logp.clone()
    masked[:, index] = torch.where(below_min, float("-inf"), masked[:, index])
    return masked


def greedy(logp: torch.Tensor) -> torch.Tensor:
    """logp: [B, V] (already masked) -> [B] argmax, lowest index on ties."""
    return logp.argmax(dim=-1)


def nucleus_candidates(logp: torch.Tensor, config: RasConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's nucleus set: rank i is kept while the mass before it < top_p and i < top_k.

    logp [B, V] -> (weights [B, k], ids [B, k]); dropped candidates weigh 0.
    """
    probs = logp.float().softmax(dim=-1)
    k = min(config.top_k, probs.shape[-1])
    # Only the k most likely can be kept: topk instead of upstream's full stable
    # sort (the same set unless probabilities tie exactly at the k-th place).
    top_probs, top_ids = probs.topk(k, dim=-1, sorted=True)  # [B, k]
    # Mass kept before each rank, summed in rank order as upstream's loop does.
    mass_before = torch.cat(
        [torch.zeros_like(top_probs[:, :1]), top_probs.cumsum(dim=-1)[:, :-1]], dim=-1
    )
    keep = mass_before < config.top_p
    return torch.where(keep, top_probs, torch.zeros_like(top_probs)), top_ids


def nucleus(logp: torch.Tensor, config: RasConfig, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from the nucleus set with uniforms u [B]. [B, V] -> [B]."""
    weights, ids = nucleus_candidates(logp, config)
    choice = _categorical(weights, u)
    return ids.gather(1, choice[:, None])[:, 0]


def ras(
    logp: torch.Tensor, history: torch.Tensor, config: RasConfig, uniforms: torch.Tensor
) -> torch.Tensor:
    """Repetition-aware sampling for a batch.

    logp: [B, V] (already masked for min length); history: [B, W] the last
    `win_size` tokens of each stream, -1 where the stream is shorter;
    uniforms: [B, 2] (`draw_uniforms`), the nucleus draw then the fallback's.
    """
    first = nucleus(logp, config, uniforms[:, 0])  # [B]
    repeats = (history[:, -config.win_size :] == first[:, None]).sum(dim=-1)
    is_repeat = repeats >= config.win_size * config.tau_r  # [B]
    # Fallback: the full distribution without the repeated token.
    fallback_logp = logp.float().scatter(1, first[:, None], float("-inf"))
    fallback = _categorical(fallback_logp.softmax(dim=-1), uniforms[:, 1])
    return torch.where(is_repeat, fallback, first)


def sample_rows(
    logp: torch.Tensor,
    history: torch.Tensor,
    is_greedy: torch.Tensor,
    config: RasConfig,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """`sample_tokens` without a host sync (both choices computed, each row takes its own):
    the same tokens, and a CUDA graph can capture it."""
    return torch.where(is_greedy, greedy(logp), ras(logp, history, config, uniforms))


def sample_tokens(
    logp: torch.Tensor,
    history: torch.Tensor,
    is_greedy: torch.Tensor,
    config: RasConfig,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Per row greedy or RAS. logp [B, V], history [B, W], is_greedy [B], uniforms [B, 2] -> tokens
    [B]."""
    if bool(is_greedy.all()):
        return greedy(logp)
    sampled = ras(logp, history, config, uniforms)
    if not bool(is_greedy.any()):
        return sampled
    return torch.where(is_greedy, greedy(logp), sampled)
