"""The three load shapes: a fixed fleet, a capacity sweep, an open-loop arrival rate.

Each run is bounded: by its duration (no turn starts after it), a drain period
for the turns still running (then they are aborted and counted as such), and a
turn budget. The tool's own CPU time is measured over every run, since on a
small machine it competes with the server it measures.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO
from typing import Protocol as TypingProtocol

from loadtest.anchor import PiperHttpSession
from loadtest.client import SpeechRate, VoxgateSession
from loadtest.config import MAX_DURATION_S, MAX_RATE_PER_S, MAX_SESSIONS, LoadConfig, Protocol
from loadtest.corpus import Answer
from loadtest.metrics import (
    TTFA_TARGET_MS,
    RunStats,
    TurnRecord,
    passes,
    percentile,
    summarize,
)


class _Session(TypingProtocol):
    num_connect_failures: int

    async def run(self, deadline: float, max_turns: int | None = ...,
                  first_think: bool = ...) -> None: ...


@dataclass(slots=True)
class LevelResult:
    """One load level: its label, the raw turns and the summary."""

    label: str
    sessions: int
    turns: list[TurnRecord]
    summary: dict[str, Any]

    def to_dict(self, with_turns: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label, "sessions": self.sessions,
                               "summary": self.summary}
        if with_turns:
            out["turns"] = [t.to_dict() for t in self.turns]
        return out


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _make_session(index: int, config: LoadConfig, corpus: list[Answer],
                  records: list[TurnRecord], rate: SpeechRate, budget: list[int]) -> _Session:
    if config.protocol is Protocol.PIPER_HTTP:
        return PiperHttpSession(index, config, corpus, records, budget)
    return VoxgateSession(index, config, corpus, records, rate, budget)


class Progress:
    """A one-line live view, refreshed once a second (cheap: no sorting of big lists)."""

    def __init__(self, label: str, records: list[TurnRecord], stream: TextIO | None) -> None:
        self.label = label
        self.records = records
        self.stream = stream
        self.active = 0

    async def run(self, started: float) -> None:
        if self.stream is None:
            return
        is_tty = self.stream.isatty()
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(1.0)
            recent = [t.ttfa_segment_ms for t in self.records[-500:]
                      if t.ttfa_segment_ms is not None]
            p95 = f"{percentile(recent, 95):.0f}ms" if recent else "-"
            gaps = sum(t.num_gaps for t in self.records)
            errors = sum(len(t.error_codes) for t in self.records)
            audio_s = sum(t.audio_ms for t in self.records) / 1000.0
            line = (f"[{self.label}] {loop.time() - started:6.1f}s active={self.active} "
                    f"turns={len(self.records)} ttfa_p95={p95} gaps={gaps} "
                    f"errors={errors} audio={audio_s:.1f}s")
            self.stream.write(("\r" + line + "\x1b[K") if is_tty else line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.stream.isatty():
            self.stream.write("\n")


async def _bounded(tasks: list[asyncio.Task[None]], drain_until: float) -> None:
    """Wait for the sessions until the drain deadline, then stop the stragglers."""
    loop = asyncio.get_running_loop()
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, drain_until - loop.time()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_fixed(config: LoadConfig, corpus: list[Answer], sessions: int, duration_s: float,
                    label: str = "fixed", progress: TextIO | None = None,
                    ttfa_target_ms: float = TTFA_TARGET_MS) -> LevelResult:
    """N sessions, each playing turns back to back (with think time) for `duration_s`.

    `ttfa_target_ms` is the first-audio target, which also tells text-late gaps
    from the server's (metrics.is_text_late).
    """
    if not 1 <= sessions <= MAX_SESSIONS:
        raise ValueError(f"expected sessions within 1-{MAX_SESSIONS}, got {sessions}")
    if not 0 < duration_s <= MAX_DURATION_S:
        raise ValueError(f"expected duration_s within (0, {MAX_DURATION_S:g}], got {duration_s}")
    loop = asyncio.get_running_loop()
    records: list[TurnRecord] = []
    budget = [config.max_turns]
    rate = SpeechRate()
    fleet = [_make_session(i, config, corpus, records, rate, budget) for i in range(sessions)]
    view = Progress(f"{label} n={sessions}", records, progress)
    view.active = sessions
    cpu0, wall0 = _cpu_s(), time.monotonic()
    started = loop.time()
    deadline = started + duration_s
    ticker = asyncio.create_task(view.run(started))
    tasks = [asyncio.create_task(s.run(deadline)) for s in fleet]
    try:
        await _bounded(tasks, deadline + config.drain_s)
    finally:
        ticker.cancel()
        view.close()
    stats = RunStats(time.monotonic() - wall0, _cpu_s() - cpu0, sessions,
                     sum(s.num_connect_failures for s in fleet), os.cpu_count() or 1)
    return LevelResult(label, sessions, records, summarize(records, stats, ttfa_target_ms))


async def run_open_loop(config: LoadConfig, corpus: list[Answer], rate_per_s: float,
                        duration_s: float, max_inflight: int = 256, turns_per_arrival: int = 1,
                        progress: TextIO | None = None,
                        ttfa_target_ms: float = TTFA_TARGET_MS) -> LevelResult:
    """Poisson arrivals at `rate_per_s`: each opens a session for a few turns and leaves.

    Open loop: arrivals do not wait for the server, so overload shows as growing
    TTFA instead of a slower fleet. Arrivals beyond `max_inflight` are turned
    away by the client and counted under errors as `client_overflow`. `ttfa_target_ms`
    tells text-late gaps from the server's, as for `run_fixed`.
    """
    if not 0 < rate_per_s <= MAX_RATE_PER_S:
        raise ValueError(f"expected rate_per_s within (0, {MAX_RATE_PER_S:g}], got {rate_per_s}")
    if not 0 < duration_s <= MAX_DURATION_S:
        raise ValueError(f"expected duration_s within (0, {MAX_DURATION_S:g}], got {duration_s}")
    if not 1 <= max_inflight <= MAX_SESSIONS:
        raise ValueError(f"expected max_inflight within 1-{MAX_SESSIONS}, got {max_inflight}")
    loop = asyncio.get_running_loop()
    records: list[TurnRecord] = []
    budget = [config.max_turns]
    speech = SpeechRate()
    rng = random.Random(config.seed)
    view = Progress(f"rate {rate_per_s:g}/s", records, progress)
    cpu0, wall0 = _cpu_s(), time.monotonic()
    started = loop.time()
    deadline = started + duration_s
    ticker = asyncio.create_task(view.run(started))
    tasks: list[asyncio.Task[None]] = []
    fleet: list[_Session] = []
    overflow = 0
    next_at = started
    try:
        while True:
            next_at += rng.expovariate(rate_per_s)
            if next_at >= deadline or budget[0] <= 0:
                break
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            tasks = [t for t in tasks if not t.done()]
            view.active = len(tasks)
            if len(tasks) >= max_inflight:
                overflow += 1
                continue
            session = _make_session(len(fleet), config, corpus, records, speech, budget)
            fleet.append(session)
            tasks.append(asyncio.create_task(
                session.run(deadline + config.turn_timeout_s, turns_per_arrival, False)))
        await _bounded(tasks, deadline + config.drain_s)
    finally:
        ticker.cancel()
        view.close()
    stats = RunStats(time.monotonic() - wall0, _cpu_s() - cpu0, len(fleet),
                     sum(s.num_connect_failures for s in fleet), os.cpu_count() or 1)
    summary = summarize(records, stats, ttfa_target_ms)
    if overflow:
        summary["errors"]["client_overflow"] = overflow
    summary["run"]["arrival_rate_per_s"] = rate_per_s
    return LevelResult(f"rate {rate_per_s:g}/s", len(fleet), records, summary)


def sweep_levels(max_sessions: int, start: int = 1) -> list[int]:
    """Doubling levels from `start` up to and including `max_sessions`."""
    if not 1 <= start <= max_sessions <= MAX_SESSIONS:
        raise ValueError(f"expected 1 <= start <= max_sessions <= {MAX_SESSIONS}, "
                         f"got start={start}, max_sessions={max_sessions}")
    levels, n = [], start
    while n < max_sessions:
        levels.append(n)
        n *= 2
    return levels + [max_sessions]


async def run_sweep(config: LoadConfig, corpus: list[Answer], levels: list[int],
                    duration_s: float, ttfa_target_ms: float, bisect: int = 2,
                    progress: TextIO | None = None, stop_at_failure: bool = True,
                    ) -> tuple[list[LevelResult], int]:
    """Climb the levels until one fails, then bisect the last step; return the capacity.

    Capacity is the largest N that held (TTFA p95 <= target, no gap the server
    could have avoided, no failed turn; metrics.passes) with every level below
    it holding too; 0 when even the first level failed. `stop_at_failure=False`
    runs every level (the anchor replays the target's levels so that the two
    compare point by point).
    """
    if not levels or sorted(set(levels)) != levels:
        raise ValueError(f"expected strictly increasing levels, got {levels}")
    results: list[LevelResult] = []
    held, broke = 0, None
    for n in levels:
        result = await run_fixed(config, corpus, n, duration_s, "sweep", progress,
                                 ttfa_target_ms)
        result.summary["passes"] = passes(result.summary, ttfa_target_ms)
        results.append(result)
        if broke is not None:
            continue
        if not result.summary["passes"]:
            broke = n
            if stop_at_failure:
                break
        else:
            held = n
    for _ in range(bisect):
        if broke is None or broke - held <= 1:
            break
        n = (held + broke) // 2
        result = await run_fixed(config, corpus, n, duration_s, "sweep", progress,
                                 ttfa_target_ms)
        result.summary["passes"] = passes(result.summary, ttfa_target_ms)
        results.append(result)
        if result.summary["passes"]:
            held = n
        else:
            broke = n
    results.sort(key=lambda r: r.sessions)
    return results, held


def stderr_if(enabled: bool) -> TextIO | None:
    return sys.stderr if enabled else None
