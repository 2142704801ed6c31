"""Token encoders of the flow: speech tokens (25 Hz) -> mu, the mel-rate condition (50 Hz).

- `PreLookahead` (both versions): a residual pair of convolutions; the first
  sees the current token and `pre_lookahead_len` (3) future tokens, the second
  is causal. When a chunk is not final those future tokens are real tokens the
  LM already produced (the lookahead); at the end of the answer they are zeros.
- `UpsampleConformerEncoder` (CosyVoice 2): linear embed, pre-lookahead, N
  conformer blocks (relative-position self-attention, ESPnet flavour, swish
  feed-forward), a causal x2 upsampling convolution, a second linear embed and
  4 more conformer blocks; attention is chunked (25 tokens, then 50 frames)
  when streaming. Upstream hard-codes 512 channels in the lookahead and the
  upsampling layers and 4 up blocks; so do we.
- CosyVoice 3 has no conformer: mu is the pre-lookahead output repeated x2.

Inputs are right-padded batches with two lengths per row: `num_tokens` (every
token present, lookahead included) and `num_valid` (the tokens whose output is
wanted). Padded and lookahead-only positions are masked as attention keys, so
each row computes what it would alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.cosyvoice.models.flow_unet import chunk_attention_mask


def lengths_mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """lengths [B] -> [B, size] bool, True before each length."""
    return torch.arange(size, device=lengths.device)[None] < lengths[:, None]


class PreLookahead(nn.Module):
    def __init__(self, channels: int, hidden: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, hidden, lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] with zeros after each row's last present token -> [B, T, C]."""
        h = F.leaky_relu(self.conv1(F.pad(x.transpose(1, 2), (0, self.lookahead))))
        out: torch.Tensor = self.conv2(F.pad(h, (2, 0)))
        return out.transpose(1, 2) + x


def rel_position_embedding(size: int, dim: int, device: torch.device) -> torch.Tensor:
    """-> [1, 2*size-1, dim]: sin/cos (interleaved) of relative positions size-1 ... -(size-1)."""
    pos = torch.arange(size - 1, -size, -1, device=device, dtype=torch.float32)[:, None]
    div = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / dim))
    pe = torch.zeros(2 * size - 1, dim, device=device)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe[None]


class LinearEmbed(nn.Module):
    """Linear -> LayerNorm, scaled by sqrt(dim) (ESPnet rel-pos input layer adds no position)."""

    def __init__(self, cin: int, dim: int) -> None:
        super().__init__()
        self.out = nn.ModuleList([nn.Linear(cin, dim), nn.LayerNorm(dim, eps=1e-5)])
        self.scale = math.sqrt(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out[1](self.out[0](x))
        return out * self.scale


class RelPosAttention(nn.Module):
    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.h, self.d_k = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # mask: [B, T, T] bool; pos: [1, 2T-1, D]
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos).view(1, -1, self.h, self.d_k).transpose(1, 2)  # [1, H, 2T-1, dk]
        ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        # [B, H, T, 2T-1]
        bd = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
        # relative shift: score(i, j) uses the embedding of distance i - j, at column T-1-i+j
        i = torch.arange(t, device=x.device)
        cols = (t - 1 - i[:, None] + i[None, :]).expand(b, self.h, t, t)
        bd = torch.gather(bd, 3, cols)
        scores = (ac + bd) / math.sqrt(self.d_k)
        masked = ~mask[:, None]
        attn = torch.softmax(scores.masked_fill(masked, -math.inf), dim=-1).masked_fill(masked, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, -1)
        proj: torch.Tensor = self.linear_out(out)
        return proj


