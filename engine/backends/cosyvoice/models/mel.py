"""The prompt-audio mel spectrogram the flow is conditioned on (upstream's `feat_extractor`).

Matcha-TTS `mel_spectrogram` with the yaml's arguments (24 kHz, n_fft 1920,
hop 480, window 1920, 80 bins, fmin 0, fmax 8000 for v2 / None = Nyquist for
v3, center False): reflect-pad (n_fft - hop) / 2 on each side, periodic Hann
STFT, magnitude sqrt(re^2 + im^2 + 1e-9), Slaney mel filterbank (librosa's
default: Slaney mel scale, area-normalized triangles), then log(max(x, 1e-5)).
One frame per 480 samples, i.e. 50 frames a second, twice the token rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / (200.0 / 3)
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (math.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log_part, mel)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = mel * (200.0 / 3)
    log_part = 1000.0 * np.exp((math.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, log_part, hz)


def slaney_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float,
                      fmax: float | None) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangles between Slaney-spaced edges, each scaled to unit area."""
    fmax = sr / 2 if fmax is None else fmax
    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(np.array(fmin)), hz_to_mel(np.array(fmax)), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


@dataclass(slots=True)
class MelConfig:
    sampling_rate: int = 24000
    n_fft: int = 1920
    hop_size: int = 480
    win_size: int = 1920
    num_mels: int = 80
    fmin: float = 0.0
    fmax: float | None = 8000.0

    def __post_init__(self) -> None:
        if self.hop_size <= 0 or self.win_size > self.n_fft:
            raise ValueError(f"expected hop > 0 and win_size <= n_fft, got hop {self.hop_size}, "
                             f"win {self.win_size}, n_fft {self.n_fft}")

    @classmethod
    def from_hparams(cls, feat: dict[str, Any]) -> MelConfig:
        """From the yaml's `feat_extractor` entry (`!name:matcha.utils.audio.mel_spectrogram`)."""
        if feat.get("center", False):
            raise ValueError("expected feat_extractor center=False (as released), got True")
        fmax = feat.get("fmax")
        return cls(int(feat["sampling_rate"]), int(feat["n_fft"]), int(feat["hop_size"]),
                   int(feat["win_size"]),
                   int(feat["num_mels"]), float(feat.get("fmin", 0)),
                   None if fmax is None else float(fmax))


class MelExtractor:
    def __init__(self, config: MelConfig | None = None) -> None:
        self.config = config or MelConfig()
        c = self.config
        self.basis = slaney_filterbank(c.sampling_rate, c.n_fft, c.num_mels, c.fmin, c.fmax)
        self.window = torch.hann_window(c.win_size)

    def __call__(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, L] or [L] in [-1, 1] at the config's rate -> log-mel [B, frames, 80] (flow
        layout)."""
        c = self.config
        x = wav[None] if wav.dim() == 1 else wav
        pad = (c.n_fft - c.hop_size) // 2
        x = F.pad(x[:, None].float(), (pad, pad), mode="reflect")[:, 0]
        spec = torch.stft(x, c.n_fft, hop_length=c.hop_size, win_length=c.win_size,
                          window=self.window, center=False, return_complex=True)
        mag = torch.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
        mel = torch.log(torch.clamp(self.basis @ mag, min=1e-5))
        return mel.transpose(1, 2)
