"""Can the process around a GPU keep up with it? Sessions through the gateway, a GPU-shaped engine.

    python -m bench.gateway_scale --sessions 32,64,128,256 [--duration 30] [--root OTHER_CHECKOUT]
        [--workers N] [--shape pipeline|KEY=VALUE] [--floor] [--json OUT]

Serves the GPU-shaped synthetic engine (bench/gpu_shaped.py: H200 step times, CosyVoice's
chunks, the GIL released while it "computes") through the product's own `voxgate serve`, in a
child process (bench/gpu_shaped_serve.py), and drives it with the load tool (`python -m
loadtest run`, a process of its own, so its CPU is counted apart) one level of sessions after
another. With `--root` the build in that checkout is served too, level by level beside this
one (the same levels, interleaved, so both see the same box); the synthetic engine and the load
tool are always this checkout's.

Per level and build: TTFA p50/p95, and p95 apart for each session's first turn (the fleet
starts within one think time, so those are a burst) and the turns after it, gaps (count, those
whose text came too late for any server, turns, seconds of silence), audio seconds per
wall second the clients heard, the server's CPU (its process tree: cores, and ms of CPU per
audio second it sent, per process when there are several), the CPU of its threads over the
middle half of the level (the event loop is each process's main thread; the engine's threads are
named `voxgate-engine*`, the encode worker `voxgate-encode*`), the engine's steps, busy seconds
and deadline misses (/metrics), what the synthetic GPU did (LM and flow busy shares, mean
streams a tick), the load tool's own CPU, and whether the level holds: first audio p95 <= 300
ms, no gap the server could have avoided (loadtest/metrics.py, `is_text_late`), no failed or
timed-out turn. `--floor` first runs each level on the engine alone in
this process (no gateway: bench/gpu_shaped_floor.py), the anchor: what the engine model allows
with a free host.

`--workers N` is passed on as `voxgate serve --workers N` to a build whose `serve --help`
offers it, and left out (the build runs one process) where it does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import proc_cpu
from bench.gpu_gateway_load import engine_metrics, free_port, stop_server, wait_ready
from bench.gpu_shaped import GpuShape
from bench.gpu_shaped_floor import format_rows
from bench.gpu_shaped_floor import run_level as run_floor_level
from bench.scale_report import (
    find_key,
    find_summary,
    first_and_later_p95,
    format_table,
    histogram_quantile_ms,
)

REPO = Path(__file__).resolve().parents[1]
SERVE = Path(__file__).resolve().with_name("gpu_shaped_serve.py")
TTFA_TARGET_MS = 300.0
FIRST_AUDIO = "voxgate_engine_first_audio_seconds"
WINDOW = (0.25, 0.75)  # the share of a level over which threads are read: its middle half


@dataclass(slots=True)
class Build:
    """One checkout served: its label, root, commit, and the server once started."""

    label: str
    root: Path
    commit: str
    workers: int = 0  # passed as --workers (0: not passed)
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    stats_file: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def describe(root: Path) -> str:
    """The checkout's commit, `+dirty` when it has uncommitted changes."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], check=False, capture_output=True, text=True
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def has_serve_flag(root: Path, flag: str) -> bool:
    """Whether `voxgate serve` of the checkout at `root` offers `flag`."""
    code = "import sys; from gateway.cli import main; sys.exit(main(['serve', '--help']))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    return flag in done.stdout


