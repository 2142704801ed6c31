"""Conditional flow matching: speech tokens + voice prompt -> 80-bin mel at 50 Hz.

One call computes the mel of a whole token sequence laid out as upstream's
`flow.inference` does: [prompt tokens | speech tokens | lookahead tokens]. The
prompt's mel conditions the first frames (`cond`), the x-vector conditions all
(`spks`), and the ODE from fixed noise to mel is solved with Euler steps on a
cosine time schedule with classifier-free guidance (an unconditioned copy of
each row with mu, spks and cond zeroed; v = (1 + r) v_cond - r v_uncond).

`FlowModel.infer` runs many such sequences (different streams, different
lengths, some with lookahead and some final) as one right-padded batch; each
row gets exactly what it would get alone (tests/unit/engine/cosyvoice/test_flow.py).

The fixed noise is upstream's: torch.manual_seed(0), randn([1, 80, 15000]),
indexed by the absolute mel frame, so a stream's frames see the same noise
whether computed offline or chunk by chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.cosyvoice.models.flow_dit import DiTEstimator
from engine.backends.cosyvoice.models.flow_encoder import (
    PreLookahead,
    UpsampleConformerEncoder,
    lengths_mask,
)
from engine.backends.cosyvoice.models.flow_unet import UNetEstimator
from engine.errors import ModelLoadError

NOISE_FRAMES = 15000  # upstream CausalConditionalCFM.rand_noise: 300 s at 50 frames/s


def fixed_noise() -> torch.Tensor:
    """Upstream's flow noise [80, 15000] (seed 0), without touching the global RNG."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, 80, NOISE_FRAMES, generator=gen)[0]


@dataclass(slots=True)
class FlowRow:
    """One sequence for the flow.

    tokens: [N] int64, prompt tokens then speech tokens then `num_lookahead` lookahead tokens.
    prompt_mel: [P, 80] mel of the prompt (P frames condition the start; usually 2 x prompt tokens).
    embedding: [192] speaker x-vector (unnormalized; normalized here as upstream).
    noise_index: [2 * (N - num_lookahead)] absolute noise frame per output frame (taken modulo the
        table's 15000 frames, so answers longer than upstream's 300 s limit keep going).
    """

    tokens: torch.Tensor
    prompt_mel: torch.Tensor
    embedding: torch.Tensor
    num_lookahead: int
    noise_index: torch.Tensor

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"expected tokens [N], got shape {tuple(self.tokens.shape)}")
        if not 0 <= self.num_lookahead < self.tokens.shape[0]:
            raise ValueError(f"expected 0 <= num_lookahead < {self.tokens.shape[0]}, got "
                             f"{self.num_lookahead}")
        frames = 2 * (self.tokens.shape[0] - self.num_lookahead)
        if self.noise_index.shape != (frames,):
            raise ValueError(
                f"expected noise_index [{frames}], got {tuple(self.noise_index.shape)}")
        mel = self.prompt_mel
        if mel.dim() != 2 or mel.shape[1] != 80 or mel.shape[0] > frames:
            raise ValueError(f"expected prompt_mel [P <= {frames}, 80], got "
                             f"{tuple(self.prompt_mel.shape)}")


class CFM(nn.Module):
    def __init__(self, estimator: nn.Module, n_timesteps: int, cfg_rate: float,
                 cosine: bool) -> None:
        super().__init__()
        self.estimator = estimator
        self.n_timesteps = n_timesteps
        self.cfg_rate = cfg_rate
        self.cosine = cosine

    def forward(self, z: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: bool) -> torch.Tensor:
        # z, mu, cond: [B, 80, T]; mask: [B, 1, T]; spks: [B, 80]  ->  mel [B, 80, T] float32
        # The ODE state and the time stay float32 whatever the estimator's dtype.
        t_span = torch.linspace(0, 1, self.n_timesteps + 1, device=mu.device, dtype=torch.float32)
        if self.cosine:
            t_span = 1 - torch.cos(t_span * 0.5 * math.pi)
        b = z.shape[0]
        mask2 = torch.cat([mask, mask])
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        spks2 = torch.cat([spks, torch.zeros_like(spks)])
        cond2 = torch.cat([cond, torch.zeros_like(cond)])
        x, t, dt = z.float(), t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            x_in = torch.cat([x, x]).to(mu.dtype)
            # t stays float32 into the estimator: its time embedding is formed in float32
            v = self.estimator(x_in, mask2, mu2, t.expand(2 * b), spks2, cond2, streaming).float()
            v_cond, v_uncond = v[:b], v[b:]
            x = x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x


