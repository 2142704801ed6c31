"""The GPU-shaped engine alone, no gateway: what its own scheduling and costs allow (the floor).

The real `engine.Engine` drives `GpuShapedBackend` (bench/gpu_shaped.py) in this process, and
simulated listeners take its chunks directly: no socket, no Opus, no session. Each listener plays
turns of two or three sentences (bench.gpu_gateway_load's answers), every segment submitted at the
turn's start with the due time the gateway would give it (the first "now", each later one when
the text before it should end), hears the audio on a playback clock, thinks 1-3 s, and goes on.
So a level's TTFA and gaps here are what the engine model gives with a host that costs nothing:
bench.gateway_scale's numbers through the gateway compare with these (`--floor`).

    python -m bench.gpu_shaped_floor --sessions 32,128,256 [--duration 30] [--shape pipeline]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from bench.gpu_gateway_load import ANSWERS
from bench.gpu_shaped import GpuShape, GpuShapedBackend
from engine.engine import Engine, EngineConfig
from engine.scheduler import SchedulerConfig
from engine.types import RequestId, SynthesisRequest


@dataclass(slots=True)
class _Turns:
    """What the listeners heard: first audio (ms) and gaps of every turn."""

    ttfa_ms: list[float] = field(default_factory=list)
    num_gaps: int = 0
    gap_ms: float = 0.0
    audio_s: float = 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _listen(index: int, engine: Engine, until: float, out: _Turns) -> None:
    rng = random.Random(index)
    await asyncio.sleep(rng.uniform(0.0, 2.0))  # the fleet's first turns spread over a think time
    turn = 0
    while time.monotonic() < until:
        key = f"s{index}-t{turn}"
        turn += 1
        engine.admit(key)
        started = time.monotonic()
        streams = []
        for i, text in enumerate(
            s.strip() + "." for s in rng.choice(ANSWERS).split(".") if s.strip()
        ):
            # one context: the engine times each segment from the one before it (engine/clock.py)
            request = SynthesisRequest(RequestId(f"{key}-{i}"), text, "joe", context_key=key)
            streams.append(engine.submit(request))
        run_out: float | None = None
        for stream in streams:
            async for chunk in stream:
                now = time.monotonic()
                if run_out is None:
                    out.ttfa_ms.append(1000.0 * (now - started))
                    run_out = now
                elif now > run_out:
                    out.num_gaps += 1
                    out.gap_ms += 1000.0 * (now - run_out)
                    run_out = now
                run_out += chunk.duration_ms / 1000.0
                out.audio_s += chunk.duration_ms / 1000.0
        engine.release_context(key)
        played = max(0.0, (run_out or 0.0) - time.monotonic())
        await asyncio.sleep(played + rng.uniform(1.0, 3.0))


async def run_level(sessions: int, duration_s: float, shape: GpuShape) -> dict[str, Any]:
    """One level: `sessions` listeners for `duration_s` (turns running then finish)."""
    backend = GpuShapedBackend(shape)
    scheduler = SchedulerConfig(
        max_batch_size=shape.max_batch_size, max_contexts=shape.context_capacity
    )
    engine = Engine(backend, EngineConfig(scheduler=scheduler))
    await engine.start()
    before, turns = backend.snapshot(), _Turns()
    misses0 = engine.scheduler.stats.num_deadline_misses
    wall0, cpu0 = time.monotonic(), time.process_time()
    until = wall0 + duration_s
    try:
        await asyncio.gather(*(_listen(i, engine, until, turns) for i in range(sessions)))
    finally:
        wall = time.monotonic() - wall0
        cpu = time.process_time() - cpu0
        await engine.stop()
    after = backend.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    return {
        "sessions": sessions,
        "turns": len(turns.ttfa_ms),
        "ttfa_p50_ms": percentile(turns.ttfa_ms, 50),
        "ttfa_p95_ms": percentile(turns.ttfa_ms, 95),
        "gaps": turns.num_gaps,
        "gap_s": turns.gap_ms / 1000.0,
        "audio_s_per_s": turns.audio_s / wall,
        "wall_s": wall,
        "cpu_cores": cpu / wall,
        "steps": delta["lm_steps"],
        "mean_batch": delta["lm_items"] / max(delta["lm_steps"], 1),
        "deadline_misses": engine.scheduler.stats.num_deadline_misses - misses0,
        "lm_busy": delta["lm_busy_s"] / wall,
        "flow_busy": delta["flow_busy_s"] / wall,
        "mean_tick_streams": delta["tick_streams"] / max(delta["ticks"], 1),
    }


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| sessions | TTFA p50 / p95 ms | gaps (s) | audio-s/s | steps (mean batch) | misses "
            "| LM / flow busy |"
        ),
        "|---:|---|---|---:|---|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['sessions']} | {r['ttfa_p50_ms']:.0f} / {r['ttfa_p95_ms']:.0f} "
            f"| {r['gaps']} ({r['gap_s']:.1f}) | {r['audio_s_per_s']:.0f} "
            f"| {r['steps']:.0f} ({r['mean_batch']:.1f}) | {r['deadline_misses']} "
            f"| {r['lm_busy']:.2f} / {r['flow_busy']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", default="32,64,128,256", help="comma-separated levels")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="pipeline|KEY=VALUE",
        help="the engine's costs (bench/gpu_shaped.py), repeatable",
    )
    args = parser.parse_args(argv)
    shape = GpuShape.from_spec(args.shape)
    rows = [asyncio.run(run_level(int(n), args.duration, shape)) for n in args.sessions.split(",")]
    print(format_rows(rows))
    return rows


if __name__ == "__main__":
    main()
