"""The report: a table for the terminal, JSON for machines, PNG plots for people."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from loadtest.runner import LevelResult

_ROWS = (
    ("TTFA, segment complete -> first frame (ms)", "ttfa_segment_ms"),
    ("TTFA, first token -> first frame (ms)", "ttfa_first_token_ms"),
    ("cancel -> cancelled (ms)", "cancel_latency_ms"),
    ("cancel -> last audio frame (ms)", "cancel_to_last_frame_ms"),
    ("gap length (ms)", "gap_ms"),
)


def _fmt(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def format_table(result: LevelResult) -> str:
    """The distributions as p50/p90/p95/p99, then counts, errors and the tool's CPU."""
    s = result.summary
    head = f"{'':44} {'n':>6} {'p50':>7} {'p90':>7} {'p95':>7} {'p99':>7} {'max':>7}"
    lines = [f"== {result.label}: {result.sessions} sessions ==", head]
    for title, key in _ROWS:
        dist = s["gaps"]["gap_ms"] if key == "gap_ms" else s[key]
        lines.append(f"{title:44} {dist['n']:>6} " + " ".join(
            f"{_fmt(dist[k]):>7}" for k in ("p50", "p90", "p95", "p99", "max")))
    t, g, a, r = s["turns"], s["gaps"], s["audio"], s["run"]
    lines.append(
        f"turns: {t['started']} started = {t['completed']} completed + {t['cancelled']} "
        f"cancelled + {t['failed']} failed + {t['timed_out']} timed out + {t['aborted']} aborted"
        f" ({t['aborted_without_audio']} of them still silent)")
    lines.append(f"gaps: {g['count']} = {g['server']} server ({g['server_at_segment_start']} at "
                 f"a segment's start, {g['server_inside_segment']} inside one) + "
                 f"{g['text_late']} text-late "
                 f"({g['total_ms']:.0f} ms in all, {g['turns_with_gaps']} turns affected)")
    lines.append(f"audio: {a['seconds']:.1f} s in {a['frames']} frames "
                 f"({a['per_wall_second']:.2f} s of audio per second)")
    text = s["text"]
    spoken = ", ".join(f"{k} {v}" for k, v in text["spoken_letters_by_script"].items()) or "none"
    skipped = ", ".join(f"{k} {v}" for k, v in text["skipped_chars_by_language"].items()) or "none"
    lines.append(f"text: {text['spoken_letters']} letters spoken ({spoken}), "
                 f"{text['skipped_chars']} characters skipped "
                 f"({skipped}: no voice for their language)")
    lines.append("errors: " + (", ".join(f"{k}={v}" for k, v in s["errors"].items()) or "none"))
    if s["violations"]:
        lines.append("protocol violations: "
                     + ", ".join(f"{k}={v}" for k, v in s["violations"].items()))
    lines.append(f"client: {r['client_cpu_s']:.1f} s CPU over {r['wall_s']:.1f} s "
                 f"= {100 * r['client_cpu_share_of_one_core']:.1f}% of one core "
                 f"({100 * r['client_cpu_share_of_machine']:.1f}% of {r['cores']} cores)")
    if "passes" in s:
        lines.append("holds" if s["passes"] else "does not hold")
    return "\n".join(lines)


def format_sweep(name: str, results: list[LevelResult], capacity: int,
                 ttfa_target_ms: float) -> str:
    """One line per level, then the capacity."""
    title = (f"== capacity sweep: {name} (TTFA p95 <= {ttfa_target_ms:g} ms, no server gaps, "
             "no failed or silent turns) ==")
    head = (f"{'sessions':>8} {'turns':>6} {'ttfa p50':>9} {'ttfa p95':>9} {'ttfa p99':>9} "
            f"{'gaps':>18} {'unserved':>8} {'cpu %':>6}  holds")
    lines = [title, head]
    for r in results:
        s = r.summary
        d = s["ttfa_segment_ms"]
        t, g = s["turns"], s["gaps"]
        gaps = f"{g['count']} ({g['text_late']} text-late)"
        unserved = t["failed"] + t["timed_out"] + t["aborted_without_audio"]
        lines.append(
            f"{r.sessions:>8} {s['turns']['started']:>6} {_fmt(d['p50']):>9} "
            f"{_fmt(d['p95']):>9} {_fmt(d['p99']):>9} {gaps:>18} "
            f"{unserved:>8} "
            f"{100 * s['run']['client_cpu_share_of_one_core']:>6.1f}  "
            f"{'yes' if s.get('passes') else 'no'}")
    lines.append(f"capacity: {capacity} sessions")
    return "\n".join(lines)