class FlowModel(nn.Module):
    noise: torch.Tensor

    def __init__(self, version: int, flow: dict[str, Any]) -> None:
        super().__init__()
        self.version = version
        self.output_size = int(flow["output_size"])
        self.token_mel_ratio = int(flow["token_mel_ratio"])
        self.pre_lookahead_len = int(flow["pre_lookahead_len"])
        if self.token_mel_ratio != 2 or self.output_size != 80:
            raise ValueError("expected token_mel_ratio 2 and 80 mel bins, got "
                             f"{self.token_mel_ratio}, {self.output_size}")
        self.input_embedding = nn.Embedding(int(flow["vocab_size"]), int(flow["input_size"]))
        self.spk_embed_affine_layer = nn.Linear(int(flow["spk_embed_dim"]), self.output_size)
        dec = flow["decoder"]
        est = dec["estimator"]
        params = dec["cfm_params"].get("content", dec["cfm_params"])
        if params.get("solver", "euler") != "euler":
            raise ValueError(f"expected the euler solver, got {params.get('solver')!r}")
        if version == 2:
            self.encoder = UpsampleConformerEncoder.from_hparams(
                flow["encoder"], self.pre_lookahead_len)
            self.encoder_proj = nn.Linear(self.encoder.dim, self.output_size)
            estimator: nn.Module = UNetEstimator.from_hparams(est)
        else:
            pl = flow["pre_lookahead_layer"]
            self.pre_lookahead_layer = PreLookahead(int(pl["in_channels"]), int(pl["channels"]),
                                                    int(pl["pre_lookahead_len"]))
            estimator = DiTEstimator.from_hparams(est)
        # upstream flow.inference hard-codes 10 Euler steps
        self.decoder = CFM(estimator, 10, float(params["inference_cfg_rate"]),
                           params.get("t_scheduler") == "cosine")
        self.chunk_tokens = int(est.get("static_chunk_size", 50)) // self.token_mel_ratio
        self.register_buffer("noise", fixed_noise(), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> FlowModel:
        # keep the fixed noise float32 when the model is cast to a lower precision
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self.noise = self.noise.float()
        return self

    def encode(self, tokens: torch.Tensor, num_tokens: torch.Tensor, num_valid: torch.Tensor,
               streaming: bool) -> torch.Tensor:
        """tokens [B, T] (padded) -> mu [B, 80, 2T], valid up to 2 * num_valid."""
        present = lengths_mask(num_tokens, tokens.shape[1])
        emb: torch.Tensor = self.input_embedding(tokens.clamp(min=0) * present)
        x = emb * present[:, :, None].to(emb.dtype)
        if self.version == 2:
            h: torch.Tensor = self.encoder_proj(self.encoder(x, num_tokens, num_valid, streaming))
        else:
            h = self.pre_lookahead_layer(x).repeat_interleave(self.token_mel_ratio, dim=1)
        return h.transpose(1, 2)

    @torch.inference_mode()
    def infer(self, rows: list[FlowRow], streaming: bool) -> list[torch.Tensor]:
        """Mel [80, 2 * (N - num_lookahead)] for each row (prompt frames included), in one batch.

        Lengths are host integers (no device read-back); the padded tokens and
        noise indices are built on the host (pinned on a GPU) and go to the
        device in one non-blocking copy each; the noise is gathered for the
        whole batch at once. A row's prompt mel and x-vector live on the device
        already (voice_prompts.flow_prompt_of).
        """
        if not rows:
            return []
        dev, dtype = self.noise.device, self.spk_embed_affine_layer.weight.dtype
        lengths = [r.tokens.shape[0] for r in rows]
        valid = [n - r.num_lookahead for n, r in zip(lengths, rows, strict=True)]
        frames = [2 * v for v in valid]
        t_max, f_max, b = max(lengths), max(frames), len(rows)
        pin = dev.type == "cuda"
        host_tokens = torch.zeros(b, t_max, dtype=torch.long, pin_memory=pin)
        host_noise = torch.zeros(b, f_max, dtype=torch.long, pin_memory=pin)
        for i, r in enumerate(rows):
            host_tokens[i, : lengths[i]] = r.tokens
            host_noise[i, : frames[i]] = r.noise_index % NOISE_FRAMES
        tokens = host_tokens.to(dev, non_blocking=True)
        noise_index = host_noise.to(dev, non_blocking=True)
        num_tokens = torch.tensor(lengths, device=dev)
        num_valid = torch.tensor(valid, device=dev)
        mu = self.encode(tokens, num_tokens, num_valid, streaming)[:, :, :f_max]
        frames_t = 2 * num_valid
        mask = lengths_mask(frames_t, f_max)[:, None].to(dtype)
        # float32, like the ODE state; frames past a row's end are masked out everywhere
        z = self.noise[:, noise_index].permute(1, 0, 2) * mask.float()  # [B, 80, F]
        cond = torch.zeros(b, 80, f_max, device=dev, dtype=dtype)
        for i, r in enumerate(rows):
            cond[i, :, : r.prompt_mel.shape[0]] = r.prompt_mel.to(dev, dtype).T
        emb = torch.stack([r.embedding.to(dev, dtype) for r in rows])
        spks = self.spk_embed_affine_layer(F.normalize(emb, dim=1))
        mel = self.decoder(z, mask, mu, spks, cond, streaming)
        return [mel[i, :, : frames[i]] for i in range(b)]


def load_flow_state(model: FlowModel, state: dict[str, torch.Tensor]) -> None:
    state = {k: v.float() for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError("flow.pt: expected upstream flow keys and shapes, got "
                             f"{' '.join(str(exc).split())}") from exc


def build_flow(model_dir: Any) -> FlowModel:
    """The flow of a loaded ModelDir (hparams + flow.pt), float32, eval mode."""
    try:
        model = FlowModel(model_dir.version, model_dir.section("flow"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"flow section: expected upstream flow arguments, got {exc!r}") from exc
    load_flow_state(model, model_dir.load_checkpoint("flow.pt"))
    return model.eval()
