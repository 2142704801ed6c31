"""Cost of language routing per segment: script detection, routing and the cut, together.

Run from the repository root: python -m bench.bench_language [--repeats 5] [--langid]
Input: every segment of the bundled load corpus (loadtest/data/corpus.jsonl,
English and Chinese answers, cut by the segmenter as a session cuts them),
plus seeded mixed segments (an English sentence holding a Chinese or Russian
name, a Chinese sentence holding an English word), shuffled with a fixed
seed. Each is routed from joe (en) with Chinese mapped to another voice, as
a session does for every segment. One warm-up pass, then the best of
--repeats passes (process CPU time), per kind of segment. With --langid, a
row adds py3langid's classify of the Latin-script segments (not a
dependency: pip install py3langid to see it), the package measured and not
adopted (docs/voices.md, "Languages").
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from gateway.text.routing import VoiceScripts, route
from gateway.text.segmenter import Segmenter
from loadtest.corpus import load_corpus

LANGUAGES = {"joe": ("en",), "mei": ("zh",)}
VOICE_FOR = {"zh": "mei"}
NAMES = ["王小明", "李华", "Иван Петров", "東京", "Καλημέρα"]
SENTENCES = ["My friend {} said the meeting moved to Friday at 3 pm.",
             "Please send the report to {} before the end of the week, thanks!",
             "我们昨天用{}完成了所有的测试。"]
LATIN_WORDS = ["Python", "iPhone", "GitHub", "Excel"]


def corpus_segments() -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {"english": [], "chinese": []}
    for answer in load_corpus():
        segmenter = Segmenter()
        segments = segmenter.push(answer.text, 0.0) + segmenter.flush(0.0)
        kinds["chinese" if answer.lang == "zh" else "english"] += segments
    return kinds


def mixed_segments(count: int, rng: random.Random) -> list[str]:
    out = []
    for _ in range(count):
        template = rng.choice(SENTENCES)
        word = rng.choice(LATIN_WORDS if template.startswith("我") else NAMES)
        out.append(template.format(word))
    return out


def time_per_segment(segments: list[str], call: Callable[[str], object],
                     repeats: int) -> list[float]:
    """Seconds per segment, each the best of `repeats` passes over all of them."""
    for text in segments:  # warm-up
        call(text)
    best = [float("inf")] * len(segments)
    for _ in range(repeats):
        for i, text in enumerate(segments):
            start = time.process_time_ns()
            call(text)
            best[i] = min(best[i], (time.process_time_ns() - start) / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--langid", action="store_true",
                        help="add py3langid's classify (if installed)")
    args = parser.parse_args()
    rng = random.Random(7)
    kinds = corpus_segments()
    kinds["mixed"] = mixed_segments(400, rng)
    # the longest a segment gets (the segmenter's cap, 250 characters), scripts changing often
    kinds["longest"] = [" ".join(mixed_segments(12, rng))[:250] for _ in range(100)]
    kinds["all"] = [s for k in ("english", "chinese", "mixed", "longest") for s in kinds[k]]
    rng.shuffle(kinds["all"])
    scripts = VoiceScripts(lambda voice: LANGUAGES.get(voice))

    def routed(text: str) -> object:
        return route(text, "joe", VOICE_FOR, scripts)

    rows: list[tuple[str, str, list[str], list[float]]] = []
    for kind in ("english", "chinese", "mixed", "longest", "all"):
        seconds = time_per_segment(kinds[kind], routed, args.repeats)
        rows.append(("route", kind, kinds[kind], seconds))
    if args.langid:
        try:
            import py3langid
        except ImportError:
            raise SystemExit("--langid needs py3langid: pip install py3langid") from None
        py3langid.classify("warm up")
        latin = kinds["english"]

        def with_langid(text: str) -> object:
            return routed(text), py3langid.classify(text)

        seconds = time_per_segment(latin, with_langid, args.repeats)
        rows.append(("route+py3langid", "english", latin, seconds))
    print(f"{'call':<16} {'segments':<8} {'count':>6} {'chars':>6} {'mean us':>8} {'p50 us':>8} "
          f"{'p95 us':>8} {'max us':>8}")
    for call, kind, segments, seconds in rows:
        us = sorted(s * 1e6 for s in seconds)
        chars = statistics.mean(len(s) for s in segments)
        print(f"{call:<16} {kind:<8} {len(us):>6} {chars:>6.0f} {statistics.mean(us):>8.1f} "
              f"{us[len(us) // 2]:>8.1f} {us[int(len(us) * 0.95)]:>8.1f} {us[-1]:>8.1f}")
    for voice_for in ({}, VOICE_FOR):
        results = [route(s, "joe", voice_for, scripts) for s in kinds["all"]]
        skipped = sum(len(p.text) for r in results for p in r.skipped)
        moved = sum(1 for r in results if r.voice != "joe")
        print(f"from joe with voice_for {voice_for}: {moved} segments to another voice, "
              f"{skipped} of {sum(len(s) for s in kinds['all'])} characters skipped")


if __name__ == "__main__":
    main()
