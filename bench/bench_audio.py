"""Encode cost of gateway.audio.codecs's StreamEncoder, in ms of CPU per second of audio.

Run from the repository root: python -m bench.bench_audio [--seconds 20]
Input: a seeded speech-like signal (harmonic chirp plus noise) at 22050 Hz (the
piper joe voice) and 24000 Hz (CosyVoice), fed in 100 ms chunks as the engine
delivers it. One warm-up run per row, then the best of --repeats runs (process CPU time).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gateway.audio.codecs import make_encoder

ROWS = [
    # (codec, sample_rate_out, frame_ms, sample_rate_in, complexity)
    ("opus", 48000, 20, 22050, 5),
    ("opus", 48000, 20, 22050, 10),
    ("opus", 48000, 20, 24000, 5),
    ("opus", 24000, 20, 24000, 5),
    ("opus", 48000, 60, 22050, 5),
    ("pcm16", 48000, 20, 22050, 5),
    ("pcm16", 24000, 20, 24000, 5),
    ("mulaw", 8000, 20, 22050, 5),
]


def make_signal(seconds: float, rate: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    pcm = 0.2 * envelope * voiced + 0.01 * rng.standard_normal(len(t))
    return pcm.astype(np.float32)


def run_once(row: tuple[str, int, int, int, int], pcm: np.ndarray) -> float:
    codec, rate_out, frame_ms, rate_in, complexity = row
    chunk = rate_in // 10
    start = time.process_time()
    encoder = make_encoder(codec, rate_out, frame_ms, None, rate_in, complexity=complexity)
    for i in range(0, len(pcm), chunk):
        encoder.encode(pcm[i : i + chunk])
    encoder.flush()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{'codec':<6} {'out Hz':>6} {'frame':>5} {'in Hz':>6} {'cplx':>4} {'ms CPU / s audio':>17}"
    )
    for row in ROWS:
        pcm = make_signal(args.seconds, row[3], seed=0)
        run_once(row, pcm[: row[3]])  # warm-up
        cost = min(run_once(row, pcm) for _ in range(args.repeats))
        ms_per_s = 1000.0 * cost / args.seconds
        codec, rate_out, frame_ms, rate_in, complexity = row
        cplx = str(complexity) if codec == "opus" else "-"
        print(f"{codec:<6} {rate_out:>6} {frame_ms:>5} {rate_in:>6} {cplx:>4} {ms_per_s:>17.2f}")


if __name__ == "__main__":
    main()
