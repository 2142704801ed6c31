"""Render docs/grafana-voxgate.json's panels from real /metrics scrapes (no Grafana needed).

    python -m bench.bench_ray_dashboard --sessions 4 --duration 40 --out
    docs/img/grafana-voxgate.png

Starts `voxgate ray-serve` (1 gateway, 1 engine replica) on a free port, drives
it with `voxgate-loadtest run`, scrapes /metrics every `--period` seconds, and
draws each dashboard panel with matplotlib, computing what its PromQL asks
(rates over a window, `histogram_quantile` by linear interpolation in the
bucket) from the scraped samples. It is a rendering of the dashboard on real
data, not a Grafana screenshot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.bench_ray_serve import free_port, stop, wait_ready

Sample = dict[str, float]  # "name{label=value,...}" -> value


def scrape(url: str) -> Sample:
    out: Sample = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over (upper bound, cumulative count) pairs."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def _buckets(sample: Sample, name: str) -> list[tuple[float, float]]:
    out = []
    for key, value in sample.items():
        if key.startswith(name + "_bucket{"):
            le = key.split("le=")[1].rstrip("}").split(",")[0]
            out.append((float(le), value))
    return out


def series(scrapes: list[tuple[float, Sample]], window: int) -> dict[str, list[float]]:
    """Each panel's lines, one point per scrape after the first `window` scrapes."""
    lines: dict[str, list[float]] = {k: [] for k in (
        "t", "ttfa_p50", "ttfa_p95", "late_rate", "late_p95", "step_p50", "step_p95", "queue",
        "contexts", "max_contexts", "sessions", "errors")}
    for i in range(window, len(scrapes)):
        (t0, a), (t1, b) = scrapes[i - window], scrapes[i]
        span = t1 - t0

        def delta_buckets(name: str, a: Sample = a, b: Sample = b) -> list[tuple[float, float]]:
            old = dict(_buckets(a, name))
            return [(le, v - old.get(le, 0.0)) for le, v in _buckets(b, name)]

        def value(key: str, s: Sample = b) -> float:
            return s.get(key, 0.0)

        lines["t"].append(t1 - scrapes[0][0])
        lines["ttfa_p50"].append(quantile(0.5, delta_buckets("voxgate_ttfa_seconds")))
        lines["ttfa_p95"].append(quantile(0.95, delta_buckets("voxgate_ttfa_seconds")))
        late = (value("voxgate_late_audio_seconds_count{}")
                - value("voxgate_late_audio_seconds_count{}", a))
        lines["late_rate"].append(late / span)
        lines["late_p95"].append(quantile(0.95, delta_buckets("voxgate_late_audio_seconds")))
        lines["step_p50"].append(quantile(0.5,
                                          delta_buckets("voxgate_engine_step_duration_seconds")))
        lines["step_p95"].append(quantile(0.95,
                                          delta_buckets("voxgate_engine_step_duration_seconds")))
        lines["queue"].append(value("voxgate_engine_queue_depth{}"))
        lines["contexts"].append(value("voxgate_engine_active_contexts{}"))
        lines["max_contexts"].append(value("voxgate_engine_max_contexts{}"))
        lines["sessions"].append(value("voxgate_sessions{}"))
        errors = sum(v for k, v in b.items() if k.startswith("voxgate_errors_total{"))
        errors_before = sum(v for k, v in a.items() if k.startswith("voxgate_errors_total{"))
        lines["errors"].append((errors - errors_before) / span)
    return lines


def render(lines: dict[str, list[float]], dashboard: dict[str, Any], out: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = [(["ttfa_p50", "ttfa_p95"], ["p50", "p95"], "s"),
             (["late_rate", "late_p95"], ["late messages / s", "p95 lateness (s)"], ""),
             (["step_p50", "step_p95"], ["p50", "p95"], "s"),
             (["queue", "contexts", "max_contexts"], ["queued requests", "talking contexts",
                                                      "admission limit"], ""),
             (["sessions"], ["open sessions (the one gateway replica)"], ""),
             (["errors"], ["error events / s (all codes)"], "")]
    fig, axes = plt.subplots(3, 2, figsize=(14, 10), facecolor="#181b1f")
    # the dashboard's own panels, as many as both have
    for ax, panel, (keys, labels, unit) in zip(axes.flat, dashboard["panels"], plots,
                                               strict=False):
        ax.set_facecolor("#111217")
        for key, label in zip(keys, labels, strict=True):
            ax.plot(lines["t"], lines[key], label=label, linewidth=1.6)
        ax.set_title(panel["title"], color="#d8d9da", fontsize=10, loc="left")
        ax.tick_params(colors="#9fa7b3", labelsize=8)
        ax.set_xlabel("seconds into the run", color="#9fa7b3", fontsize=8)
        if unit:
            ax.set_ylabel(unit, color="#9fa7b3", fontsize=8)
        ax.grid(color="#2c3235", linewidth=0.6)
        ax.legend(fontsize=7, facecolor="#181b1f", labelcolor="#d8d9da", edgecolor="#2c3235")
    fig.suptitle(f"{dashboard['title']}: a matplotlib rendering of the dashboard's panels from "
                 f"scraped /metrics, not a Grafana screenshot\n{note}", color="#d8d9da",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, facecolor=fig.get_facecolor())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--period", type=float, default=2.0, help="seconds between scrapes")
    parser.add_argument("--window", type=int, default=5, help="scrapes per rate window")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="docs/img/grafana-voxgate.png")
    parser.add_argument("--dashboard", default="docs/grafana-voxgate.json")
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "XDG_DATA_HOME": tempfile.mkdtemp()}
    server = subprocess.Popen([sys.executable, "-m", "gateway.cli", "ray-serve", "--port",
                               str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, 240)
        load = subprocess.Popen([sys.executable, "-m", "loadtest", "run", "--url", url,
                                 "--sessions",
                                 str(args.sessions), "--duration", str(args.duration), "--seed",
                                 str(args.seed), "--barge-in-rate", "0.2", "--quiet"],
                                stdout=subprocess.DEVNULL)
        scrapes = [(time.monotonic(), scrape(url))]
        while load.poll() is None:
            time.sleep(args.period)
            scrapes.append((time.monotonic(), scrape(url)))
    finally:
        stop(server)
    lines = series(scrapes, args.window)
    dashboard = json.loads(Path(args.dashboard).read_text())
    render(lines, dashboard, Path(args.out),
           f"voxgate ray-serve (1 gateway, 1 engine replica, piper) on a shared 2-core box; "
           f"{args.sessions} loadtest sessions for {args.duration:.0f} s, 20% barge-ins; "
           f"{len(scrapes)} scrapes every {args.period:g} s, rates over {args.window} scrapes")
    print(f"{len(scrapes)} scrapes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
