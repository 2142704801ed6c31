"""Piper backend: synthesis speed per batch size, batched vs one at a time.

    python -m bench.bench_piper_batch [--threads N] [--sizes 1,2,4,8,16] [--repeats 5] [--waste W]

For each batch size B, B segments (drawn with a fixed seed from typical voice
agent sentences of mixed length) are synthesized three ways: one `step` with
ONE onnxruntime call (max_padding_waste=None), one `step` packed by length
(the backend's default max_padding_waste), and one `step` per segment. RTF is time / audio time
(lower is better; the best of --repeats interleaved runs), both wall time and the
process's CPU time: on a shared machine the CPU time is the steadier measure of
the work a mode costs. "x realtime" is audio / CPU time of the one-call mode. The default noise
scales are kept (the compute does not depend on them). A warm-up step runs first at every size.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.types import RequestId, SynthesisRequest

SENTENCES = [
    "Sure, I can help with that.",
    "Your order number is 4 5 7 2, and it ships tomorrow morning.",
    "Let me check the weather in Berlin for you.",
    "It will be sunny, with a high of 23 degrees and a light breeze from the west.",
    "Okay.",
    "Is there anything else I can do for you today?",
    "The meeting has been moved to Thursday at 3 p.m., in the large conference room.",
    "Thanks for waiting!",
    "I found three restaurants nearby that are open late, and two of them take reservations.",
    "Please hold on while I transfer you to a colleague.",
    "That sounds great.",
    "Your appointment with Dr. Miller is confirmed for the 14th of March.",
]


def run_step(
    backend: PiperBackend, texts: list[str], max_padding_waste: float | None = None
) -> tuple[float, float, float]:
    """One step over `texts`: (wall seconds, process CPU seconds, audio seconds)."""
    backend.config.max_padding_waste = max_padding_waste
    items = [
        backend.prepare(SynthesisRequest(RequestId(str(i)), t, "joe"))
        for i, t in enumerate(texts)
    ]
    wall, cpu = time.perf_counter(), time.process_time()
    results = backend.step(items)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    for item in items:
        backend.release(item)  # as the engine does with a finished request
    return wall, cpu, sum(len(r.pcm) for r in results) / backend.sample_rate


def measure(backend: PiperBackend, mode: str, texts: list[str], waste: float | None) -> np.ndarray:
    """[wall s, cpu s] of one step in `mode`."""
    if mode == "solo":
        total: np.ndarray = np.sum([run_step(backend, [t])[:2] for t in texts], axis=0)
        return total
    return np.array(run_step(backend, texts, None if mode == "one-call" else waste)[:2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=PiperBackendConfig().num_threads)
    parser.add_argument("--sizes", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--waste", type=float, default=PiperBackendConfig().max_padding_waste)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    backend = PiperBackend(PiperBackendConfig(max_batch_size=max(sizes), num_threads=args.threads,
                                              windowed=False))  # whole segments: one step each
    backend.load()
    rng = random.Random(args.seed)
    modes = ("one-call", "packed", "solo")
    print(
        f"piper joe voice, onnxruntime intra-op threads={args.threads}, packed: "
        f"max_padding_waste={args.waste}, cpus={os.cpu_count()}, "
        f"load avg at start={os.getloadavg()[0]:.1f}"
    )
    print(
        "| batch | audio s | one-call step ms | wall RTF one-call / packed / one-by-one "
        "| CPU RTF one-call / packed / one-by-one | one-call x realtime (CPU) |"
    )
    print("|---:|---:|---:|---|---|---:|")
    for size in sizes:
        texts = rng.choices(SENTENCES, k=size)
        audio = run_step(backend, texts)[2]  # also the warm-up at this shape
        best = {mode: np.full(2, np.inf) for mode in modes}
        for _ in range(args.repeats):
            # Interleaved, and the best of the repeats kept: other processes on a
            # shared machine then disturb all three modes alike, and little.
            for mode in modes:
                best[mode] = np.minimum(best[mode], measure(backend, mode, texts, args.waste))
        wall = " / ".join(f"{best[m][0] / audio:.3f}" for m in modes)
        cpu = " / ".join(f"{best[m][1] / audio:.3f}" for m in modes)
        print(
            f"| {size} | {audio:.1f} | {1000 * best['one-call'][0]:.0f} | {wall} | {cpu} "
            f"| {audio / best['one-call'][1]:.1f} |"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
