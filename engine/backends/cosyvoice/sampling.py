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
CDF with one uniform from a generator shared by the batch. Greedy decoding is argmax after the same masking.
"""

from __future__ import annotations

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
        """From `hparams["llm"]["sampling"]` (a `!name:...ras_sampling` node); defaults if absent."""
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


def _categorical(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from unnormalized non-negative weights [B, N] -> [B] (inverse CDF).

    `right=True` never lands on a zero-weight entry: its CDF equals its left neighbour's.
    """
    cdf = weights.float().cumsum(dim=-1)  # [B, N]
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
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


def nucleus(
    logp: torch.Tensor, config: RasConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """One draw per row from the nucleus set. [B, V] -> [B]."""
    weights, ids = nucleus_candidates(logp, config)
    choice = _categorical(weights, generator)
    return ids.gather(1, choice[:, None])[:, 0]


def ras(
    logp: torch.Tensor, history: torch.Tensor, config: RasConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """Repetition-aware sampling for a batch.

    logp: [B, V] (already masked for min length); history: [B, W] the last
    `win_size` tokens of each stream, -1 where the stream is shorter.
    """
    first = nucleus(logp, config, generator)  # [B]
    repeats = (history[:, -config.win_size :] == first[:, None]).sum(dim=-1)
    is_repeat = repeats >= config.win_size * config.tau_r  # [B]
    # Fallback: the full distribution without the repeated token.
    fallback_logp = logp.float().scatter(1, first[:, None], float("-inf"))
    fallback = _categorical(fallback_logp.softmax(dim=-1), generator)
    return torch.where(is_repeat, fallback, first)


def sample_tokens(
    logp: torch.Tensor,
    history: torch.Tensor,
    is_greedy: torch.Tensor,
    config: RasConfig,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Per row greedy or RAS. logp [B, V], history [B, W], is_greedy [B] -> tokens [B]."""
    if bool(is_greedy.all()):
        return greedy(logp)
    sampled = ras(logp, history, config, generator)
    if not bool(is_greedy.any()):
        return sampled
    return torch.where(is_greedy, greedy(logp), sampled)
