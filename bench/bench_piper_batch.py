"""Piper backend: synthesis speed per batch size, batched vs one at a time.

    python bench/bench_piper_batch.py [--threads N] [--sizes 1,2,4,8,16] [--repeats 3]

For each batch size B, B segments (drawn with a fixed seed from typical voice
agent sentences of mixed length) are synthesized three ways: one `step` with
ONE onnxruntime call (max_padding_waste=None), one `step` packed by length
(the backend's default max_padding_waste), and one `step` per segment. RTF is wall time / audio time (lower is
better); "x realtime" is its inverse. The default noise scales are kept (the
compute does not depend on them). A warm-up step runs first at every size.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.piper import PiperBackend, PiperBackendConfig  # noqa: E402
from engine.types import RequestId, SynthesisRequest  # noqa: E402

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
) -> tuple[float, float]:
    """One step over `texts`: (wall seconds, audio seconds)."""
    backend.config.max_padding_waste = max_padding_waste
    items = [
        backend.prepare(SynthesisRequest(RequestId(str(i)), t, "joe", deadline=0.0))
        for i, t in enumerate(texts)
    ]
    start = time.perf_counter()
    results = backend.step(items)
    wall = time.perf_counter() - start
    audio = sum(len(r.pcm) for r in results) / backend.sample_rate
    return wall, audio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=PiperBackendConfig().num_threads)
    parser.add_argument("--sizes", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--waste", type=float, default=PiperBackendConfig().max_padding_waste)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    backend = PiperBackend(PiperBackendConfig(max_batch_size=max(sizes), num_threads=args.threads))
    backend.load()
    rng = random.Random(args.seed)
    print(
        f"piper joe voice, onnxruntime intra-op threads={args.threads}, "
        f"cpus={os.cpu_count()}, load avg={os.getloadavg()[0]:.1f}"
    )
    print(
        "| batch | audio s/step | one-call step ms | one-call RTF | one-call x realtime "
        f"| packed (waste {args.waste}) RTF | one-by-one RTF | one-call speedup |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        batches = [rng.choices(SENTENCES, k=size) for _ in range(args.repeats)]
        run_step(backend, batches[0])  # warm-up at this shape
        wall = {"one-call": 0.0, "packed": 0.0, "solo": 0.0}
        audio = 0.0
        for texts in batches:
            # Interleaved, so that load from other processes hits all three alike.
            seconds, produced = run_step(backend, texts)
            wall["one-call"] += seconds
            audio += produced
            wall["packed"] += run_step(backend, texts, args.waste)[0]
            wall["solo"] += sum(run_step(backend, [text])[0] for text in texts)
        rtf = {mode: seconds / audio for mode, seconds in wall.items()}
        print(
            f"| {size} | {audio / args.repeats:.1f} | {1000 * wall['one-call'] / args.repeats:.0f} "
            f"| {rtf['one-call']:.4f} | {1 / rtf['one-call']:.1f} | {rtf['packed']:.4f} "
            f"| {rtf['solo']:.4f} | {rtf['solo'] / rtf['one-call']:.2f} |"
        )


if __name__ == "__main__":
    main()
