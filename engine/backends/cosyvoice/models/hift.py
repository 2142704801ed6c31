"""HiFT vocoder (HiFTNet: neural source filter + iSTFT), mel [B, 80, T] -> 24 kHz wave.

Two variants share one module, chosen by the model version:

- CosyVoice 2 (`HiFTGenerator`): centred convolutions and a ConvRNN f0
  predictor; its sine source draws fresh random phase and noise per call, so a
  stream pins the overlapping source between chunks (see t2w/vocoder.py).
- CosyVoice 3 (`CausalHiFTGenerator`): every convolution is causal, except
  conv_pre (4 mel frames of lookahead) and the f0 predictor's first layer (3);
  the source uses a fixed initial phase and a fixed noise table indexed by the
  absolute sample, so re-running a window of recent mel reproduces the same
  samples. Upstream runs this f0 predictor in float64; so do we.

Checkpoint keys are upstream's (`hift.pt`, weight-norm parametrizations, an
optional `generator.` prefix), loaded with strict=True.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from engine.backends.cosyvoice.models.source_noise import NoiseCounter
from engine.errors import ModelLoadError

NOISE_TABLE_SECONDS = 10  # the v3 source noise repeats after this many seconds


@dataclass(slots=True)
class HiFTConfig:
    causal: bool
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 3])
    upsample_kernel_sizes: list[int] = field(default_factory=lambda: [16, 11, 7])
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: list[int] = field(default_factory=lambda: [3, 7, 11])
    resblock_dilation_sizes: list[list[int]] = field(default_factory=lambda: [[1, 3, 5]] * 3)
    source_resblock_kernel_sizes: list[int] = field(default_factory=lambda: [7, 7, 11])
    source_resblock_dilation_sizes: list[list[int]] = field(default_factory=lambda: [[1, 3, 5]] * 3)
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4
    f0_cond_channels: int = 512
    seed: int = 0  # v3 noise table
    # 0 makes the source deterministic (checks of streaming against offline)
    noise_scale: float = 1.0

    def __post_init__(self) -> None:
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes):
            raise ValueError(
                f"expected one kernel size per upsample rate, got {self.upsample_rates} and "
                f"{self.upsample_kernel_sizes}"
            )
        if self.base_channels % (2 ** len(self.upsample_rates)):
            raise ValueError("expected base_channels divisible by 2**num_upsamples, got "
                             f"{self.base_channels}")

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * self.hop_len

    @classmethod
    def from_hparams(cls, hift: dict[str, Any], version: int) -> HiFTConfig:
        """From the yaml's `hift` section (as model_dir reads it)."""
        try:
            istft = hift["istft_params"]
            return cls(
                causal=version == 3,
                in_channels=int(hift["in_channels"]),
                base_channels=int(hift["base_channels"]),
                nb_harmonics=int(hift["nb_harmonics"]),
                sampling_rate=int(hift["sampling_rate"]),
                nsf_alpha=float(hift["nsf_alpha"]),
                nsf_sigma=float(hift["nsf_sigma"]),
                nsf_voiced_threshold=float(hift["nsf_voiced_threshold"]),
                upsample_rates=[int(u) for u in hift["upsample_rates"]],
                upsample_kernel_sizes=[int(k) for k in hift["upsample_kernel_sizes"]],
                n_fft=int(istft["n_fft"]),
                hop_len=int(istft["hop_len"]),
                resblock_kernel_sizes=[int(k) for k in hift["resblock_kernel_sizes"]],
                resblock_dilation_sizes=[[int(d) for d in ds]
                                         for ds in hift["resblock_dilation_sizes"]],
                source_resblock_kernel_sizes=[int(k) for k in hift["source_resblock_kernel_sizes"]],
                source_resblock_dilation_sizes=[
                    [int(d) for d in ds] for ds in hift["source_resblock_dilation_sizes"]
                ],
                lrelu_slope=float(hift["lrelu_slope"]),
                audio_limit=float(hift["audio_limit"]),
                conv_pre_look_right=int(hift.get("conv_pre_look_right", 4)),
                f0_cond_channels=int(hift["f0_predictor"]["cond_channels"]),
            )
        except (KeyError, TypeError) as exc:
            raise ModelLoadError(f"hift section: expected upstream HiFT arguments, got {exc!r} "
                                 "missing") from exc