class FeedForward(nn.Module):
    def __init__(self, dim: int, units: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, units)
        self.w_2 = nn.Linear(units, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w_2(F.silu(self.w_1(x)))
        return out


class ConformerLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + ffn(norm(x)) (no macaron, no convolution module)."""

    def __init__(self, dim: int, heads: int, units: int) -> None:
        super().__init__()
        self.self_attn = RelPosAttention(heads, dim)
        self.feed_forward = FeedForward(dim, units)
        self.norm_ff = nn.LayerNorm(dim, eps=1e-12)
        self.norm_mha = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos)
        out: torch.Tensor = x + self.feed_forward(self.norm_ff(x))
        return out


class UpLayer(nn.Module):
    """x2 nearest-neighbour upsampling, then a causal convolution (k=5) over the result."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, C] -> [B, 2T, C]
        h = x.repeat_interleave(2, dim=1).transpose(1, 2)
        out: torch.Tensor = self.conv(F.pad(h, (4, 0)))
        return out.transpose(1, 2)


class UpsampleConformerEncoder(nn.Module):
    CHANNELS = 512  # hard-coded upstream in the lookahead and upsampling layers
    NUM_UP_BLOCKS = 4

    def __init__(self, input_size: int, output_size: int, heads: int, units: int, num_blocks: int,
                 static_chunk_size: int, lookahead: int = 3) -> None:
        super().__init__()
        if output_size != self.CHANNELS:
            raise ValueError(f"expected encoder output_size {self.CHANNELS} (fixed upstream), got "
                             f"{output_size}")
        self.dim = output_size
        self.static_chunk_size = static_chunk_size
        self.embed = LinearEmbed(input_size, output_size)
        self.pre_lookahead_layer = PreLookahead(self.CHANNELS, self.CHANNELS, lookahead)
        self.encoders = nn.ModuleList([ConformerLayer(output_size, heads, units)
                                       for _ in range(num_blocks)])
        self.up_layer = UpLayer(self.CHANNELS)
        self.up_embed = LinearEmbed(input_size, output_size)
        self.up_encoders = nn.ModuleList([ConformerLayer(output_size, heads, units)
                                          for _ in range(self.NUM_UP_BLOCKS)])
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)

    @classmethod
    def from_hparams(cls, enc: dict[str, Any], lookahead: int) -> UpsampleConformerEncoder:
        for key, want in (("input_layer", "linear"), ("pos_enc_layer_type", "rel_pos_espnet"),
                          ("selfattention_layer_type", "rel_selfattn"), ("use_cnn_module", False),
                          ("macaron_style", False), ("normalize_before", True)):
            if enc.get(key, want) != want:
                raise ValueError(f"expected encoder {key}={want!r} (as released), got "
                                 f"{enc.get(key)!r}")
        return cls(int(enc["input_size"]), int(enc["output_size"]), int(enc["attention_heads"]),
                   int(enc["linear_units"]), int(enc["num_blocks"]), int(enc["static_chunk_size"]),
                   lookahead)

    def _run(self, layers: nn.ModuleList, x: torch.Tensor, valid: torch.Tensor, chunk: int,
             streaming: bool) -> torch.Tensor:
        mask = chunk_attention_mask(valid, chunk, streaming)
        pos = rel_position_embedding(x.shape[1], self.dim, x.device).to(x.dtype)
        for layer in layers:
            x = layer(x, mask, pos)
        return x

    def forward(self, x: torch.Tensor, num_tokens: torch.Tensor, num_valid: torch.Tensor,
                streaming: bool) -> torch.Tensor:
        """x [B, T, C] token embeddings -> [B, 2T, C]; rows valid up to 2 * num_valid."""
        t = x.shape[1]
        h = self.embed(x) * lengths_mask(num_tokens, t)[:, :, None].to(x)
        h = self.pre_lookahead_layer(h)
        h = self._run(self.encoders, h, lengths_mask(num_valid, t), self.static_chunk_size,
                      streaming)
        h = self.up_embed(self.up_layer(h))
        h = self._run(self.up_encoders, h, lengths_mask(2 * num_valid, 2 * t),
                      2 * self.static_chunk_size, streaming)
        out: torch.Tensor = self.after_norm(h)
        return out