def start_server(build: Build, args: argparse.Namespace, shape: GpuShape, workdir: Path) -> None:
    build.port = free_port()
    build.stats_file = workdir / f"{build.label}-gpu.json"
    command = [sys.executable, str(SERVE), "--stats-file", str(build.stats_file)]
    for item in args.shape:
        command += ["--shape", item]
    command += [
        "--",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(build.port),
        "--data-dir",
        str(workdir / f"{build.label}-data"),
        "--max-contexts",
        str(shape.context_capacity),
        "--shutdown-grace",
        "2",
    ]
    if build.workers:
        command += ["--workers", str(build.workers)]
    command += args.server_arg
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(build.root)}
    with (workdir / f"{build.label}-server.log").open("wb") as log:
        build.proc = subprocess.Popen(
            command,
            cwd=build.root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_ready(build.url, build.proc, time.monotonic() + 120)


def read_gpu_stats(build: Build) -> dict[str, float]:
    try:
        return dict(json.loads(build.stats_file.read_text())) if build.stats_file else {}
    except (OSError, ValueError):
        return {}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _sleep_until(deadline: float, proc: subprocess.Popen[bytes]) -> bool:
    """Wait for `deadline`; False if `proc` ended first."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
    return True


def run_level(
    build: Build, sessions: int, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    assert build.proc is not None
    pid, out_json = build.proc.pid, workdir / f"{build.label}-{sessions}.json"
    metrics0, gpu0, tree0, load_cpu0 = (
        engine_metrics(build.url),
        read_gpu_stats(build),
        proc_cpu.sample(pid),
        children_cpu_s(),
    )
    command = [
        sys.executable,
        "-m",
        "loadtest",
        "run",
        "--url",
        build.url,
        "--sessions",
        str(sessions),
        "--duration",
        str(args.duration),
        "--drain",
        str(args.drain),
        "--json",
        str(out_json),
        "--quiet",
        "--turns",
        *args.load_arg,
    ]
    started = time.monotonic()
    with (workdir / f"{build.label}-{sessions}-load.log").open("wb") as log:
        load = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        window: list[proc_cpu.Sample] = []
        for share in WINDOW:
            if _sleep_until(started + share * args.duration, load):
                window.append(proc_cpu.sample(pid))
        code = load.wait(timeout=args.duration + args.drain + 120)
    time.sleep(1.5)  # the stats file and the server's counters settle (written once a second)
    tree1, load_cpu1 = proc_cpu.sample(pid), children_cpu_s()
    metrics1, gpu1 = engine_metrics(build.url), read_gpu_stats(build)
    if code != 0 or not out_json.is_file():
        raise RuntimeError(
            f"expected the load tool to finish, got exit code {code} "
            f"(see {workdir / f'{build.label}-{sessions}-load.log'})"
        )
    report = json.loads(out_json.read_text())
    summary = find_summary(report)
    first_p95, later_p95 = first_and_later_p95(find_key(report, "turns") or [])
    wall = tree1.at - tree0.at
    delta = {k: metrics1.get(k, 0.0) - metrics0.get(k, 0.0) for k in metrics1}
    audio_sent = delta.get("voxgate_audio_sent_seconds_total", 0.0)
    processes, _ = proc_cpu.cores_between(tree0, tree1)
    server_cpu = sum(processes.values())
    threads = proc_cpu.cores_between(*window)[1] if len(window) == 2 else []
    main_threads = {t.pid: cores for t, cores in threads if t.is_main}
    gpu = {k: gpu1.get(k, 0.0) - gpu0.get(k, 0.0) for k in gpu1 if k not in ("pid", "at")}
    ttfa, gaps, turns = (summary.get(k, {}) for k in ("ttfa_segment_ms", "gaps", "turns"))
    row = {
        "build": build.label,
        "commit": build.commit,
        "workers": build.workers or 1,
        "sessions": sessions,
        "ttfa_n": ttfa.get("n", 0),
        "ttfa_p50_ms": ttfa.get("p50"),
        "ttfa_p95_ms": ttfa.get("p95"),
        "ttfa_p95_first_turns_ms": first_p95,
        "ttfa_p95_later_turns_ms": later_p95,
        "gaps": gaps.get("count", 0),
        # gaps whose segment's text came too late for any server (loadtest/metrics.py)
        "text_late_gaps": gaps.get("text_late", 0),
        "server_gaps": gaps.get("server", 0),
        # the server's gaps that fell inside a segment (streaming fell behind), not at a
        # segment's first audio (a first-audio miss)
        "inside_segment_gaps": gaps.get("server_inside_segment", 0),
        "gap_s": gaps.get("total_ms", 0.0) / 1000.0,
        "turns_with_gaps": gaps.get("turns_with_gaps", 0),
        "turns": turns,
        "errors": summary.get("errors", {}),
        "audio_s_per_s": summary.get("audio", {}).get("per_wall_second", 0.0),
        "audio_sent_s": audio_sent,
        "wall_s": wall,
        "server_cores": server_cpu / wall,
        "cpu_ms_per_audio_s": 1000.0 * server_cpu / audio_sent if audio_sent else None,
        "processes": [
            {
                "pid": p,
                "cpu_s": cpu,
                "main_thread_cores": main_threads.get(p),
                "cpu_ms_per_audio_s": 1000.0 * cpu / audio_sent if audio_sent else None,
            }
            for p, cpu in sorted(processes.items(), key=lambda kv: -kv[1])
        ],
        "loop_thread_cores": max(main_threads.values(), default=None),
        "engine_thread_cores": sum(c for t, c in threads if t.name.startswith("voxgate-engine")),
        "encode_thread_cores": sum(c for t, c in threads if t.name.startswith("voxgate-encode")),
        "threads": [
            {"pid": t.pid, "tid": t.tid, "name": t.name, "cores": round(c, 3)}
            for t, c in threads
            if c >= 0.01
        ],
        "engine": {
            "steps": delta.get("voxgate_engine_steps_total", 0.0),
            "busy_s": delta.get("voxgate_engine_busy_seconds_total", 0.0),
            "deadline_misses": delta.get("voxgate_engine_deadline_misses_total", 0.0),
            "refused": delta.get("voxgate_engine_contexts_refused_total", 0.0),
            # a context's first audio, from when it was needed to the step that made it (None:
            # a build without the histogram); TTFA less this is what the gateway added
            "first_audio_p50_ms": histogram_quantile_ms(delta, FIRST_AUDIO, 0.5),
            "first_audio_p95_ms": histogram_quantile_ms(delta, FIRST_AUDIO, 0.95),
        },
        "gpu_model": {
            "lm_busy": gpu.get("lm_busy_s", 0.0) / wall,
            "flow_busy": gpu.get("flow_busy_s", 0.0) / wall,
            "mean_batch": gpu.get("lm_items", 0.0) / max(gpu.get("lm_steps", 0.0), 1.0),
            "mean_tick_streams": gpu.get("tick_streams", 0.0) / max(gpu.get("ticks", 0.0), 1.0),
            "audio_s": gpu.get("audio_s", 0.0),
        },
        "load_tool_cores": (load_cpu1 - load_cpu0) / wall,
    }
    row["holds"] = bool(
        row["ttfa_n"]
        and row["ttfa_p95_ms"] is not None
        and row["ttfa_p95_ms"] <= TTFA_TARGET_MS
        and row["server_gaps"] == 0
        and not turns.get("failed")
        and not turns.get("timed_out")
    )
    return row


def machine() -> dict[str, Any]:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", default="32,64,128,256", help="comma-separated levels")
    parser.add_argument(
        "--duration", type=float, default=30.0, help="seconds per level (the load tool's)"
    )
    parser.add_argument(
        "--drain", type=float, default=15.0, help="seconds turns may finish after a level"
    )
    parser.add_argument(
        "--root", type=Path, help="also serve the checkout at this root (the build before)"
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="gateway processes (where the build has --workers)"
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="pipeline|KEY=VALUE",
        help="the synthetic engine's costs (bench/gpu_shaped.py), repeatable",
    )
    parser.add_argument(
        "--floor", action="store_true", help="first run each level on the engine alone"
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="one more `voxgate serve` argument"
    )
    parser.add_argument(
        "--load-arg", action="append", default=[], help="one more `loadtest run` argument"
    )
    parser.add_argument(
        "--workdir", type=Path, help="logs and reports (default: a temporary folder)"
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    args.levels = [int(n) for n in args.sessions.split(",")]
    if not args.levels or min(args.levels) < 1:
        parser.error(f"--sessions: expected positive counts such as 32,64, got {args.sessions!r}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    shape = GpuShape.from_spec(args.shape)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gateway-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    roots = [("this", REPO)] + ([("before", args.root.resolve())] if args.root else [])
    builds = [
        Build(
            label,
            root,
            describe(root),
            args.workers if args.workers and has_serve_flag(root, "--workers") else 0,
        )
        for label, root in roots
    ]
    report: dict[str, Any] = {
        "command": " ".join(["python -m bench.gateway_scale", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "shape": shape.to_dict(),
        "workdir": str(workdir),
        "builds": [
            {"label": b.label, "root": str(b.root), "commit": b.commit, "workers": b.workers or 1}
            for b in builds
        ],
        "floor": [],
        "levels": [],
    }
    if args.floor:
        report["floor"] = [
            asyncio.run(run_floor_level(n, args.duration, shape)) for n in args.levels
        ]
        print("engine alone (no gateway):\n" + format_rows(report["floor"]), flush=True)
    try:
        for build in builds:
            start_server(build, args, shape, workdir)
        for sessions in args.levels:
            for build in builds:
                report["levels"].append(run_level(build, sessions, args, workdir))
                print(
                    format_table(report["levels"][-1:]).splitlines()[-1],
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for build in builds:
            if build.proc is not None:
                stop_server(build.proc)
    print(format_table(report["levels"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