class PadConv1d(nn.Conv1d):
    """Conv1d with explicit zero padding (left, right); `right_context` replaces the right zeros."""

    def __init__(self, cin: int, cout: int, k: int, *, left: int, right: int = 0, stride: int = 1,
                 dilation: int = 1, groups: int = 1) -> None:
        super().__init__(cin, cout, k, stride=stride, dilation=dilation, groups=groups)
        self.left, self.right = left, right

    def forward(self, x: torch.Tensor, right_context: torch.Tensor | None = None) -> torch.Tensor:
        if right_context is not None:
            x = F.pad(torch.cat([x, right_context], dim=2), (self.left, 0))
        else:
            x = F.pad(x, (self.left, self.right))
        return super().forward(x)


def causal_pad(k: int, d: int = 1) -> int:
    # upstream CausalConv1d: even kernels get one extra frame of padding
    return (k * d - d) // 2 * 2 + (k + 1) % 2


class UpsampleConv1d(nn.Conv1d):
    """Nearest-neighbour upsampling by `rate`, then a left-padded (causal) convolution."""

    def __init__(self, cin: int, cout: int, k: int, rate: int) -> None:
        super().__init__(cin, cout, k)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.repeat_interleave(self.rate, dim=2)
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class Snake(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, T]
        a = self.alpha[None, :, None]
        return x + (1.0 / (a + 1e-9)) * torch.sin(x * a) ** 2


def _conv(cin: int, cout: int, k: int, d: int, causal: bool) -> nn.Conv1d:
    if causal:
        return PadConv1d(cin, cout, k, left=causal_pad(k, d), dilation=d)
    return nn.Conv1d(cin, cout, k, dilation=d, padding=(k * d - d) // 2)


class ResBlock(nn.Module):
    def __init__(self, channels: int, k: int, dilations: list[int], causal: bool) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList([weight_norm(_conv(channels, channels, k, d, causal))
                                     for d in dilations])
        self.convs2 = nn.ModuleList([weight_norm(_conv(channels, channels, k, 1, causal))
                                     for _ in dilations])
        self.activations1 = nn.ModuleList([Snake(channels) for _ in dilations])
        self.activations2 = nn.ModuleList([Snake(channels) for _ in dilations])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2,
                                  strict=True):
            x = x + c2(a2(c1(a1(x))))
        return x


