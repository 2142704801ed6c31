"""The box's raw piper limit against the engine's throughput at saturation.

    python -m bench.bench_piper_limit [--seconds 20] [--streams 48] [--seed 1] [--engine-option
    K=V]...
                                      [--memory-profile compact|fast]

Raw limit: a plain loop of piper calls with the joe voice (the whole graph, as
piper ships it), one call at a time on every core, over sentences of the
bundled load-test corpus: seconds of audio made per wall second. The same
loop on one core is printed beside it.

Engine at saturation: the voxgate engine with its default piper backend
(decoder windows, playback clocks, bounded look-ahead) fed by `--streams`
concurrent readers that each submit the next sentence as soon as the last
one finished, every request due now; audio seconds routed per wall second,
over the same duration, after a warm-up. The ratio is the share of the raw
limit the engine keeps. Saturation needs more demand than the box can serve:
each stream may run only a bounded look-ahead past its playback clock, so a
stream asks for about 1 s of audio per second plus that burst per sentence,
and on a fast box 16 streams leave the lanes idle a third of the time. The
run prints the share of wall time the lanes were busy; under 95% it says the
engine was not saturated (raise `--streams`). The machine may be
shared: run both in one invocation and quote the ratio. `--memory-profile`
applies `voxgate serve`'s malloc settings to the whole process first (the
server's default is fast); without it glibc keeps its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.engine import Engine, EngineConfig
from engine.options import config_from_options
from engine.types import RequestId, SynthesisRequest


def corpus_sentences(seed: int, count: int = 400) -> list[str]:
    """Sentences of the bundled corpus (loadtest's answers cut where the segmenter would)."""
    from gateway.text.segmenter import Segmenter, SegmenterConfig
    from loadtest.corpus import load_corpus

    answers = load_corpus(None)
    rng = random.Random(seed)
    rng.shuffle(answers)
    sentences: list[str] = []
    for answer in answers:
        segmenter = Segmenter(SegmenterConfig())
        sentences += segmenter.push(answer.text, 0.0) + segmenter.flush(0.0)
        if len(sentences) >= count:
            break
    return [s for s in sentences if s.strip()][:count]


def raw_limit(texts: list[str], seconds: float, threads: int) -> float:
    """A plain loop of whole-graph piper calls, one at a time: audio s per wall s."""
    import onnxruntime
    from piper.config import PiperConfig, SynthesisConfig
    from piper.voice import PiperVoice

    from engine.backends.piper.loader import default_voice_files

    files = default_voice_files()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(files.model_path), sess_options=options,
                                           providers=["CPUExecutionProvider"])
    import json

    config = PiperConfig.from_dict(json.loads(files.config_path.read_text(encoding="utf-8")))
    voice = PiperVoice(session=session, config=config)
    synth = SynthesisConfig()

    def speak(text: str) -> int:
        return sum(len(chunk.audio_float_array) for chunk in voice.synthesize(text, synth))

    for text in texts[:3]:
        speak(text)  # warm-up
    made, start, k = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        made += speak(texts[k % len(texts)])
        k += 1
    return made / config.sample_rate / (time.perf_counter() - start)


async def engine_throughput(texts: list[str], seconds: float, streams: int,
                            options: dict[str, str] | None = None) -> tuple[float, dict[str, Any]]:
    backend = PiperBackend(config_from_options(PiperBackendConfig, "piper", options or {}))
    engine = Engine(backend, EngineConfig())
    await engine.start()
    counter = iter(range(10**9))
    made = [0.0]
    measuring = [False]

    async def reader(index: int, until: float) -> None:
        rng = random.Random(index)
        while time.monotonic() < until:
            text = texts[rng.randrange(len(texts))]
            request = SynthesisRequest(RequestId(f"s{index}:{next(counter)}"), text, "joe",
                                       context_key=f"s{index}")
            async for chunk in engine.submit(request):
                if measuring[0]:
                    made[0] += chunk.duration_ms / 1000.0

    warm_up = 3.0
    start = time.monotonic()
    tasks = [asyncio.create_task(reader(i, start + warm_up + seconds)) for i in range(streams)]
    await asyncio.sleep(warm_up)
    measuring[0] = True
    began = time.monotonic()
    steps0, busy0 = engine.stats.num_steps, engine.stats.busy_seconds
    await asyncio.sleep(seconds)
    measuring[0] = False
    elapsed = time.monotonic() - began
    steps = engine.stats.num_steps - steps0
    # Steps that were running when the window closed count from their end: about one step each.
    busy = (engine.stats.busy_seconds - busy0) / (elapsed * engine.num_lanes)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.stop()
    return made[0] / elapsed, {"steps_per_s": steps / elapsed, "lanes_busy": busy,
                               "lanes": engine.num_lanes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a piper backend option for the engine run (as `voxgate serve` takes "
                             "it)")
    parser.add_argument("--memory-profile", choices=["compact", "fast"],
                        help="glibc malloc settings as `voxgate serve --memory-profile` sets them")
    args = parser.parse_args()
    options = dict(option.split("=", 1) for option in args.engine_option)
    if args.memory_profile:
        from gateway.cli import tune_malloc

        tune_malloc(args.memory_profile)
    np.random.seed(args.seed)
    texts = corpus_sentences(args.seed)
    cores = os.cpu_count() or 1
    limit = raw_limit(texts, args.seconds, cores)
    one_core = raw_limit(texts, args.seconds, 1)
    engine, extra = asyncio.run(engine_throughput(texts, args.seconds, args.streams, options))
    malloc = args.memory_profile or "glibc defaults"
    print(f"{len(texts)} corpus sentences, {args.seconds:g} s per measurement, {cores} cores, "
          f"load average {os.getloadavg()[0]:.1f}, malloc {malloc}")
    print("| what | audio s per wall s | share of the raw limit |")
    print("|---|---:|---:|")
    print(
        f"| raw limit: plain piper loop, one call at a time, {cores} cores | {limit:.1f} | 100% |")
    print(f"| plain piper loop, 1 core | {one_core:.1f} | {one_core / limit:.0%} |")
    label = ", ".join(args.engine_option) or "defaults"
    print(f"| voxgate engine, {args.streams} streams due now (windows, {label}) | {engine:.1f} | "
          f"{engine / limit:.0%} |")
    print(f"engine steps per second: {extra['steps_per_s']:.1f}; {extra['lanes']} lanes busy "
          f"{extra['lanes_busy']:.0%} of the time")
    if extra["lanes_busy"] < 0.95:
        print(f"the engine was not saturated (lanes busy {extra['lanes_busy']:.0%} < 95%): "
              "raise --streams")


if __name__ == "__main__":
    main()
