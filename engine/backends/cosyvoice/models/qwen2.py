"""The Qwen2 decoder body of the CosyVoice speech LM, with a slot KV cache.

Module and parameter names follow Hugging Face's Qwen2ForCausalLM so that the
official `llm.pt` (keys `llm.model.model.layers.N.self_attn.q_proj.weight`,
...) loads with `strict=True`: RMSNorm, rotary embeddings (rotate-half form),
grouped-query attention with q/k/v biases, SwiGLU MLP, a final norm.

The KV cache is allocated once (gpt-fast style): per layer a key and a value
buffer of [max_batch, num_kv_heads, max_len, head_dim]. A "slot" is a row of
it, owned by one stream; `forward` writes the new keys/values of each row at
its own positions, so prefill (one slot, many tokens) and decode (many slots,
one token each) are the same call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError

# config.json keys without a default: every one must be present and positive.
_REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


@dataclass(slots=True)
class Qwen2Config:
    """The fields of CosyVoice-BlankEN/config.json that the body needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        for name in _REQUIRED_FIELDS:
            if int(getattr(self, name)) <= 0:
                raise ModelLoadError(
                    f"Qwen2 config: expected {name} > 0, got {getattr(self, name)}"
                )
        if self.hidden_size % self.num_attention_heads:
            raise ModelLoadError(
                f"Qwen2 config: expected hidden_size divisible by num_attention_heads "
                f"({self.num_attention_heads}), got {self.hidden_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"Qwen2 config: expected num_attention_heads divisible by num_key_value_heads "
                f"({self.num_key_value_heads}), got {self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Qwen2Config:
        if config.get("model_type", "qwen2") != "qwen2":
            raise ModelLoadError(
                f"Qwen2 config: expected model_type 'qwen2', got {config.get('model_type')!r}"
            )
        if config.get("rope_scaling"):
            raise ModelLoadError(
                f"Qwen2 config: expected rope_scaling null, got {config['rope_scaling']!r}"
            )
        try:
            return cls(
                **{
                    name: config[name]
                    for name in _REQUIRED_FIELDS
                },
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(config.get("rope_theta", 1_000_000.0)),
                max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            )
        except KeyError as exc:
            raise ModelLoadError(f"Qwen2 config: expected key {exc.args[0]!r}, got none") from exc


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 whatever the weights' dtype (as the reference does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_table(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim] in float32, halves repeated (rotate-half layout)."""
    # Built on the CPU explicitly, also when the module is constructed on "meta".
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    freqs = torch.outer(
        torch.arange(max_len, dtype=torch.float32, device="cpu"), inv_freq
    )  # [L, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [L, Dh]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, Dh]; cos/sin: [B, 1, T, Dh]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SlotKVCache(nn.Module):
    """Keys and values for every layer: [layers][max_batch, kv_heads, max_len, head_dim]."""

    def __init__(
        self,
        config: Qwen2Config,
        max_batch: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if max_batch <= 0 or max_len <= 0:
            raise ValueError(f"expected max_batch and max_len > 0, got {max_batch} and {max_len}")
        self.max_batch = max_batch
        self.max_len = max_len
        shape = (max_batch, config.num_key_value_heads, max_len, config.head_dim)
        for i in range(config.num_hidden_layers):
            self.register_buffer(
                f"k{i}", torch.zeros(shape, device=device, dtype=dtype), persistent=False
            )
            self.register_buffer(
                f"v{i}", torch.zeros(shape, device=device, dtype=dtype), persistent=False
            )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")


@dataclass(slots=True)
class CacheView:
    """Where one forward call reads and writes the cache.

    `slots` [B] cache rows; `positions` [B, T] absolute positions of the new
    tokens; `kv_len` how many cache positions attention reads (>= max position
    + 1); `row_range` (start, stop) when `slots` is a contiguous range, so reads
    are views instead of gathers.
    """

    cache: SlotKVCache
    slots: torch.Tensor
    positions: torch.Tensor
    kv_len: int
    row_range: tuple[int, int] | None = None


class Qwen2Attention(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        d, h, kv, dh = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, dh
        self.q_proj = nn.Linear(d, h * dh, bias=True)
        self.k_proj = nn.Linear(d, kv * dh, bias=True)
        self.v_proj = nn.Linear(d, kv * dh, bias=True)
        self.o_proj = nn.Linear(h * dh, d, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, view: CacheView, layer: int
    ) -> torch.Tensor:
        # x: [B, T, D]
        b, t, _ = x.shape
        q = (
            self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        )  # [B, H, T, Dh]
        k = (
            self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        )  # [B, KV, T, Dh]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache, v_cache = view.cache.layer(layer)
        rows = view.slots[:, None].expand(b, t)  # [B, T]
        k_cache[rows, :, view.positions] = k.transpose(1, 2).to(k_cache.dtype)  # [B, T, KV, Dh]
        v_cache[rows, :, view.positions] = v.transpose(1, 2).to(v_cache.dtype)
        if view.row_range is not None:
            start, stop = view.row_range
            keys, values = (
                k_cache[start:stop, :, : view.kv_len],
                v_cache[start:stop, :, : view.kv_len],
            )
        else:
            keys, values = (
                k_cache[view.slots, :, : view.kv_len],
                v_cache[view.slots, :, : view.kv_len],
            )
        # A query at position p sees keys 0..p of its own row: [B, 1, T, L]
        key_pos = torch.arange(view.kv_len, device=x.device)
        mask = (key_pos[None, None, :] <= view.positions[:, :, None])[:, None]
        scale = 1.0 / math.sqrt(self.head_dim)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if t == 1:
            # Decode: the G query heads sharing a KV head become G query rows of that head
            # ([B, KV, G, Dh]; head i reads KV head i // G), so attention needs no GQA
            # expansion of K and V and a fused masked kernel applies on a GPU (with
            # enable_gqa and a mask, CUDA falls back to the math path, which copies K and V
            # per query head in every layer). The one mask row serves all G rows.
            g = self.num_heads // self.num_kv_heads
            out = F.scaled_dot_product_attention(
                q.reshape(b, self.num_kv_heads, g, self.head_dim), keys, values, attn_mask=mask,
                scale=scale,
            ).reshape(b, self.num_heads, 1, self.head_dim)  # [B, H, 1, Dh]
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )  # [B, H, T, Dh]
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return projected


class Qwen2MLP(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(config)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, view: CacheView, layer: int
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, view, layer)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Qwen2Model(nn.Module):
    """embed_tokens, layers, norm: the `llm.model.model` of the checkpoint."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen2DecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen2ForCausalLM(nn.Module):
    """`llm.model` of the checkpoint. `lm_head` (text vocabulary) is loaded but never used:
    the speech LM reads the normed hidden state through its own decoder head."""

    rope_cos: torch.Tensor  # [max_position_embeddings, head_dim] float32
    rope_sin: torch.Tensor

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_rope()

    def reset_rope(self, device: torch.device | str = "cpu") -> None:
        """(Re)build the float32 rotary tables, e.g. after `.to(dtype)` rounded them."""
        cos, sin = rotary_table(
            self.config.head_dim, self.config.max_position_embeddings, self.config.rope_theta
        )
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def forward(self, embeds: torch.Tensor, view: CacheView) -> torch.Tensor:
        """embeds: [B, T, D] input embeddings -> [B, T, D] final-normed hidden states."""
        if view.kv_len > self.rope_cos.shape[0]:
            raise ValueError(
                f"expected positions below {self.rope_cos.shape[0]} (max_position_embeddings), "
                f"got {view.kv_len}"
            )
        cos = self.rope_cos[view.positions][:, None].to(embeds.dtype)  # [B, 1, T, Dh]
        sin = self.rope_sin[view.positions][:, None].to(embeds.dtype)
        x = embeds
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, view, i)
        normed: torch.Tensor = self.model.norm(x)
        return normed


class Qwen2Encoder(nn.Module):
    """The `llm` wrapper of upstream's checkpoint: keys start with `llm.model.`."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(config)
