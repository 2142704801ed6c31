"""voxgate through Ray Serve against `voxgate serve`, on the same box in one run.

    python -m bench.bench_ray_serve                    # both parts
    python -m bench.bench_ray_serve --part hop         # the handle hop only (~1 min)
    python -m bench.bench_ray_serve --part load --levels 2,4,8 --duration 20

Part "hop": the per-chunk cost of the gateway -> engine handle hop. A probe
deployment streams N chunks shaped like piper's (0.25 s of float32 PCM at
22,050 Hz, in the wire dict of gateway/ray_serve/wire.py) through a
`DeploymentHandle` with `stream=True`; the anchor is the same chunks from a
local async generator in this process. Per-chunk cost = (stream time) / N,
after a warm-up stream; the median of `--repeats` streams.

Part "load": `voxgate-loadtest sweep` at fixed levels against `voxgate serve`
(the anchor) and `voxgate ray-serve --gateway-replicas 1 --engine-replicas 1`,
one after the other on free ports, with the same seed and corpus: TTFA
p50/p95 per level and the capacity (the most sessions with TTFA p95 under
the loadtest's target and no gap). The ratio is Ray over the anchor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

CHUNK_SAMPLES = 22050 // 4  # 0.25 s at piper's rate


def _chunk(rng: np.random.Generator) -> dict[str, Any]:
    pcm = rng.standard_normal(CHUNK_SAMPLES).astype(np.float32)
    return {"pcm": pcm.tobytes(), "sample_rate": 22050, "is_last": False, "words": None}


class HopProbe:
    """Streams `n` piper-sized chunks (a Serve deployment in part "hop")."""

    def __init__(self) -> None:
        self.chunk = _chunk(np.random.default_rng(0))

    async def stream(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for _ in range(n):
            yield self.chunk


async def _time_stream(make: Any, n: int) -> float:
    started = time.perf_counter()
    count = 0
    async for _ in make(n):
        count += 1
    assert count == n
    return (time.perf_counter() - started) / n


def run_hop(chunks: int, repeats: int) -> dict[str, float]:
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        deployment: Any = serve.deployment
        handle = serve.run(deployment(HopProbe).options(num_replicas=1, max_ongoing_requests=64,
                                                        ray_actor_options={"num_cpus": 0.5}).bind(),
                           name="hop", route_prefix=None)
        local = HopProbe()

        def remote(n: int) -> Any:
            return handle.options(method_name="stream", stream=True).remote(n)

        async def measure() -> dict[str, float]:
            await _time_stream(remote, chunks)  # warm-up
            await _time_stream(local.stream, chunks)
            hop = [await _time_stream(remote, chunks) for _ in range(repeats)]
            base = [await _time_stream(local.stream, chunks) for _ in range(repeats)]
            return {"chunks": chunks, "repeats": repeats,
                    "handle_ms_per_chunk": statistics.median(hop) * 1000,
                    "local_ms_per_chunk": statistics.median(base) * 1000,
                    "chunk_bytes": len(local.chunk["pcm"])}

        return asyncio.run(measure())
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call, unused-ignore]
        ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} was not ready within {timeout_s:.0f} s")


def stop(process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Terminate a server, and kill it if it has not exited within `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()


def _sweep(url: str, levels: str, duration: float, seed: int, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "loadtest", "sweep", "--url", url, "--levels", levels,
           "--all-levels", "--duration", str(duration), "--seed", str(seed), "--json", str(out),
           "--quiet"]
    subprocess.run(cmd, check=True, timeout=60 + 4 * duration * len(levels.split(",")))
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def run_load(levels: str, duration: float, seed: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    env = {**os.environ, "XDG_DATA_HOME": tempfile.mkdtemp()}
    for name, argv in (("serve", ["serve"]),
                       ("ray", ["ray-serve", "--gateway-replicas", "1", "--engine-replicas", "1"])):
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "gateway.cli", *argv, "--port", str(port)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, 240)
            results[name] = _sweep(url, levels, duration, seed, Path(tempfile.mkdtemp()) / "r.json")
        finally:
            stop(server)
    return results


def _levels_table(results: dict[str, Any], target_ms: float = 300.0) -> None:
    print("| server | sessions | TTFA p50 ms | TTFA p95 ms | gaps | failed |")
    print("|---|---|---|---|---|---|")
    for name, result in results.items():
        report = result["targets"]["voxgate"]  # the loadtest's sweep JSON, one target
        for level in report["levels"]:
            summary = level["summary"]
            ttfa = summary["ttfa_segment_ms"]
            print(f"| {name} | {level['sessions']} | {ttfa.get('p50') or float('nan'):.0f} | "
                  f"{ttfa.get('p95') or float('nan'):.0f} | {summary['gaps']['count']} | "
                  f"{summary['turns']['failed']} |")
        print(f"| {name} | capacity (p95 <= {target_ms:.0f} ms, no gap): {report.get('capacity')} "
              "| | | | |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["hop", "load", "all"], default="all")
    parser.add_argument("--chunks", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--levels", default="2,4,8")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", help="write everything measured here")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    if args.part in ("hop", "all"):
        hop = run_hop(args.chunks, args.repeats)
        out["hop"] = hop
        print("| path | ms per chunk |\n|---|---|")
        print(f"| DeploymentHandle stream=True | {hop['handle_ms_per_chunk']:.3f} |")
        print(f"| local async generator (anchor) | {hop['local_ms_per_chunk']:.4f} |")
    if args.part in ("load", "all"):
        out["load"] = run_load(args.levels, args.duration, args.seed)
        _levels_table(out["load"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
