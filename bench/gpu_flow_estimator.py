"""One flow-estimator pass per batch size: eager torch vs CUDA graphs vs TensorRT.

Random weights at the real CosyVoice 3 DiT size (22 blocks x 1024, 16 heads
of 64, ff x2), `--dtype` bf16 by default. A batch of N streams is 2N CFG rows
x `--frames` mel frames with chunked (streaming) attention, as the flow runs
it; one pass is one of the ten Euler steps. Per mode and batch: warm-up (and
graph capture / engine build), then the median of `--steps` passes, and the
output's departure from eager (relative RMS). Modes:

- eager: the torch estimator (models/flow_dit.py);
- cuda_graphs: estimator_graphs.GraphedEstimator, one graph per bucket;
- tensorrt (only where `import tensorrt` works): ONNX export (float32 I/O),
  engine built with `--trt-precision` and cached in `--cache-dir`
  (flow_runtime/estimator_trt.py; the first build takes minutes, reruns load it);
- concurrency: `--concurrency` threads each running 1-stream passes, TensorRT
  with one execution context (upstream AsyncCosyVoice's arrangement) against
  `--contexts` contexts (ours): passes per second in all.

The anchor (H200, eager bf16; docs/benchmarks.md, "Anchors"): 7.2 ms for
1 stream x 200 frames, 62 ms for 128 streams x 200 frames.

One device call, under 5 minutes (`--budget-s`, default 270): eager and CUDA
graphs take about a minute; the TensorRT export and build run in a child
process killed when the budget runs out (the mode is then reported as failed,
and the cache in `--cache-dir`, git-ignored under bench/out, keeps the
export, so a second call on the same warm machine goes further; builder
optimization level 2 by default to keep a cold build short). A failing mode
or batch is reported in `errors` and the rest still run; results are written
to `--json` after each batch:

    python -m bench.gpu_flow_estimator --json /tmp/flow_estimator.json

CPU smoke run (tiny DiT; onnxruntime stands in for TensorRT, the padded
static path for CUDA graphs; tests/unit/engine/cosyvoice/test_estimator_onnx.py runs it):

    python -m bench.gpu_flow_estimator --smoke
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.gpu_common import DTYPES, Results, device_name, median_ms, sync
from engine.backends.cosyvoice.flow_runtime.estimator_graphs import GraphedEstimator
from engine.backends.cosyvoice.flow_runtime.estimator_onnx import (
    OnnxEstimator,
    example_inputs,
    export_estimator,
)
from engine.backends.cosyvoice.flow_runtime.estimator_trt import (
    TrtEstimator,
    TrtProfile,
    cached_engine,
    trt_available,
)
from engine.backends.cosyvoice.models.flow_dit import DiTEstimator

REAL_DIT = {"dim": 1024, "depth": 22, "heads": 16, "dim_head": 64}
TINY_DIT = {"dim": 64, "depth": 2, "heads": 4, "dim_head": 16}
ANCHOR_MS = {1: 7.2, 128: 62.0}  # docs/benchmarks.md, "Anchors": H200, eager, 200 frames


def random_dit(size: dict[str, int], device: torch.device, dtype: torch.dtype) -> DiTEstimator:
    torch.manual_seed(0)
    dit = DiTEstimator(size["dim"], size["depth"], size["heads"], size["dim_head"], ff_mult=2,
                       mel_dim=80, mu_dim=80, spk_dim=80, static_chunk_size=50)
    return dit.to(device, dtype).eval()


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(
        (got.float() - want.float()).pow(2).mean().sqrt() / want.float().std().clamp_min(1e-12))


def time_concurrent(estimator: nn.Module, inputs: tuple[torch.Tensor, ...], threads: int,
                    calls: int, streaming: bool, device: torch.device) -> float:
    """Passes per second with `threads` threads each making `calls` passes on its own CUDA
    stream."""
    errors: list[BaseException] = []

    def worker() -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        try:
            on_stream = torch.cuda.stream(stream) if stream is not None else nullcontext()
            with torch.inference_mode(), on_stream:
                for _ in range(calls):
                    estimator(*inputs, streaming)
                sync(device)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread below)
            errors.append(exc)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    sync(device)
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return threads * calls / (time.perf_counter() - start)


# what timing the TensorRT modes and the concurrency test takes after the build
TRT_RESERVE_S = 45.0


def trt_profile(args: argparse.Namespace, max_rows: int) -> TrtProfile:
    return TrtProfile(min_rows=2, opt_rows=min(64, max_rows), max_rows=max_rows, min_frames=4,
                      opt_frames=args.frames, max_frames=max(args.frames, 256))


def prepare_engine(args: argparse.Namespace, max_rows: int) -> Path:
    """Export the DiT (once) and build its engine (once per GPU/version/profile/precision) into the
    cache."""
    import tensorrt  # noqa: F401  (fail before the long export, not after it)

    device = torch.device(args.device or "cuda")
    mode = "streaming" if args.streaming else "offline"
    name = f"dit_{args.size['depth']}x{args.size['dim']}_{mode}.onnx"
    path = Path(args.cache_dir) / "onnx" / name
    if not path.is_file():
        path = export_estimator(random_dit(args.size, device, torch.float32), path, args.streaming)
    return cached_engine(path, args.cache_dir, trt_profile(args, max_rows), args.trt_precision,
                         device, optimization_level=args.trt_opt_level)


def prepare_engine_within(args: argparse.Namespace, max_rows: int, seconds: float) -> Path:
    """prepare_engine in a child process killed after `seconds`: a slow first build cannot eat the
    device call; the cache keeps whatever finished (the export), so a rerun goes further."""
    if seconds <= 0:
        raise TimeoutError("expected time left for the TensorRT export and build, got none (rerun "
                           "with the cache)")
    argv = [sys.executable, "-m", "bench.gpu_flow_estimator", "--prepare-trt", "--batches",
            args.batches,
            "--frames", str(args.frames), "--trt-precision", args.trt_precision, "--cache-dir",
            args.cache_dir,
            "--trt-opt-level", str(args.trt_opt_level)] + ([] if args.streaming else ["--offline"])
    try:
        done = subprocess.run(argv, timeout=seconds, capture_output=True, text=True, check=False)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"expected the TensorRT export and build within {seconds:.0f} s, "
                           f"got more; rerun: the cache ({args.cache_dir}) keeps what "
                           "finished") from None
    if done.returncode != 0:
        raise RuntimeError(f"expected the TensorRT build to succeed, got: {done.stderr[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("ENGINE ")]
    if not lines:
        raise RuntimeError("expected the build to print the engine's path, got: "
                           f"{done.stdout[-2000:]}")
    return Path(lines[-1].removeprefix("ENGINE "))


def build_modes(args: argparse.Namespace, dit: DiTEstimator, device: torch.device, max_rows: int,
                workdir: Path) -> dict[str, Callable[[], nn.Module]]:
    """Each mode's estimator, made lazily (an engine build is long; a failed mode does not stop the
    rest)."""
    def onnx_path() -> Path:
        return export_estimator(random_dit(args.size, device, torch.float32), workdir / "dit.onnx",
                                args.streaming)

    engines: dict[str, Path] = {}
    # TensorRT estimators by number of contexts: the engine is prepared once
    made: dict[int, nn.Module] = {}

    def trt(contexts: int) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            if contexts not in made:
                if "engine" not in engines:
                    remaining = args.budget_s - (time.perf_counter() - args.started) - TRT_RESERVE_S
                    engines["engine"] = prepare_engine_within(args, max_rows, remaining)
                made[contexts] = TrtEstimator(engines["engine"], trt_profile(args, max_rows), dit,
                                              contexts, device)
            return made[contexts]
        return make

    def eager() -> nn.Module:
        return dit

    return {
        "eager": eager,
        "static": lambda: GraphedEstimator(dit, max_rows, args.frames, use_graphs=False),
        "cuda_graphs": lambda: GraphedEstimator(dit, max_rows, args.frames, use_graphs=True),
        "onnxruntime": lambda: OnnxEstimator({args.streaming: onnx_path()}, num_threads=1),
        "tensorrt": trt(args.contexts),
        "tensorrt_1ctx": trt(1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny DiT on the CPU (CI)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128",
                        help="streams (CFG doubles the rows)")
    # prompt + history + chunk at serving sizes: about 480 frames (e.g. 150 + 75 + 15 tokens, x2)
    parser.add_argument("--frames", type=int, default=480)
    parser.add_argument("--offline", dest="streaming", action="store_false", help="full attention")
    parser.add_argument("--modes", default=None, help="default: eager,cuda_graphs[,tensorrt]")
    parser.add_argument("--trt-precision", choices=["fp16", "bf16", "fp32"], default="fp16")
    parser.add_argument("--contexts", type=int, default=2,
                        help="TensorRT execution contexts (against 1)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="threads in the concurrency test (0: skip)")
    parser.add_argument("--cache-dir", default="bench/out/trt-cache",
                        help="ONNX and engines (git-ignored)")
    parser.add_argument("--trt-opt-level", type=int, default=2,
                        help="builder optimization level (TensorRT's default is 3; 2 builds "
                             "faster, to fit one call)")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="wall-time budget of the whole run")
    # the child process
    parser.add_argument("--prepare-trt", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the results here (after each mode)")
    args = parser.parse_args(argv)
    args.size, args.started = REAL_DIT, time.perf_counter()
    if args.prepare_trt:
        print("ENGINE", prepare_engine(args, 2 * max(int(b) for b in args.batches.split(","))))
        return {}
    if args.smoke:
        args.device, args.dtype, args.batches, args.frames = "cpu", "float32", "1,2", 40
        args.modes = "eager,static,onnxruntime"
        args.steps, args.warmup, args.concurrency, args.size = 2, 1, 2, TINY_DIT
        torch.set_num_threads(1)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    has_trt = trt_available() and device.type == "cuda"
    modes = (args.modes
             or ("eager,cuda_graphs,tensorrt" if has_trt else "eager,cuda_graphs")).split(",")
    batches = [int(b) for b in args.batches.split(",")]
    dtype = DTYPES[args.dtype]
    dit = random_dit(args.size, device, dtype)
    result: dict[str, Any] = {"device": device_name(device), "dtype": args.dtype,
                              "frames": args.frames, "streaming": args.streaming,
                              "size": args.size, "trt_precision": args.trt_precision, "rows": [],
                              "errors": {}, "concurrency": []}
    save = Results(result, args.json).save

    with tempfile.TemporaryDirectory() as tmp:
        makers = {m: cache(make) for m, make in build_modes(args, dit, device, 2 * max(batches),
                                                            Path(tmp)).items()}
        inputs = {n: example_inputs(2 * n, args.frames, dtype, device, seed=n) for n in batches}
        # eager outputs, made when first compared (inside the try)
        reference: dict[int, torch.Tensor] = {}

        def eager_out(n: int) -> torch.Tensor:
            if n not in reference:
                with torch.inference_mode():
                    reference[n] = dit(*inputs[n], args.streaming)
            return reference[n]

        for mode in modes:
            try:
                estimator = makers[mode]()
            except Exception as exc:  # noqa: BLE001 (one mode's failure must not lose the others' numbers)
                result["errors"][mode] = f"{type(exc).__name__}: {exc}"
                save()
                continue
            for n in batches:
                try:
                    if isinstance(estimator, GraphedEstimator) and estimator.use_graphs:
                        # a call never captures (the loader captures every bucket at load): capture
                        # first
                        bucket = estimator.bucket_for(2 * n, args.frames, args.streaming)
                        if bucket is not None:
                            with torch.inference_mode():
                                estimator.capture(bucket, inputs[n][0])
                    with torch.inference_mode():
                        out = estimator(*inputs[n], args.streaming)
                        ms = median_ms(partial(estimator, *inputs[n], args.streaming), device,
                                         args.steps, args.warmup)
                    result["rows"].append({"mode": mode, "streams": n, "rows": 2 * n, "ms": ms,
                                           "rel_rms_vs_eager": rel_rms(out, eager_out(n))})
                except Exception as exc:  # noqa: BLE001 (as above: the next batch may still run)
                    result["errors"][f"{mode} {n}"] = f"{type(exc).__name__}: {exc}"
                save()
        if args.concurrency > 0:
            one = example_inputs(2, args.frames, dtype, device, seed=1)
            graphs = "cuda_graphs" if device.type == "cuda" else "static"
            pairs = [("tensorrt_1ctx", "tensorrt")] if "tensorrt" in modes else [("eager", graphs)]
            for mode in (m for pair in pairs for m in pair):
                try:
                    rate = time_concurrent(makers[mode](), one, args.concurrency, args.steps,
                                           args.streaming, device)
                    result["concurrency"].append({"mode": mode, "threads": args.concurrency,
                                                  "passes_per_s": rate})
                except Exception as exc:  # noqa: BLE001 (as above)
                    result["errors"][f"concurrency {mode}"] = f"{type(exc).__name__}: {exc}"
                save()
    print_table(result, modes, batches)
    return result


def print_table(result: dict[str, Any], modes: list[str], batches: list[int]) -> None:
    print(f"CosyVoice 3 DiT {result['size']['depth']} x {result['size']['dim']}, random weights, "
          f"{result['dtype']}, {result['device']}, {result['frames']} frames, "
          f"{'chunked' if result['streaming'] else 'full'} attention")
    print("| streams | rows | " + " | ".join(f"{m} ms" for m in modes) + " | DESIGN anchor ms |")
    print("|" + "---|" * (len(modes) + 3))
    for n in batches:
        cells = []
        for m in modes:
            row = next((r for r in result["rows"] if r["mode"] == m and r["streams"] == n), None)
            cells.append(f"{row['ms']:.2f} ({row['rel_rms_vs_eager']:.1e})" if row else "-")
        print(f"| {n} | {2 * n} | " + " | ".join(cells) + f" | {ANCHOR_MS.get(n, '')} |")
    print("(in brackets: relative RMS departure from eager)")
    for row in result["concurrency"]:
        print(f"concurrency: {row['mode']}, {row['threads']} threads of 1-stream passes: "
              f"{row['passes_per_s']:.1f} passes/s")
    for mode, error in result["errors"].items():
        print(f"{mode}: FAILED {error}")


if __name__ == "__main__":
    main()
