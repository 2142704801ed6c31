"""Where one flow-estimator pass spends its time on the GPU, and what the cheap fixes would buy.

Random weights at the real CosyVoice 3 DiT size (bench.gpu_flow_estimator's
`random_dit`), bf16, streaming (chunked) attention. For each `--cases` entry
(streams x frames; CFG doubles the rows):

- eager: the median ms of one pass (models/flow_dit.py as the backend runs it),
  and the operators one pass dispatches (views left out: each of the rest is
  at least one kernel launch on the GPU, and an eager pass at serving sizes is
  bound by its launches);
- kernels: one profiled pass (torch.profiler, CUDA time), its kernels summed
  into matmul / attention / convolution / other, and the ten costliest;
- attention alone, one layer's shape, per mask form: the [B, 1, T, T] bool
  mask the estimator passes now; one [1, 1, T, T] mask shared by every row
  (what a batch without padding needs); no mask at all (full attention, the
  floor: flash attention takes no mask);
- anchor (`--anchor-dit FILE`, a copy of models/flow_dit.py from the build
  before a change, same weights): its ms per pass beside eager's, and how far
  the two outputs differ (relative RMS);
- compiled, after every case: `torch.compile` of the estimator at the first
  case's shape (not in `--smoke` unless `--compile`): compile seconds, ms per
  pass and its departure from eager (relative RMS); then with dynamic shapes
  (`torch.compile(dynamic=True)`, what one compile for every graph bucket
  would be): compile seconds at the first case, and at the second (a
  recompile, if any), with ms per pass at each.

Each part that fails is reported in `errors` and the rest still run; `--json`
is rewritten after each part. Nothing outlives `--budget-s`: a part that would
start past it is skipped (reported).

    python -m bench.gpu_flow_profile --json $OUT/flow_profile.json

CPU smoke run (tiny DiT, 2 small cases; tests/unit/bench/test_gpu_scripts.py runs it):

    python -m bench.gpu_flow_profile --smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import DTYPES, Results, device_name, median_ms, sync
from bench.gpu_flow_estimator import REAL_DIT, TINY_DIT, random_dit, rel_rms
from engine.backends.cosyvoice.flow_runtime.estimator_onnx import example_inputs
from engine.backends.cosyvoice.models.flow_unet import chunk_attention_mask

CHUNK = 50  # the DiT's static attention chunk, in frames

# kernel name fragments -> category (first match wins; the rest is "other")
CATEGORIES = (
    ("attention", ("fmha", "flash", "attention", "attn", "softmax")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul", "addmm")),
    ("convolution", ("conv", "implicit_", "winograd")),
)


def category(name: str) -> str:
    low = name.lower()
    for label, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return label
    return "other"


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'128x480,1x480' -> [(128, 480), (1, 480)]"""
    cases = []
    for item in text.split(","):
        streams, _, frames = item.strip().partition("x")
        if not streams.isdigit() or not frames.isdigit() or int(streams) < 1 or int(frames) < 2:
            raise ValueError(f"expected cases as STREAMSxFRAMES[,...] (e.g. 128x480), got {item!r}")
        cases.append((int(streams), int(frames)))
    return cases


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten operators dispatched inside it, views left out."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops_per_pass(run: Callable[[], Any]) -> dict[str, Any]:
    """How many operators (not views) one pass dispatches, and the most frequent."""
    with OpCounter() as counter:
        run()
    return {"total": sum(counter.counts.values()), "top": dict(counter.counts.most_common(8))}


