"""CosyVoice 3's flow-matching estimator: a DiT (F5-TTS style) with adaptive layer norm.

Upstream `cosyvoice/flow/DiT/dit.py`: [x, cond, mu, spk] (4 x 80) projected to
`dim`, plus a causal grouped-convolution position embedding; `depth` blocks of
AdaLN-Zero self-attention and a tanh-GELU feed-forward, both modulated by the
time embedding; rotary position embedding applied to the first `dim_head`
channels of q and k only (x-transformers' partial rotary on the un-split
projection, which is what the checkpoints were trained with).

Attention is full offline and chunked when streaming (50-frame chunks). Right
padding is exact: the position convolutions are causal and padded keys are
masked.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.cosyvoice.models.flow_unet import chunk_attention_mask


def sinus_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """t [B] -> [B, dim] float32. The argument is 1000 t: in bf16 it would be off by up to 0.87 rad,
    so it is formed in float32 (the caller casts the result to its weights' dtype)."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = scale * t.float()[:, None] * freqs[None]
    return torch.cat([arg.sin(), arg.cos()], dim=-1)


class Rope(NamedTuple):
    """One pass's rotary tables, [T, d] float32.

    Rotating pairs, (h0, h1, ...) -> (-h1, h0, ...), then multiplying by sin
    equals h[..., swap] * signed_sin.
    """

    cos: torch.Tensor
    signed_sin: torch.Tensor  # -sin on even channels, +sin on odd ones
    swap: torch.Tensor  # [d] long: (1, 0, 3, 2, ...)


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self._inv_freq(None))  # the default device (meta in tests)

    def _inv_freq(self, device: torch.device | None) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim))

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        # a cast to bf16 would round the frequencies (the angles then drift with position):
        # the table is remade in float32 on whatever device the cast left it
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if self.inv_freq.device.type != "meta" and self.inv_freq.dtype != torch.float32:
            self.inv_freq = self._inv_freq(self.inv_freq.device)
        elif self.inv_freq.dtype != torch.float32:
            self.inv_freq = self.inv_freq.float()
        return self

    def forward(self, seq_len: int) -> torch.Tensor:
        """-> freqs [T, dim] in float32 (whatever the model's dtype), each repeated for its pair."""
        inv_freq = self.inv_freq.float()
        t = torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None]
        return freqs.repeat_interleave(2, dim=-1)

    def tables(self, seq_len: int) -> Rope:
        return self._tables(self(seq_len))

    def tables_at(self, positions: torch.Tensor) -> Rope:
        """The tables at given absolute positions [R, T] (long) -> cos, signed_sin [R, T, d]: a
        chunk of each row at its own place in its sequence (models/flow_dit_chunk.py)."""
        inv_freq = self.inv_freq.float()
        freqs = positions.float()[..., None] * inv_freq
        return self._tables(freqs.repeat_interleave(2, dim=-1))

    def _tables(self, freqs: torch.Tensor) -> Rope:
        sign = torch.ones(freqs.shape[-1], device=freqs.device)
        sign[0::2] = -1.0
        swap = torch.arange(freqs.shape[-1], device=freqs.device).view(-1, 2).flip(-1).flatten()
        return Rope(freqs.cos(), freqs.sin() * sign, swap)


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x [B, T, inner]: rotate the first d channels (in float32), leave the rest.

    h * cos + (-h1, h0, -h3, h2, ...) * sin, as h * cos + h[swap] * signed_sin:
    two kernels fewer than negating and stacking pairs, and float32 by promotion
    without a cast of its own. Writes the rotated channels into x itself,
    which must be a fresh projection nothing else reads: the alternative, a cat
    of the head with the rest, copies the whole tensor (44 full copies a pass,
    9% of a pass's time on an H200 at 128 streams). An export traces the cat
    instead, so the ONNX graph stays functional.
    """
    d = rope.cos.shape[-1]
    head = x[..., :d]
    rotated = torch.addcmul(head * rope.cos, head.index_select(-1, rope.swap), rope.signed_sin)
    if torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export():
        return torch.cat([rotated.to(x.dtype), x[..., d:]], dim=-1)
    x[..., :d] = rotated
    return x


class AdaNorm(nn.Module):
    """LayerNorm without affine, modulated by `linear(silu(t))` split into `n` chunks."""

    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * n)
        self.n = n

    def chunks(self, silu_t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """silu_t: silu of the time embedding [B, dim], taken once a pass by the caller."""
        emb: torch.Tensor = self.linear(silu_t)
        return tuple(c[:, None] for c in emb.chunk(self.n, dim=1))


def norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """norm(x) * (1 + scale) + shift, in one pass over x after the norm (scale, shift: [B, 1,
    D])."""
    return torch.addcmul(shift, norm(x), 1 + scale)


class DiTAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q, k, v [B, H, T, dh], q and k rotated."""
        b, t, _ = x.shape
        q = apply_rotary(self.to_q(x), rope)
        k = apply_rotary(self.to_k(x), rope)
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (q, k, self.to_v(x)))
        return q, k, v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, T, dh] -> [B, T, D]."""
        b, _, t, _ = out.shape
        return cast(torch.Tensor, self.to_out[0](out.transpose(1, 2).reshape(b, t, -1)))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: Rope,
                hidden: torch.Tensor) -> torch.Tensor:
        # mask: [B, T, T] bool; hidden [B, T, 1]: keys invisible from the last query
        q, k, v = self.qkv(x, rope)
        out = self.project_out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]))
        # upstream zeroes outputs at keys invisible from the last query (padding)
        return out.masked_fill(hidden, 0.0)


class DiTFeedForward(nn.Module):
    """Linear -> tanh-GELU -> Linear, laid out as upstream's `ff.ff.0.0` / `ff.ff.2`."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.ff = nn.ModuleList([nn.ModuleList([nn.Linear(dim, inner)]), nn.Identity(),
                                 nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        project_in = cast(nn.ModuleList, self.ff[0])[0]
        out: torch.Tensor = self.ff[2](F.gelu(project_in(x), approximate="tanh"))
        return out


