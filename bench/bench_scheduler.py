"""FIFO one-at-a-time against the deadline-aware batching scheduler, in one run.

    python -m bench.bench_scheduler --levels 8,16,32 --duration 40

For each policy a fresh `voxgate serve --scheduler {fifo,edf}` (piper, joe
voice, admission off so that every session is served) takes the load tool's
fixed-concurrency mode at each level: streaming sessions that play LLM-style
answers token by token with think time between turns, each with a virtual
playback clock. The table gives what listeners feel: TTFA (first segment
complete in the input -> first frame), gaps, and audio throughput. The levels
alternate between the policies (FIFO 8, EDF 8, FIFO 16, ...) so that drift in
the shared machine's speed hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def start(policy: str, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--scheduler", policy,
         "--max-contexts", "1000", "--log-level", "warning"],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{policy} server did not become ready")


def load(port: int, sessions: int, duration: float, seed: int, out: Path) -> dict[str, Any]:
    subprocess.run(
        [sys.executable, "-m", "loadtest", "run", "--url", f"http://127.0.0.1:{port}",
         "--sessions", str(sessions), "--duration", str(duration), "--seed", str(seed),
         "--quiet", "--json", str(out)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    summary: dict[str, Any] = report["targets"]["voxgate"]["result"]["summary"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="8,16,32")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", help="write every summary here")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    ports = {"fifo": 18711, "edf": 18712}
    servers = {policy: start(policy, port) for policy, port in ports.items()}
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for policy, port in ports.items():  # warm-up turn on each
                load(port, 2, 8.0, args.seed, Path(tmp) / f"warm-{policy}.json")
            for level in levels:
                for policy, port in ports.items():
                    summary = load(port, level, args.duration, args.seed,
                                   Path(tmp) / f"{policy}-{level}.json")
                    rows.append((policy, level, summary))
    finally:
        for proc in servers.values():
            proc.terminate()
            proc.wait()
    header = (f"{'policy':<6} {'sessions':>8} {'turns':>6} {'TTFA p50':>9} {'TTFA p95':>9} "
              f"{'gaps':>5} {'gap ms':>8} {'audio s/s':>9} {'errors':>7}")
    print(header)
    for policy, level, s in rows:
        ttfa = s["ttfa_segment_ms"]
        errors = sum(s["errors"].values())
        print(f"{policy:<6} {level:>8} {s['turns']['started']:>6} "
              f"{ttfa.get('p50', float('nan')):>9.0f} {ttfa.get('p95', float('nan')):>9.0f} "
              f"{s['gaps']['count']:>5} {s['gaps']['total_ms']:>8.0f} "
              f"{s['audio']['per_wall_second']:>9.2f} {errors:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps([{"policy": p, "sessions": n, "summary": s}
                                               for p, n, s in rows], indent=1))


if __name__ == "__main__":
    main()
