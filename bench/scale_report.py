"""bench.gateway_scale's reading of the load tool's JSON and its table (one row per level)."""

from __future__ import annotations

from typing import Any

from loadtest.metrics import percentile


def find_summary(report: Any) -> dict[str, Any]:
    """The load tool's level summary wherever its JSON puts it (the first `summary` key)."""
    if isinstance(report, dict):
        summary = report.get("summary")
        if isinstance(summary, dict):
            return summary
        for value in report.values():
            if found := find_summary(value):
                return found
    return {}


def find_key(report: Any, key: str) -> Any:
    """The first value under `key` anywhere in the load tool's JSON (None: not there)."""
    if isinstance(report, dict):
        if key in report:
            return report[key]
        for value in report.values():
            if (found := find_key(value, key)) is not None:
                return found
    return None


def first_and_later_p95(turns: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """TTFA p95 of each session's first turn (the fleet starts within one think time: a burst
    of first turns) and of the turns after it (the steady state), as the load tool's own."""
    seen: set[int] = set()
    first: list[float] = []
    later: list[float] = []
    for turn in turns:  # in the order they started
        ttfa = turn.get("ttfa_segment_ms")
        is_first = turn["session"] not in seen
        seen.add(turn["session"])
        if ttfa is not None:
            (first if is_first else later).append(ttfa)
    return (percentile(first, 95) if first else None,
            percentile(later, 95) if later else None)


def histogram_quantile(samples: dict[str, float], name: str, q: float) -> float | None:
    """The `q` quantile (0-1) of histogram `name` from its cumulative buckets in `samples`
    (`name_bucket{le="bound"}` keys, as bench.gpu_gateway_load's `engine_metrics` reads them),
    linear within a bucket as Prometheus's histogram_quantile; None with no observation."""
    prefix = name + '_bucket{le="'
    buckets = sorted((float(key[len(prefix):-2]), count) for key, count in samples.items()
                     if key.startswith(prefix))
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower  # past the last bound: its bound, as Prometheus answers
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def histogram_quantile_ms(samples: dict[str, float], name: str, q: float) -> float | None:
    """`histogram_quantile` of a histogram in seconds, in milliseconds."""
    value = histogram_quantile(samples, name, q)
    return None if value is None else 1000.0 * value


def num(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| build | sessions | TTFA p50 / p95 ms | p95 first / later turns "
            "| engine's first audio p50 / p95 "
            "| gaps (text-late, inside a segment; turns, silence s) | audio-s/s "
            "| server cores | CPU ms per audio-s (per process) | loop thread | engine threads "
            "| encode thread | steps, busy s | misses | GPU LM / flow busy | load tool cores "
            "| holds |"
        ),
        "|---|---:|---|---|---|---|---:|---:|---|---:|---:|---:|---|---:|---|---:|---|",
    ]
    for r in rows:
        per_process = " + ".join(
            num(p["cpu_ms_per_audio_s"], ".1f") for p in r["processes"] if p["cpu_s"] > 0.05
        )
        eng, gpu = r["engine"], r["gpu_model"]
        lines.append(
            f"| {r['build']} ({r['commit']}, {r['workers']}p) | {r['sessions']} "
            f"| {num(r['ttfa_p50_ms'])} / {num(r['ttfa_p95_ms'])} "
            f"| {num(r.get('ttfa_p95_first_turns_ms'))} / {num(r.get('ttfa_p95_later_turns_ms'))} "
            f"| {num(eng.get('first_audio_p50_ms'))} / {num(eng.get('first_audio_p95_ms'))} "
            f"| {r['gaps']} ({r.get('text_late_gaps', 0)}, {r.get('inside_segment_gaps', 0)}; "
            f"{r['turns_with_gaps']}, "
            f"{r['gap_s']:.1f}) | {r['audio_s_per_s']:.0f} "
            f"| {r['server_cores']:.2f} | {num(r['cpu_ms_per_audio_s'], '.1f')}"
            f"{f' ({per_process})' if len(r['processes']) > 1 else ''} "
            f"| {num(r['loop_thread_cores'], '.2f')} | {r['engine_thread_cores']:.2f} "
            f"| {r.get('encode_thread_cores', 0.0):.2f} "
            f"| {eng['steps']:.0f}, {eng['busy_s']:.0f} | {eng['deadline_misses']:.0f} "
            f"| {gpu['lm_busy']:.2f} / {gpu['flow_busy']:.2f} | {r['load_tool_cores']:.2f} "
            f"| {'yes' if r['holds'] else 'no'} |"
        )
    return "\n".join(lines)
