"""Throughput of gateway.text.segmenter (cleanup included), in characters per second.

Run from the repository root: python -m bench.bench_segmenter [--repeats 5]
Input: a seeded markdown-shaped LLM answer (English, Chinese and mixed
paragraphs, lists, emphasis, links, inline code, a code block, emoji) of
about 100,000 characters, fed as one string, in LLM-token-sized deltas (1-8 characters)
and one character at a time. One warm-up run per row, then the best of
--repeats runs (process CPU time). The last column compares with synthesis:
piper's joe voice runs at most 12.4x real time on one core (the raw limit on
the box the targets were set on: docs/benchmarks.md, "Anchors"), and speech is
about 15 characters per second, so one core synthesizes about 190 characters
of text per second.
"""

from __future__ import annotations

import argparse
import random
import time

from gateway.text.segmenter import Segmenter

SYNTHESIS_CHARS_PER_S = 12.4 * 15  # piper, one core: real-time factor x speaking rate

PARAGRAPHS = [
    ("Sure, here is what I found. The **main** point is simple: Dr. Smith measured 3.14 units "
     "at 10:30 a.m., e.g. twice a day, and the U.S. team agreed. See [the report]"
     "(https://example.com/report.v2.html) for details."),
    "你好！今天我们讨论三个问题：第一，性能；第二，质量；第三，成本。我们用Python和`numpy`完成了测试。",
    ("## Summary\n\n- **Fast**: about 1,000.5 requests per second.\n- *Cheap*: it runs on v2.1.3 "
     "of the server at 192.168.1.1.\n- Simple 🎉 to use… really!"),
    ("Here is an example:\n\n```python\nprint('Hello. World')\n```\n\nThat prints a greeting. "
     "Mail john.doe@example.com if it fails, then try again."),
    "在这个project里面，我们用了J. R. R. Tolkien的书做测试数据。Results were good. 结果很好。",
]


def make_text(num_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < num_chars:
        paragraph = rng.choice(PARAGRAPHS)
        parts.append(paragraph)
        total += len(paragraph) + 2
    return "\n\n".join(parts)


def make_deltas(text: str, mode: str, seed: int) -> list[str]:
    if mode == "whole":
        return [text]
    if mode == "1 char":
        return list(text)
    rng = random.Random(seed)
    deltas: list[str] = []
    i = 0
    while i < len(text):
        size = rng.randint(1, 8)
        deltas.append(text[i : i + size])
        i += size
    return deltas


def run_once(deltas: list[str]) -> tuple[float, int]:
    start = time.process_time()
    segmenter = Segmenter()
    num_segments = 0
    for delta in deltas:
        num_segments += len(segmenter.push(delta, 0.0))
    num_segments += len(segmenter.flush(0.0))
    return time.process_time() - start, num_segments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chars", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    text = make_text(args.chars, seed=0)
    print(f"{'deltas':<12} {'chars':>8} {'segments':>8} {'chars/s':>12} {'x synthesis':>12}")
    for mode in ("whole", "1-8 chars", "1 char"):
        deltas = make_deltas(text, mode, seed=1)
        run_once(deltas[: len(deltas) // 20])  # warm-up
        results = [run_once(deltas) for _ in range(args.repeats)]
        seconds = min(r[0] for r in results)
        num_segments = results[0][1]
        rate = len(text) / seconds
        ratio = rate / SYNTHESIS_CHARS_PER_S
        print(f"{mode:<12} {len(text):>8} {num_segments:>8} {rate:>12,.0f} {ratio:>12,.0f}")


if __name__ == "__main__":
    main()
