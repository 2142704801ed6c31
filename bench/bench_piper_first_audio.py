"""Where one talking session's first audio goes, on the engine's own piper calls (joe).

    python -m bench.bench_piper_first_audio [--rounds 40]

Two measurements in one process, each alternating its variants call by call
(the box is shared: compare only inside a run), medians after two warm-up
rounds, over `bench.bench_ttfa`'s sentences:

1. The front part (text encoder, durations, prior) on onnxruntime sessions:
   one thread (what the lanes run), every core, and every core with its
   threads spinning while the call runs (what `Pace.LONE` runs), each with its
   LayerNorms fused as the server loads it (graphs.layernorm); and one thread and
   every core spinning on the graph as piper ships it (unfused), the anchors
   for that rewrite.
2. First audio through the engine, no gateway: `Engine.submit` of one
   sentence, due now, in a context of its own, to its first chunk, one at a
   time. The engine's defaults (the one talking session: a 7-frame first
   window, the spinning front part, the short first flow slice) against the
   same with wider contexts (12 decoder frames each side, the first flow
   slice on the flow's whole context and kept; figures: docs/benchmarks.md,
   "Decoder windows") and with that path off (a 14-frame
   first window, the one-thread front part: what a segment gets while another
   session talks).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_ttfa import SENTENCES
from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.backends.piper.graphs.layernorm import fuse_layer_norms
from engine.backends.piper.graphs.split import split_voice
from engine.backends.piper.loader import LoadedVoice, open_session, read_patched_model
from engine.engine import Engine, EngineConfig
from engine.types import RequestId, SynthesisRequest


def front_sessions(voice: LoadedVoice, cores: int) -> dict[str, Any]:
    """The voice's front part on one thread, every core and every core spinning (some unfused
    too)."""
    split = split_voice(read_patched_model(voice.files))
    if split is None:
        raise SystemExit("the joe voice did not split at its decoder")
    fused, _count = fuse_layer_norms(split.front)
    return {
        "1 thread, LayerNorms unfused": open_session(1, split.front),
        "1 thread": voice.session,
        f"{cores} cores": open_session(cores, fused),
        f"{cores} cores, spinning, LayerNorms unfused": open_session(cores, split.front, spin=True),
        f"{cores} cores, spinning": open_session(cores, fused, spin=True),
    }


def time_fronts(backend: PiperBackend, rounds: int, cores: int) -> dict[str, list[float]]:
    voice = backend.get_voice("joe")
    sessions = front_sessions(voice, cores)
    timings: dict[str, list[float]] = {name: [] for name in sessions}
    for turn in range(rounds + 2):
        item = backend.prepare(SynthesisRequest(RequestId(f"f{turn}"),
                                                SENTENCES[turn % len(SENTENCES)], "joe"))
        state = item.state
        feeds = {"input": np.array([state.ids], dtype=np.int64),
                 "input_lengths": np.array([len(state.ids)], dtype=np.int64),
                 "scales": np.array(state.scales, dtype=np.float32)}
        names = list(sessions) if turn % 2 else list(sessions)[::-1]
        for name in names:
            started = time.perf_counter()
            sessions[name].run(None, feeds)
            if turn >= 2:
                timings[name].append(time.perf_counter() - started)
            time.sleep(0.03)  # as between turns: the threads go to sleep
        backend.release(item)
    return timings


async def time_first_audio(engine: Engine, backend: PiperBackend,
                           rounds: int) -> dict[str, list[float]]:
    voice = backend.get_voice("joe")
    lone_plan, lone_session = backend._plan, voice.lone_session
    off_plan = dataclasses.replace(lone_plan, lone_first_frames=lone_plan.first_frames)
    # wider contexts: 12 frames each side of a window, the first flow slice on 32 and kept
    wide_plan = dataclasses.replace(lone_plan, context_frames=12, first_flow_context_frames=32)
    variants = {"one talking session (defaults)": (lone_plan, lone_session),
                "that, with wider contexts": (wide_plan, lone_session),
                "that path off (as beside another session)": (off_plan, None)}
    timings: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for turn in range(rounds + 2):
            names = list(variants) if turn % 2 else list(variants)[::-1]
            for name in names:
                backend._plan, voice.lone_session = variants[name]
                request_id = RequestId(f"{turn}-{len(timings[name])}-{name[:3]}")
                started = time.perf_counter()
                first = None
                async for _chunk in engine.submit(SynthesisRequest(
                        request_id, SENTENCES[turn % len(SENTENCES)], "joe",
                        context_key=str(request_id))):
                    if first is None:
                        first = time.perf_counter() - started
                if turn >= 2 and first is not None:
                    timings[name].append(first)
                await asyncio.sleep(0.1)
    finally:
        backend._plan, voice.lone_session = lone_plan, lone_session
    return timings


def report(title: str, timings: dict[str, list[float]]) -> None:
    print(f"| {title} | median ms | min | max | n |")
    print("|---|---:|---:|---:|---:|")
    for name, values in timings.items():
        ms = [1000 * v for v in values]
        print(f"| {name} | {statistics.median(ms):.1f} | {min(ms):.1f} | {max(ms):.1f} | {len(ms)} "
              "|")
    print()


async def run(rounds: int) -> None:
    cores = os.cpu_count() or 1
    backend = PiperBackend(PiperBackendConfig())
    engine = Engine(backend, EngineConfig())
    await engine.start()  # loads the backend
    try:
        if backend.get_voice("joe").lone_session is None:
            raise SystemExit("one core: no session runs on every core, nothing to compare")
        report("front part, joe, bench_ttfa's sentences", time_fronts(backend, rounds, cores))
        report("first audio in-process (submit -> first chunk)",
               await time_first_audio(engine, backend, rounds))
    finally:
        await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    asyncio.run(run(args.rounds))


if __name__ == "__main__":
    main()