def _clean(value: Any) -> Any:
    """NaN is not JSON: write null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(report: dict[str, Any], path: str | Path) -> None:
    text = json.dumps(_clean(report), indent=2, ensure_ascii=False)
    if str(path) == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n", encoding="utf-8")


def plot_ttfa(series: dict[str, list[LevelResult]], ttfa_target_ms: float,
              path: str | Path) -> None:
    """TTFA distributions as empirical CDFs: one panel per target, one line per level."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 4), dpi=110,
                             sharex=True, sharey=True, squeeze=False)
    levels = sorted({r.sessions for results in series.values() for r in results})
    colours = plt.get_cmap("viridis")
    lowest, highest = math.inf, -math.inf
    for ax, (name, results) in zip(axes[0], series.items(), strict=True):
        for r in sorted(results, key=lambda r: r.sessions):
            values = sorted(t.ttfa_segment_ms for t in r.turns if t.ttfa_segment_ms is not None)
            if not values:
                continue
            ys = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
            shade = colours(0.85 * levels.index(r.sessions) / max(1, len(levels) - 1))
            ax.step([values[0], *values], ys, where="post", color=shade,
                    marker="." if len(values) < 30 else None,
                    label=f"{r.sessions} sessions (n={len(values)})")
            lowest, highest = min(lowest, values[0]), max(highest, values[-1])
        ax.axvline(ttfa_target_ms, color="grey", linestyle=":")
        ax.set_title(name)
        ax.set_xlabel("TTFA: first segment complete -> first audio (ms)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="lower right", fontsize=8)
    if 0 < lowest and highest / lowest > 20:  # the levels span orders of magnitude
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

        ax0 = axes[0][0]
        ax0.set_xscale("log")
        ax0.xaxis.set_major_locator(LogLocator(subs=(1.0, 3.0)))
        ax0.xaxis.set_major_formatter(ScalarFormatter())
        ax0.xaxis.set_minor_formatter(NullFormatter())
    axes[0][0].set_ylabel("share of turns")
    axes[0][0].set_ylim(0, 1.01)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_capacity(series: dict[str, list[LevelResult]], ttfa_target_ms: float,
                  path: str | Path) -> None:
    """TTFA p50/p95 against concurrent sessions, one colour per target; gaps marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for name, results in series.items():
        xs = [r.sessions for r in results]
        p95 = [r.summary["ttfa_segment_ms"]["p95"] for r in results]
        p50 = [r.summary["ttfa_segment_ms"]["p50"] for r in results]
        (line,) = ax.plot(xs, p95, marker="o", label=f"{name} p95")
        ax.plot(xs, p50, marker=".", linestyle="--", color=line.get_color(),
                label=f"{name} p50")
        gapped = [(x, y) for x, y, r in zip(xs, p95, results, strict=True)
                  if r.summary["gaps"]["count"]]
        if gapped:
            ax.scatter(*zip(*gapped, strict=True), marker="x", s=80, color="red", zorder=3,
                       label=f"{name}: gaps heard")
    ax.axhline(ttfa_target_ms, color="grey", linestyle=":", label=f"target {ttfa_target_ms:g} ms")
    levels = sorted({r.sessions for results in series.values() for r in results})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("concurrent talking sessions")
    ax.set_ylabel("TTFA (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


