"""CosyVoice 2's flow-matching estimator: a causal 1-D U-Net with transformer blocks.

Upstream `CausalConditionalDecoder` (cosyvoice/flow/decoder.py, built on
Matcha-TTS's decoder components): the input is [x, mu, spk, cond] stacked on
channels (4 x 80 = 320), a sinusoidal time embedding drives every resnet block,
convolutions are causal, and attention is either full (offline) or chunked
(streaming: frame i sees every frame before the end of its 50-frame chunk).

Padding is exact: convolutions are causal and masked, attention masks padded
keys, so a batch of right-padded streams gives each stream its own output.
Attribute names follow upstream's so `flow.pt` loads with strict=True.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn


def chunk_attention_mask(valid: torch.Tensor, chunk: int, streaming: bool) -> torch.Tensor:
    """valid [B, T] bool -> [B, T, T] bool: key j visible from query i.

    Streaming: j < (i // chunk + 1) * chunk (upstream subsequent_chunk_mask, all left chunks).
    """
    b, t = valid.shape
    keys = valid[:, None, :].expand(b, t, t)
    if not streaming or chunk <= 0:
        return keys
    pos = torch.arange(t, device=valid.device)
    limit = (pos // chunk + 1) * chunk
    return keys & (pos[None, :] < limit[:, None])[None]


def timestep_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """t [B] -> [B, dim] float32: sin then cos of scale * t at geometric frequencies (Matcha-TTS).

    Formed in float32 whatever t's dtype (1000 t in bf16 is off by up to 0.87 rad);
    the caller casts the result to its weights' dtype."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = scale * t.float()[:, None] * freqs[None]
    return torch.cat([arg.sin(), arg.cos()], dim=-1)


class CausalConv1d(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))
        return out


class CausalBlock1D(nn.Module):
    """conv (causal, k=3) -> LayerNorm over channels -> Mish, masked before and after."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        # index 0: conv, 2: LayerNorm (upstream's Sequential has Transpose at 1 and 3, Mish at 4)
        self.block = nn.ModuleDict({"0": CausalConv1d(cin, cout, 3), "2": nn.LayerNorm(cout)})

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.block["0"](x * mask)
        h = self.block["2"](h.transpose(1, 2)).transpose(1, 2)
        return F.mish(h) * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, cin: int, cout: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.ModuleDict({"1": nn.Linear(time_dim, cout)})
        self.block1 = CausalBlock1D(cin, cout)
        self.block2 = CausalBlock1D(cout, cout)
        self.res_conv = nn.Conv1d(cin, cout, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.block1(x, mask) + self.mlp["1"](F.mish(t))[:, :, None]
        out: torch.Tensor = self.block2(h, mask) + self.res_conv(x * mask)
        return out


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x: [B, T, D]
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2)
                   for p in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        proj: torch.Tensor = self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))
        return proj


class GeluProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net[2](self.net[0](x))
        return out


class TimeMLP(nn.Module):
    def __init__(self, cin: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cin, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_2(F.silu(self.linear_1(t)))
        return out


class TransformerBlock(nn.Module):
    """Pre-norm self-attention then a GELU feed-forward (diffusers BasicTransformerBlock)."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, dim_head)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), mask)
        out: torch.Tensor = x + self.ff(self.norm3(x))
        return out


class UNetEstimator(nn.Module):
    """(x, mask, mu, t, spks, cond) -> velocity [B, 80, T]."""

    def __init__(self, in_channels: int, out_channels: int, channels: list[int],
                 attention_head_dim: int,
                 n_blocks: int, num_mid_blocks: int, num_heads: int,
                 static_chunk_size: int) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.static_chunk_size = static_chunk_size
        time_dim = channels[0] * 4
        self.time_mlp = TimeMLP(in_channels, time_dim)

        def blocks(dim: int) -> nn.ModuleList:
            return nn.ModuleList([TransformerBlock(dim, num_heads, attention_head_dim)
                                  for _ in range(n_blocks)])

        self.down_blocks = nn.ModuleList()
        cout = in_channels
        for i, ch in enumerate(channels):
            cin, cout = cout, ch
            last = i == len(channels) - 1
            down: nn.Module = (CausalConv1d(cout, cout, 3) if last
                               else nn.Conv1d(cout, cout, 3, 2, 1))
            self.down_blocks.append(nn.ModuleList([CausalResnetBlock1D(cin, cout, time_dim),
                                                   blocks(cout), down]))
        self.mid_blocks = nn.ModuleList([
            nn.ModuleList([CausalResnetBlock1D(channels[-1], channels[-1], time_dim),
                           blocks(channels[-1])])
            for _ in range(num_mid_blocks)
        ])
        ups = channels[::-1] + [channels[0]]
        self.up_blocks = nn.ModuleList()
        for i in range(len(ups) - 1):
            cout = ups[i + 1]
            last = i == len(ups) - 2
            up: nn.Module = (CausalConv1d(cout, cout, 3) if last
                             else nn.ConvTranspose1d(cout, cout, 4, 2, 1))
            self.up_blocks.append(nn.ModuleList([CausalResnetBlock1D(2 * ups[i], cout, time_dim),
                                                 blocks(cout), up]))
        self.final_block = CausalBlock1D(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], out_channels, 1)

    @classmethod
    def from_hparams(cls, est: dict[str, Any]) -> UNetEstimator:
        return cls(int(est["in_channels"]), int(est["out_channels"]),
                   [int(c) for c in est["channels"]],
                   int(est["attention_head_dim"]), int(est["n_blocks"]), int(est["num_mid_blocks"]),
                   int(est["num_heads"]), int(est["static_chunk_size"]))

    def _attend(self, x: torch.Tensor, mask: torch.Tensor, blocks: nn.ModuleList,
                streaming: bool) -> torch.Tensor:
        attn_mask = chunk_attention_mask(mask[:, 0].bool(), self.static_chunk_size, streaming)
        h = x.transpose(1, 2)
        for block in blocks:
            h = block(h, attn_mask)
        out: torch.Tensor = h.transpose(1, 2)
        return out

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        # x, mu, cond: [B, 80, T]; mask: [B, 1, T]; t: [B]; spks: [B, 80]
        temb = self.time_mlp(
            timestep_embedding(t, self.in_channels).to(self.time_mlp.linear_1.weight.dtype))
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[2]), cond], dim=1)
        hiddens, masks = [], [mask]
        for level in self.down_blocks:
            resnet, blocks, down = cast(nn.ModuleList, level)
            m = masks[-1]
            h = self._attend(resnet(h, m, temb), m, cast(nn.ModuleList, blocks), streaming)
            hiddens.append(h)
            h = down(h * m)
            masks.append(m[:, :, ::2])
        masks = masks[:-1]
        for level in self.mid_blocks:
            resnet, blocks = cast(nn.ModuleList, level)
            h = self._attend(resnet(h, masks[-1], temb), masks[-1], cast(nn.ModuleList, blocks),
                             streaming)
        for level in self.up_blocks:
            resnet, blocks, up = cast(nn.ModuleList, level)
            m, skip = masks.pop(), hiddens.pop()
            h = torch.cat([h[:, :, : skip.shape[2]], skip], dim=1)
            h = self._attend(resnet(h, m, temb), m, cast(nn.ModuleList, blocks), streaming)
            h = up(h * m)
        h = self.final_block(h, m)
        out: torch.Tensor = self.final_proj(h * m) * mask
        return out