def kernel_profile(run: Callable[[], Any], device: torch.device, top: int) -> dict[str, Any]:
    """One profiled pass: device time per category and the `top` costliest kernels (ms)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        run()
        sync(device)
    totals: dict[str, float] = {}
    rows = []
    for event in prof.key_averages():
        if device.type == "cuda":
            # kernels only: their device time is their own; CPU-side ops would count it twice
            if event.device_type.name != "CUDA":
                continue
            ms = event.self_device_time_total / 1000
        else:
            if event.key.startswith("aten::") is False:
                continue
            ms = event.self_cpu_time_total / 1000
        if ms <= 0:
            continue
        totals[category(event.key)] = totals.get(category(event.key), 0.0) + ms
        rows.append((ms, event.count, event.key[:90]))
    rows.sort(reverse=True)
    return {"by_category_ms": {k: round(v, 3)
                               for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            "total_ms": round(sum(totals.values()), 3),
            "top": [{"ms": round(ms, 3), "calls": n, "kernel": name} for ms, n, name in rows[:top]]}


def attention_forms(rows: int, frames: int, heads: int, dim_head: int, dtype: torch.dtype,
                    device: torch.device, steps: int, warmup: int) -> dict[str, float]:
    """ms of one layer's attention per mask form."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(rows, heads, frames, dim_head, generator=gen, device=device, dtype=dtype)
               for _ in range(3))
    valid = torch.ones(rows, frames, dtype=torch.bool, device=device)
    per_row = chunk_attention_mask(valid, CHUNK, True)[:, None]
    shared = per_row[:1]
    forms: dict[str, Callable[[], torch.Tensor]] = {
        "per_row_bool_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=per_row),
        "shared_bool_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=shared),
        "no_mask": lambda: F.scaled_dot_product_attention(q, k, v),
    }
    with torch.inference_mode():
        want = forms["shared_bool_mask"]()
        got = forms["per_row_bool_mask"]()
        if not torch.allclose(got.float(), want.float(), atol=1e-2):
            raise AssertionError("expected the shared mask to give the per-row mask's output")
        return {name: round(median_ms(fn, device, steps, warmup), 4) for name, fn in forms.items()}


def anchor_estimator(path: str, like: torch.nn.Module, size: dict[str, int], device: torch.device,
                     dtype: torch.dtype) -> torch.nn.Module:
    """The DiTEstimator of another copy of flow_dit.py, with `like`'s weights."""
    spec = importlib.util.spec_from_file_location("anchor_flow_dit", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"expected a Python file for --anchor-dit, got {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    anchor: torch.nn.Module = module.DiTEstimator(size["dim"], size["depth"], size["heads"],
                                                  size["dim_head"],
                                                  ff_mult=2, mel_dim=80, mu_dim=80, spk_dim=80,
                                                  static_chunk_size=CHUNK)
    anchor.load_state_dict(like.state_dict())
    return anchor.to(device, dtype).eval()


