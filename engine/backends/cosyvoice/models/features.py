"""Audio features the CosyVoice frontend feeds its ONNX models, in plain torch.

- `kaldi_fbank`: Kaldi's log mel filterbank (the defaults of
  torchaudio.compliance.kaldi.fbank with 80 bins, dither 0), the input of the
  CAM++ speaker model (`campplus.onnx`), mean-normalized over time upstream;
- `whisper_log_mel`: Whisper's 128-bin log mel spectrogram, the input of the
  speech tokenizers (`speech_tokenizer_v2.onnx` / `_v3.onnx`);
- `resample`: any rate to the 16 kHz these models read (PyAV's swresample).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

FBANK_RATE = 16000


def resample(wav: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Mono float32 samples at `rate` -> mono float32 samples at `target_rate`."""
    wav = np.ascontiguousarray(wav, dtype=np.float32).reshape(-1)
    if rate == target_rate or wav.size == 0:
        return wav
    # here, not at the top: the frontend imports this module, and only resampling needs PyAV
    import av

    frame = av.AudioFrame.from_ndarray(wav[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target_rate)
    chunks = [
        f.to_ndarray().reshape(-1) for f in [*resampler.resample(frame), *resampler.resample(None)]
    ]
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)


def _kaldi_mel(freq: torch.Tensor) -> torch.Tensor:
    return 1127.0 * torch.log1p(freq / 700.0)


def kaldi_mel_banks(
    num_bins: int, padded_window: int, rate: float, low_freq: float = 20.0
) -> torch.Tensor:
    """Kaldi's triangular filters, equally spaced on its mel scale: [num_bins, padded_window // 2 +
    1].

    The last (Nyquist) FFT bin gets weight 0, as Kaldi's does.
    """
    num_fft_bins = padded_window // 2
    high_freq = rate / 2
    mel_low, mel_high = _kaldi_mel(torch.tensor(low_freq)), _kaldi_mel(torch.tensor(high_freq))
    delta = (mel_high - mel_low) / (num_bins + 1)
    b = torch.arange(num_bins, dtype=torch.float32)[:, None]
    left, center, right = mel_low + b * delta, mel_low + (b + 1) * delta, mel_low + (b + 2) * delta
    mel = _kaldi_mel(rate / padded_window * torch.arange(num_fft_bins, dtype=torch.float32))[
        None, :
    ]
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)  # [num_bins, num_fft_bins]
    return F.pad(banks, (0, 1))


def kaldi_fbank(wav: torch.Tensor, num_mel_bins: int = 80, rate: int = FBANK_RATE) -> torch.Tensor:
    """wav [N] float in [-1, 1] -> log mel energies [T, num_mel_bins], T = 1 + (N - 400) // 160.

    25 ms povey windows every 10 ms (snip_edges), DC offset removed per frame,
    pre-emphasis 0.97, power spectrum of a 512-point FFT, log floored at
    float32 epsilon.
    """
    frame_len, shift = int(rate * 0.025), int(rate * 0.010)
    if wav.numel() < frame_len:
        raise ValueError(f"expected at least {frame_len} samples (25 ms), got {wav.numel()}")
    padded = 1 << (frame_len - 1).bit_length()  # 512 at 16 kHz
    frames = wav.float().unfold(0, frame_len, shift)  # [T, frame_len]
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - 0.97 * previous
    window = torch.hann_window(frame_len, periodic=False, dtype=torch.float32).pow(0.85)
    frames = F.pad(frames * window, (0, padded - frame_len))
    power = torch.fft.rfft(frames).abs().pow(2)  # [T, padded // 2 + 1]
    banks = kaldi_mel_banks(num_mel_bins, padded, rate).to(power.dtype)
    energies = power @ banks.T  # [T, num_mel_bins]
    log_energies: torch.Tensor = energies.clamp(min=torch.finfo(torch.float32).eps).log()
    return log_energies


def _slaney_hz_to_mel(freq: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, math.log(6.4) / 27.0
    mels = freq / f_sp
    high = freq >= min_log_hz
    mels[high] = min_log_hz / f_sp + np.log(freq[high] / min_log_hz) / logstep
    return mels


def _slaney_mel_to_hz(mels: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, math.log(6.4) / 27.0
    freq = f_sp * mels
    high = mels >= min_log_hz / f_sp
    freq[high] = min_log_hz * np.exp(logstep * (mels[high] - min_log_hz / f_sp))
    return freq


def slaney_mel_filters(rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """Slaney-normalized mel filters on the Slaney mel scale (librosa's defaults): [n_mels, n_fft //
    2 + 1]."""
    fft_freqs = np.linspace(0.0, rate / 2, 1 + n_fft // 2)
    edges = _slaney_mel_to_hz(
        np.linspace(0.0, _slaney_hz_to_mel(np.array([rate / 2.0]))[0], n_mels + 2)
    )
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


def whisper_log_mel(wav: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """wav [N] at 16 kHz -> Whisper log mel [n_mels, N // 160]: 400-point Hann STFT, hop 160,
    log10 power clipped to 8 below the maximum, then (x + 4) / 4."""
    window = torch.hann_window(400)
    spec = torch.stft(wav.float(), 400, 160, window=window, return_complex=True)  # [201, frames]
    power = spec[:, :-1].abs().pow(2)
    mel = slaney_mel_filters(FBANK_RATE, 400, n_mels) @ power  # [n_mels, frames - 1]
    log_spec = mel.clamp(min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0