class TimeEmbed(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.ModuleList([nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim)])

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        first = cast(nn.Linear, self.time_mlp[0])
        h = sinus_embedding(t, self.freq_dim).to(first.weight.dtype)
        for layer in self.time_mlp:
            h = layer(h)
        return h


class InputEmbed(nn.Module):
    def __init__(self, cin: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(cin, dim)
        self.conv_pos_embed = CausalPosConv(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.proj(x)
        pos: torch.Tensor = self.conv_pos_embed(h)
        return pos + h


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int) -> None:
        super().__init__()
        self.attn_norm = AdaNorm(dim, 6)
        self.attn = DiTAttention(dim, heads, dim_head)
        self.ff = DiTFeedForward(dim, dim * ff_mult)

    def forward(self, x: torch.Tensor, silu_t: torch.Tensor, mask: torch.Tensor, rope: Rope,
                hidden: torch.Tensor) -> torch.Tensor:
        # Each elementwise step is a pass over [B, T, D]; on the GPU these passes, not the
        # matrix products, took two thirds of a pass at 128 streams: addcmul does a
        # multiply and an add in one.
        (shift_msa, scale_msa, gate_msa,
         shift_mlp, scale_mlp, gate_mlp) = self.attn_norm.chunks(silu_t)
        x = torch.addcmul(x, gate_msa,
                          self.attn(modulate(x, scale_msa, shift_msa), mask, rope, hidden))
        h: torch.Tensor = self.ff(modulate(x, scale_mlp, shift_mlp))
        return torch.addcmul(x, gate_mlp, h)


class CausalPosConv(nn.Module):
    """Two grouped causal convolutions (k=31, 16 groups) with Mish: a learned relative position
    signal."""

    def __init__(self, dim: int, kernel: int = 31, groups: int = 16) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv1 = nn.ModuleList([nn.Conv1d(dim, dim, kernel, groups=groups)])
        self.conv2 = nn.ModuleList([nn.Conv1d(dim, dim, kernel, groups=groups)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, D]
        h = x.transpose(1, 2)
        h = F.mish(self.conv1[0](F.pad(h, (self.kernel - 1, 0))))
        h = F.mish(self.conv2[0](F.pad(h, (self.kernel - 1, 0))))
        return h.transpose(1, 2)


class DiTEstimator(nn.Module):
    """(x, mask, mu, t, spks, cond) -> velocity [B, 80, T]."""

    def __init__(self, dim: int, depth: int, heads: int, dim_head: int, ff_mult: int, mel_dim: int,
                 mu_dim: int, spk_dim: int, static_chunk_size: int) -> None:
        super().__init__()
        self.static_chunk_size = static_chunk_size
        self.time_embed = TimeEmbed(dim)
        self.input_embed = InputEmbed(mel_dim * 2 + mu_dim + spk_dim, dim)
        self.rotary_embed = RotaryEmbedding(dim_head)
        self.transformer_blocks = nn.ModuleList([DiTBlock(dim, heads, dim_head, ff_mult)
                                                 for _ in range(depth)])
        self.norm_out = AdaNorm(dim, 2)
        self.proj_out = nn.Linear(dim, mel_dim)

    @classmethod
    def from_hparams(cls, est: dict[str, Any]) -> DiTEstimator:
        if est.get("long_skip_connection"):
            raise ValueError("expected a DiT without long_skip_connection (as released), got one")
        mel = int(est.get("mel_dim", 80))
        return cls(int(est["dim"]), int(est.get("depth", 8)), int(est.get("heads", 8)),
                   int(est.get("dim_head", 64)), int(est.get("ff_mult", 4)), mel,
                   int(est.get("mu_dim") or mel), int(est.get("spk_dim") or 0),
                   int(est.get("static_chunk_size", 50)))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        # x, mu, cond: [B, 80, T]; mask: [B, 1, T]; t: [B]; spks: [B, 80]
        temb = self.time_embed(t)
        seq = x.shape[2]
        h = self.input_embed(torch.cat([x, cond, mu, spks[:, :, None].expand(-1, -1, seq)],
                                       dim=1).transpose(1, 2))
        # what every block shares, made once a pass: each small kernel costs a launch, and
        # an eager pass at serving sizes is bound by its launches (docs/benchmarks.md,
        # "Flow estimator pass")
        rope = self.rotary_embed.tables(seq)
        attn_mask = chunk_attention_mask(mask[:, 0].bool(), self.static_chunk_size, streaming)
        hidden = ~attn_mask[:, -1, :, None]
        silu_t = F.silu(temb)
        for block in self.transformer_blocks:
            h = block(h, silu_t, attn_mask, rope, hidden)
        scale, shift = self.norm_out.chunks(silu_t)
        out: torch.Tensor = self.proj_out(modulate(h, scale, shift))
        return out.transpose(1, 2)