class F0Predictor(nn.Module):
    """mel [B, 80, T] -> f0 [B, T] (Hz, non-negative). Causal: the first layer looks 3 frames
    ahead."""

    def __init__(self, in_channels: int, cond: int, causal: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            cin = in_channels if i == 0 else cond
            if not causal:
                conv: nn.Conv1d = nn.Conv1d(cin, cond, 3, padding=1)
            elif i == 0:
                conv = PadConv1d(cin, cond, 4, left=0, right=causal_pad(4))
            else:
                conv = PadConv1d(cin, cond, 3, left=causal_pad(3))
            layers += [weight_norm(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond, 1)
        self.causal = causal
        self.lookahead = causal_pad(4) if causal else 0

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        if self.causal and not finalize:
            x = self.condnet[0](mel[:, :, : -self.lookahead],
                                right_context=mel[:, :, -self.lookahead:])
        else:
            x = self.condnet[0](mel)
        for layer in list(self.condnet)[1:]:
            x = layer(x)
        out: torch.Tensor = self.classifier(x.transpose(1, 2))
        return out.squeeze(-1).abs()


class SourceModule(nn.Module):
    """f0 per frame [B, T] -> harmonic source [B, 1, T * 480] (sine harmonics merged by l_linear).

    Upstream integrates the phase at the frame rate (its linear down-sampling of
    the per-sample f0 reads two samples inside each frame, so the random initial
    phase it adds to sample 0 never reaches the output) and spreads it back to
    samples: linearly for v2, nearest (one phase per frame) for v3. We integrate
    in float64 cycles and can start from a carried phase, so a window of recent
    frames continues the phase of the frames before it.
    """

    noise_table: torch.Tensor

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dim = cfg.nb_harmonics + 1
        self.l_linear = nn.Linear(self.dim, 1)
        if cfg.causal:
            gen = torch.Generator().manual_seed(cfg.seed)
            table = torch.rand(NOISE_TABLE_SECONDS * cfg.sampling_rate, self.dim, generator=gen)
            self.register_buffer("noise_table", table, persistent=False)

    def phase(self, f0: torch.Tensor, phase0: torch.Tensor | None = None) -> torch.Tensor:
        """f0 [B, T] -> cumulative phase in cycles [B, T, H] (float64), from `phase0` [B, H]."""
        cfg = self.cfg
        harmonics = torch.arange(1, self.dim + 1, device=f0.device, dtype=torch.float64)
        rad = (f0.double()[:, :, None] * harmonics / cfg.sampling_rate) % 1
        cycles = torch.cumsum(rad * cfg.samples_per_frame, dim=1)
        return cycles if phase0 is None else cycles + phase0[:, None, :]

    def forward(self, f0: torch.Tensor, cycles: torch.Tensor, start: int | torch.Tensor = 0,
                generator: torch.Generator | NoiseCounter | None = None) -> torch.Tensor:
        """f0 [B, T], cycles [B, T, H] -> source [B, 1, T * 480]; `start`: absolute first sample (v3
        noise), or each row's [B] (a tensor: no host value, so a captured graph replays it)."""
        cfg, up = self.cfg, self.cfg.samples_per_frame
        if cfg.causal:
            per_sample = cycles.repeat_interleave(up, dim=1)
        else:
            per_sample = F.interpolate(cycles.transpose(1, 2), scale_factor=up,
                                       mode="linear").transpose(1, 2)
        sines = torch.sin(2 * math.pi * (per_sample % 1)).to(f0.dtype) * cfg.nsf_alpha  # [B, L, H]
        uv = (f0.repeat_interleave(up, dim=1)[:, :, None] > cfg.nsf_voiced_threshold).to(sines)
        amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        if cfg.causal:
            n = self.noise_table.shape[0]
            idx = (torch.as_tensor(start, device=f0.device).reshape(-1, 1)
                   + torch.arange(sines.shape[1], device=f0.device)) % n  # [1 or B, L]
            noise = self.noise_table[idx].to(sines)
        else:
            if isinstance(generator, NoiseCounter):  # on the device, from (seed, counter)
                noise = generator.normal(tuple(sines.shape), f0.device).to(sines)
            else:
                noise = torch.randn(sines.shape, generator=generator).to(sines)
        sines = sines * uv + amp * cfg.noise_scale * noise
        return torch.tanh(self.l_linear(sines)).transpose(1, 2)


class HiFT(nn.Module):
    window: torch.Tensor

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        causal, base, nfft = cfg.causal, cfg.base_channels, cfg.n_fft
        self.m_source = SourceModule(cfg)
        if causal:
            conv_pre: nn.Conv1d = PadConv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1,
                                            left=0, right=cfg.conv_pre_look_right)
        else:
            conv_pre = nn.Conv1d(cfg.in_channels, base, 7, padding=3)
        self.conv_pre = weight_norm(conv_pre)
        ups: list[nn.Module] = []
        for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True)):
            cin, cout = base // 2**i, base // 2 ** (i + 1)
            up: nn.Module = (UpsampleConv1d(cin, cout, k, u) if causal
                             else nn.ConvTranspose1d(cin, cout, k, u, padding=(k - u) // 2))
            ups.append(weight_norm(up))
        self.ups = nn.ModuleList(ups)
        rates = [1] + cfg.upsample_rates[::-1][:-1]
        cum = [math.prod(rates[: i + 1]) for i in range(len(rates))][::-1]
        downs: list[nn.Module] = []
        src_blocks: list[nn.Module] = []
        for i, (u, k, d) in enumerate(zip(cum, cfg.source_resblock_kernel_sizes,
                                          cfg.source_resblock_dilation_sizes, strict=False)):
            ch = base // 2 ** (i + 1)
            if u == 1:
                downs.append(nn.Conv1d(nfft + 2, ch, 1))
            elif causal:
                downs.append(PadConv1d(nfft + 2, ch, u * 2, left=u - 1, stride=u))
            else:
                downs.append(nn.Conv1d(nfft + 2, ch, u * 2, u, padding=u // 2))
            src_blocks.append(ResBlock(ch, k, d, causal))
        self.source_downs = nn.ModuleList(downs)
        self.source_resblocks = nn.ModuleList(src_blocks)
        self.resblocks = nn.ModuleList([
            ResBlock(base // 2 ** (i + 1), k, d, causal)
            for i in range(len(ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        ])
        ch = base // 2 ** len(ups)
        self.conv_post = weight_norm(PadConv1d(ch, nfft + 2, 7, left=6) if causal
                                     else nn.Conv1d(ch, nfft + 2, 7, padding=3))
        self.f0_predictor = F0Predictor(cfg.in_channels, cfg.f0_cond_channels, causal)
        self.register_buffer("window", torch.hann_window(nfft, periodic=True), persistent=False)

    # -- pieces ---------------------------------------------------------------------------------

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B, 80, T] -> f0 [B, T] (T - 3 in causal non-final mode). v3 runs in float64."""
        if self.cfg.causal:
            if self.f0_predictor.classifier.weight.dtype != torch.float64:
                self.f0_predictor.to(torch.float64)
            f0: torch.Tensor = self.f0_predictor(mel.double(), finalize=finalize)
            return f0.to(mel.dtype)
        out: torch.Tensor = self.f0_predictor(mel)
        return out

    def source(self, f0: torch.Tensor, phase0: torch.Tensor | None = None, start: int = 0,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """f0 [B, T] -> (source [B, 1, T * 480], cumulative phase cycles [B, T, H] float64)."""
        cycles = self.m_source.phase(f0, phase0)
        return self.m_source(f0, cycles, start=start, generator=generator), cycles

    def inference(self, mel: torch.Tensor,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """Offline vocoding of a whole mel [B, 80, T] -> wave [B, T * 480]."""
        f0 = self.predict_f0(mel)
        source, _ = self.source(f0, generator=generator)
        return self.decode(mel, source)

    def decode(self, mel: torch.Tensor, source: torch.Tensor,
               finalize: bool = True) -> torch.Tensor:
        """mel [B, 80, T], source [B, 1, T * 480] -> wave [B, T * 480] (causal non-final: (T - 5) *
        480)."""
        cfg = self.cfg
        spec = torch.stft(source.squeeze(1), cfg.n_fft, cfg.hop_len, cfg.n_fft, window=self.window,
                          return_complex=True)  # [B, F, frames]
        s = torch.cat([spec.real, spec.imag], dim=1)
        if cfg.causal and not finalize:
            look = cfg.conv_pre_look_right
            x = self.conv_pre(mel[:, :, :-look], right_context=mel[:, :, -look:])
            s = s[:, :, : -math.prod(cfg.upsample_rates) * look]
        else:
            x = self.conv_pre(mel)
        num_kernels = len(cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s))
            blocks = self.resblocks[i * num_kernels:(i + 1) * num_kernels]
            x = sum(block(x) for block in blocks) / num_kernels
        x = self.conv_post(F.leaky_relu(x))
        half = cfg.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half]).clamp(max=1e2)
        phase = torch.sin(x[:, half:])
        wav = torch.istft(torch.polar(magnitude, phase), cfg.n_fft, cfg.hop_len, cfg.n_fft,
                          window=self.window)
        if cfg.causal and not finalize:
            wav = wav[:, : -cfg.samples_per_frame]
        return wav.clamp(-cfg.audio_limit, cfg.audio_limit)

    def fuse_weight_norm(self) -> None:
        """Fold the weight-norm parametrizations into plain weights (after loading; faster)."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


def load_hift_state(model: HiFT, state: dict[str, torch.Tensor]) -> None:
    """Load an upstream hift.pt state dict (optionally `generator.`-prefixed), strict, as
    float32."""
    if all(k.startswith("generator.") for k in state):
        state = {k[len("generator."):]: v for k, v in state.items()}
    state = {k: v.float() for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError("hift.pt: expected upstream HiFT keys and shapes, got "
                             f"{' '.join(str(exc).split())}") from exc


def build_hift(model_dir: Any) -> HiFT:
    """A HiFT vocoder from a loaded ModelDir (hparams + hift.pt), weights fused, eval mode."""
    cfg = HiFTConfig.from_hparams(model_dir.section("hift"), model_dir.version)
    model = HiFT(cfg)
    load_hift_state(model, model_dir.load_checkpoint("hift.pt"))
    model.fuse_weight_norm()
    return model.eval()