def attention_backends(rows: int, frames: int, heads: int, dim_head: int, dtype: torch.dtype,
                       device: torch.device, steps: int, warmup: int) -> dict[str, dict[str, Any]]:
    """Per backend, with the per-row mask: steady ms at this shape, then the first call's ms at
    three lengths never seen before (a per-shape plan build shows there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if device.type != "cuda":
        names = {"math": SDPBackend.MATH}
    gen = torch.Generator(device=device).manual_seed(0)

    def inputs(length: int) -> tuple[torch.Tensor, ...]:
        q, k, v = (torch.randn(rows, heads, length, dim_head, generator=gen, device=device,
                               dtype=dtype)
                   for _ in range(3))
        valid = torch.ones(rows, length, dtype=torch.bool, device=device)
        return q, k, v, chunk_attention_mask(valid, CHUNK, True)[:, None]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    out: dict[str, dict[str, Any]] = {}
    for index, (name, backend) in enumerate(names.items()):
        steady_inputs = inputs(frames)
        with sdpa_kernel([backend]), torch.inference_mode():
            steady = median_ms(partial(attend, *steady_inputs), device, steps, warmup)
            firsts = []
            for extra in range(3):  # lengths no backend has seen: frames + 1 + 3 * extra + index
                fresh = inputs(frames + 1 + 3 * extra + index)
                sync(device)
                start = time.perf_counter()
                attend(*fresh)
                sync(device)
                firsts.append(1000 * (time.perf_counter() - start))
        out[name] = {"ms": round(steady, 4), "first_call_ms": [round(f, 2) for f in firsts]}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny DiT on the CPU (CI)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--cases", default="128x480,128x200,8x480,1x480",
                        help="STREAMSxFRAMES, comma-separated")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the estimator at the first case (default: yes, not "
                             "with --smoke)")
    parser.add_argument("--anchor-dit",
                        help="flow_dit.py of the build before a change, timed beside this one")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        size, device, dtype = TINY_DIT, torch.device(args.device or "cpu"), torch.float32
        cases, args.steps, args.warmup = [(2, 64), (1, 64)], 2, 1
        args.compile = bool(args.compile)  # half a minute on the CPU even for the tiny DiT
    else:
        size, device = REAL_DIT, torch.device(args.device or "cuda")
        dtype, cases = DTYPES[args.dtype], parse_cases(args.cases)
        args.compile = args.compile is not False
    result: dict[str, Any] = {"device": device_name(device), "torch": torch.__version__,
                              "dtype": str(dtype), "size": size, "cases": [], "errors": []}
    results = Results(result, args.json, args.budget_s, started, echo=True)
    save, part = results.save, results.part

    dit = random_dit(size, device, dtype)
    anchor = (anchor_estimator(args.anchor_dit, dit, size, device, dtype) if args.anchor_dit
              else None)
    result["anchor_dit"] = args.anchor_dit

    def runner(streams: int, frames: int) -> Callable[..., torch.Tensor]:
        inputs = example_inputs(2 * streams, frames, dtype, device)

        def run(model: Any = dit) -> torch.Tensor:
            with torch.inference_mode():
                out: torch.Tensor = model(*inputs, True)
                return out
        return run

    def profile_case(streams: int, frames: int) -> None:
        run, label = runner(streams, frames), f"{streams}x{frames}"
        case: dict[str, Any] = {"streams": streams, "rows": 2 * streams, "frames": frames}
        result["cases"].append(case)
        case["eager_ms"] = part(f"{label} eager",
                                lambda: round(median_ms(run, device, args.steps, args.warmup), 3))
        case["ops"] = part(f"{label} ops", lambda: ops_per_pass(run))
        save()
        if anchor is not None:
            def anchored() -> dict[str, Any]:
                ms = median_ms(lambda: run(anchor), device, args.steps, args.warmup)
                return {"ms": round(ms, 3), "rel_rms": rel_rms(run(), run(anchor)),
                        "ops": ops_per_pass(lambda: run(anchor))["total"]}
            case["anchor"] = part(f"{label} anchor", anchored)
            save()
        case["kernels"] = part(f"{label} kernels", lambda: kernel_profile(run, device, args.top))
        save()
        case["attention_ms"] = part(f"{label} attention", lambda: attention_forms(
            2 * streams, frames, size["heads"], size["dim_head"], dtype, device, args.steps,
            args.warmup))
        save()
        case["attention_backends"] = part(f"{label} attention backends", lambda: attention_backends(
            2 * streams, frames, size["heads"], size["dim_head"], dtype, device, args.steps,
            args.warmup))
        save()

    def first_compile(model: Any, streams: int, frames: int) -> dict[str, float]:
        """The compiled model's first call at this shape (seconds), then ms per pass."""
        run = runner(streams, frames)
        want = run()
        start = time.perf_counter()
        got = run(model)
        sync(device)
        seconds = time.perf_counter() - start
        ms = median_ms(lambda: run(model), device, args.steps, args.warmup)
        return {"streams": streams, "frames": frames, "first_call_s": round(seconds, 1),
                "ms": round(ms, 3), "rel_rms": rel_rms(got, want)}

    for streams, frames in cases:
        profile_case(streams, frames)
    if args.compile:  # last: the compile is the longest part and may meet the caller's timeout
        result["cases"][0]["compiled"] = part(
            f"{cases[0][0]}x{cases[0][1]} compiled",
            lambda: first_compile(torch.compile(dit, dynamic=False), *cases[0]))
        save()

        def dynamic() -> list[dict[str, float]]:
            torch._dynamo.reset()
            model = torch.compile(dit, dynamic=True)
            return [first_compile(model, streams, frames) for streams, frames in cases[:2]]
        result["compiled_dynamic"] = part("compiled dynamic", dynamic)
        save()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    save()
    return result


if __name__ == "__main__":
    main()
