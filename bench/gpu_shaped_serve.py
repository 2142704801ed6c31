"""`voxgate serve` with the GPU-shaped synthetic engine: the server child of bench.gateway_scale.

    python bench/gpu_shaped_serve.py [--shape pipeline|KEY=VALUE ...] [--stats-file PATH] \\
        -- serve --port 8000 --max-contexts 300 ...

Run as a script (by path), so that the server is whichever checkout is first on PYTHONPATH
(bench.gateway_scale's `--root`, the build before) while the synthetic backend is always this
checkout's: bench/gpu_shaped.py is loaded from beside this file, and it needs only
`engine.backend`, `engine.errors` and `engine.types` of the build it serves.

The product's own path from the command line on: `gateway.cli.main` parses the arguments after
`--`, builds the app (`create_app`), and runs uvicorn with its settings; only the backend that
`engine.backends.create_backend` returns is the synthetic one, whatever `--engine` says. With
`serve --workers N` that still holds: the engine lives in this process (the engine process,
gateway/workers/supervisor.py), and only the gateway workers are new processes, which build no
backend.

While it runs, a daemon thread once a second gives every Python thread its name as the OS
sees it (/proc/self/task/TID/comm, the first 15 characters: `voxgate-engine_` for the engine's
worker), so that per-thread CPU can be read by name from outside, and writes the synthetic
GPU's counters (`GpuShapedBackend.snapshot`, summed over its instances) to `--stats-file` as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent


def load_gpu_shaped() -> ModuleType:
    """bench/gpu_shaped.py from beside this file (not the `bench` package of the served build)."""
    spec = importlib.util.spec_from_file_location(
        "voxgate_bench_gpu_shaped", HERE / "gpu_shaped.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def name_threads() -> None:
    """Each live Python thread's name as its OS name (a no-op where /proc has none)."""
    for thread in threading.enumerate():
        if thread.native_id is None:
            continue
        try:
            Path(f"/proc/self/task/{thread.native_id}/comm").write_text(thread.name[:15])
        except OSError:
            continue


def watch(backends: list[Any], stats_file: Path | None, period_s: float = 1.0) -> None:
    """Forever: name the threads, write the synthetic GPU's counters (atomically)."""
    while True:
        name_threads()
        if stats_file is not None and backends:
            total: dict[str, float] = {}
            for backend in backends:
                for key, value in backend.snapshot().items():
                    total[key] = total.get(key, 0.0) + value
            tmp = stats_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "at": time.monotonic(), **total}))
            tmp.replace(stats_file)
        time.sleep(period_s)


def main(argv: list[str]) -> int:
    if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        sys.path.pop(0)  # run by path: bench/'s modules are not top-level names
    head, rest = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description="voxgate serve with the GPU-shaped engine")
    parser.add_argument("--shape", action="append", default=[], metavar="pipeline|KEY=VALUE")
    parser.add_argument("--stats-file", type=Path)
    args = parser.parse_args(head)
    gpu_shaped = load_gpu_shaped()
    shape = gpu_shaped.GpuShape.from_spec(args.shape)
    backends: list[Any] = []

    def create_backend(name: str, **options: Any) -> Any:
        backend = gpu_shaped.GpuShapedBackend(shape)
        backends.append(backend)
        return backend

    import engine.backends

    engine.backends.create_backend = create_backend  # before gateway.app imports it by name
    import gateway.app

    if hasattr(gateway.app, "create_backend"):
        gateway.app.create_backend = create_backend
    threading.Thread(
        target=watch, args=(backends, args.stats_file), name="bench-watch", daemon=True
    ).start()
    from gateway.cli import main as voxgate_main

    print(f"voxgate from {Path(gateway.app.__file__).resolve().parents[1]}", flush=True)
    return int(voxgate_main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
