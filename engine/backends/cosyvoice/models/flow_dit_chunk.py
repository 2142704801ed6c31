"""CosyVoice 3's flow over ONE 50-frame chunk per row, reading the past from a cache.

Why a chunk is enough (the DiT streams chunk-causally, models/flow_dit.py):
- attention: frame i sees every frame before the end of its 50-frame chunk
  (chunks counted from frame 0 of prompt + answer), so a chunk's queries need
  the keys and values of the earlier chunks, per (Euler step, layer, CFG row),
  and those never change once their chunk is computed;
- the position convolutions (two, kernel 31) look only left: a chunk needs the
  last 30 frames of each one's input from the chunk before it, per step and row;
- the noise and the rotary angles are indexed by the absolute frame.

`chunk_velocity` is the estimator's pass over such a chunk: the same modules
and weights as `DiTEstimator.forward`, with attention handed to an `attend`
callable (the cache: flow_runtime/solve_graphs.py writes the chunk's keys and
values, then attends over the cached ones and its own).

`chunk_mu` is the token condition of a chunk (25 tokens -> 50 frames) from a
window of 30 tokens: 2 before the chunk, because the pre-lookahead's second
convolution is causal over 3 outputs of its first, and 3 after it, the first
convolution's lookahead. So the mu of a whole chunk is final once its 3
lookahead tokens exist, which is what a non-final chunk waits for anyway. At
the start of a sequence the 2 missing outputs of the first convolution are the
zero padding upstream applies (`first_valid` = 2), not the convolution of
absent tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine.backends.cosyvoice.models.flow_dit import (
    CausalPosConv,
    DiTBlock,
    DiTEstimator,
    Rope,
    modulate,
)
from engine.backends.cosyvoice.models.flow_encoder import PreLookahead

CHUNK_TOKENS = 25  # upstream static_chunk_size (50 frames) at 2 frames per token
LEFT_TOKENS = 2  # the pre-lookahead's causal second convolution (kernel 3) looks 2 outputs back
WINDOW_TOKENS = LEFT_TOKENS + CHUNK_TOKENS + 3  # + the first convolution's lookahead


class Attend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        """q, k, v [R, H, C, dh] of one layer's chunk -> attention output [R, H, C, dh]."""
        ...


def pos_conv_chunk(conv: CausalPosConv, h: torch.Tensor, tail1: torch.Tensor, tail2: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [R, C, D] after the chunk's left context tails [R, W, D] (W = kernel - 1) of each
    convolution's input -> (position signal [R, C, D], the next chunk's two tails)."""
    w = conv.kernel - 1
    a = torch.cat([tail1, h], dim=1)  # [R, W + C, D]
    h1 = F.mish(conv.conv1[0](a.transpose(1, 2))).transpose(1, 2)  # [R, C, D]
    b = torch.cat([tail2, h1], dim=1)
    h2 = F.mish(conv.conv2[0](b.transpose(1, 2))).transpose(1, 2)
    return h2, a[:, -w:], b[:, -w:]


def block_chunk(block: DiTBlock, x: torch.Tensor, silu_t: torch.Tensor, rope: Rope,
                attend: Attend, layer: int) -> torch.Tensor:
    """DiTBlock.forward with its attention over the cache (x [R, C, D])."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.attn_norm.chunks(silu_t)
    q, k, v = block.attn.qkv(modulate(x, scale_msa, shift_msa), rope)
    x = torch.addcmul(x, gate_msa, block.attn.project_out(attend(layer, q, k, v)))
    h: torch.Tensor = block.ff(modulate(x, scale_mlp, shift_mlp))
    return torch.addcmul(x, gate_mlp, h)


def chunk_velocity(dit: DiTEstimator, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor,
                   spks: torch.Tensor, t: torch.Tensor, rope: Rope,
                   tails: tuple[torch.Tensor, torch.Tensor],
                   attend: Attend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Euler step's velocity of a chunk per row.

    x, cond, mu: [R, 80, C]; spks: [R, 80]; t: [1] (every row is at the same time);
    rope: the rows' tables at their absolute frames ([R, C, d]); tails: [R, W, D] each.
    -> (v [R, 80, C], next tail of each position convolution).
    """
    silu_t = F.silu(dit.time_embed(t))  # [1, D]: broadcast over the rows
    seq = x.shape[2]
    h = dit.input_embed.proj(torch.cat([x, cond, mu, spks[:, :, None].expand(-1, -1, seq)],
                                       dim=1).transpose(1, 2))
    pos, tail1, tail2 = pos_conv_chunk(dit.input_embed.conv_pos_embed, h, *tails)
    h = pos + h
    for i, block in enumerate(dit.transformer_blocks):
        h = block_chunk(block, h, silu_t, rope, attend, i)  # type: ignore[arg-type]
    scale, shift = dit.norm_out.chunks(silu_t)
    out: torch.Tensor = dit.proj_out(modulate(h, scale, shift))
    return out.transpose(1, 2), tail1, tail2


def chunk_mu(embedding: torch.nn.Embedding, pre_lookahead: PreLookahead, tokens: torch.Tensor,
             present: torch.Tensor, first_valid: torch.Tensor) -> torch.Tensor:
    """The condition of one 25-token chunk per row: [R, 80, 50].

    tokens [R, 30] long: the tokens at chunk start - 2 ... chunk end + 3 (any value where absent);
    present [R, 30] bool: the token exists (absent ones embed as zeros, as past the end of an
        answer);
    first_valid [R, 1] long: 2 at the start of a sequence (no tokens before it), else 0.
    """
    dtype = embedding.weight.dtype
    keep = present.to(dtype)[:, :, None]
    x = embedding(tokens.clamp(min=0) * present) * keep  # [R, 30, C]
    h = F.leaky_relu(pre_lookahead.conv1(F.pad(x.transpose(1, 2), (0, pre_lookahead.lookahead))))
    index = torch.arange(tokens.shape[1], device=tokens.device)[None]
    # upstream's zero left padding at a sequence start
    h = h * (index >= first_valid).to(dtype)[:, None]
    out = pre_lookahead.conv2(h)[:, :, :CHUNK_TOKENS]  # tokens chunk start ... + 24
    mu: torch.Tensor = out.transpose(1, 2) + x[:, LEFT_TOKENS:LEFT_TOKENS + CHUNK_TOKENS]
    return mu.repeat_interleave(2, dim=1).transpose(1, 2)
