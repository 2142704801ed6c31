"""TTFA and gap-free capacity of the whole cosyvoice backend (LM -> flow -> HiFT), per concurrency.

Random weights at the real CosyVoice 2/3 sizes (written once as an official
model directory: LM Qwen2-0.5B, v3 DiT 22 x 1024 / v2 conformer + U-Net,
HiFT 512 channels; tokenizer files and ONNX stand-ins), driven through the
`Backend` interface as the engine drives it: N requests arrive at once, and
every step advances all of them (one LM token each, then whatever chunks are
ready, batched). For each N it reports TTFA (first PCM of each request), gaps
(a chunk arriving after the audio before it has played out, playback starting
at the first chunk) and the time per stage per call: LM step, flow
(`FlowModel.infer`) and HiFT (`vocode_batch`), with the flow's rows per call.

The answer length is set by the text: the LM must emit at least twice the
text's token count (byte tokens here; every stop id is forbidden until then,
`strict_min_length`), and random weights stop soon after.
A short warm-up pass at each N first (CUDA-graph capture, allocator growth).

The LM's side is reported apart (issue: the LM never waits for the flow): per
N the p50 and p99 of the LM step in the pipeline (`lm.step`, sampling
included), and the same step alone (`solo`: N streams decoding with the flow
idle, right after the pass), with their ratio; audio seconds per wall second;
and the GiB the caches hold (the LM's KV slots; the flow's K/V cache where the
build has one).

The same script drives the build before (the anchor: another checkout's
engine on the path, as `bench/gpu_all.sh` runs it): options and counters
that build does not have are left out, and the JSON says which build ran
(`--label`).

Each N that fails is reported in `errors` and the next one runs; `--json` is
rewritten after every N. No pass outlives `--budget-s` (counted from the
start, model writing included): one running then stops with an error, and
the N after it are skipped. Without PyAV (the GPU image has none) the
reference clip is read with `wave` and resampled by linear interpolation,
which is all random weights need.

One device call (a few minutes on an H200):

    python -m bench.gpu_cosyvoice_pipeline --json /tmp/pipeline.json

CPU smoke run (tiny sizes; CI runs it so the script does not rot):

    python -m bench.gpu_cosyvoice_pipeline --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import statistics
import tempfile
import time
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import engine.backends.cosyvoice.frontend.voice_prompts as voice_prompts_module
import engine.backends.cosyvoice.loader as loader_module
import engine.backends.cosyvoice.t2w.streams as t2w_module
from engine.backends.cosyvoice.backend import CosyVoiceBackend
from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.frontend.frontend import Mode
from engine.backends.cosyvoice.lm.driver import LMStart, TorchLMDriver
from engine.types import RequestId, SynthesisRequest

# about 100 byte tokens: at least 2 x that many speech tokens (8 s of audio); random weights stop
# soon after.
ANSWER = ("Sure, here is the short version. The gateway cuts the stream into sentences and speaks "
          "each one.")
WARMUP_TEXT = "Hi there."  # a short pass first: CUDA-graph capture, allocator growth
SAMPLE_RATE = 24000
VOCODER_NAME = "vocode_batch"
FIRST_STEPS = 40  # each pass reports how long its first steps took (a slow first audio's trace)
SOLO_STEPS = 40  # LM steps timed alone after each pass
GIB = 2.0 ** 30


class StageTimer:
    """Wall time per call of a wrapped function (synchronizing CUDA), and the rows it served."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.calls: dict[str, list[tuple[float, int]]] = {}

    def wrap(self, name: str, fn: Callable[..., Any],
             rows: Callable[..., int]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            # this thread's CUDA stream only: the flow runs on its own thread and stream, and a
            # device-wide sync would charge the LM step with the flow batch it overlaps
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.calls.setdefault(name, []).append((time.perf_counter() - start,
                                                    rows(*args, **kwargs)))
            return out
        return timed

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, calls in self.calls.items():
            seconds = [s for s, _ in calls]
            num_rows = sum(r for _, r in calls)
            ordered = sorted(seconds)
            out[name] = {"calls": len(calls), "ms_per_call": 1000 * statistics.median(seconds),
                         "p99_ms": 1000 * rank(ordered, 0.99), "max_ms": 1000 * ordered[-1],
                         "rows_per_call": num_rows / len(calls),
                         "ms_per_row": 1000 * sum(seconds) / max(num_rows, 1)}
        return out


def _rows_of(*args: Any, **kwargs: Any) -> int:
    """The rows of a flow call: its first argument's length (a list of rows, or a batch tensor)."""
    first = args[0] if args else next(iter(kwargs.values()), [])
    return len(first) if hasattr(first, "__len__") else 1


def instrument(backend: CosyVoiceBackend, timer: StageTimer) -> list[str]:
    """Time the LM step, the flow calls and the vocoder; returns what was wrapped (builds
    differ)."""
    model = backend.model
    assert model is not None and backend.lm is not None
    lm = backend.lm
    lm.step = timer.wrap("lm_step", lm.step, lambda keys: len(keys))  # type: ignore[method-assign]
    wrapped = ["lm_step"]
    flow = model.t2w.flow
    flow.infer = timer.wrap("flow", flow.infer, _rows_of)  # type: ignore[method-assign]
    wrapped.append("flow")
    # the flow over its K/V cache
    solver = getattr(getattr(model.t2w, "cached", None), "solver", None)
    if solver is not None and hasattr(solver, "solve"):
        solver.solve = timer.wrap("flow", solver.solve, _rows_of)
        wrapped.append("flow_cached")
    if hasattr(t2w_module, VOCODER_NAME):  # t2w.run calls the vocoder through its module's name
        setattr(t2w_module, VOCODER_NAME, timer.wrap(
            "hift", getattr(t2w_module, VOCODER_NAME), lambda hift, states, *rest: len(states)))
        wrapped.append("hift")
    return wrapped


def num_graphs(backend: CosyVoiceBackend) -> dict[str, int]:
    """CUDA graphs captured so far: the LM's decode buckets and the flow's (estimator, cached
    solve)."""
    assert isinstance(backend.lm, TorchLMDriver) and backend.model is not None
    static = backend.lm.runner.static
    estimator = backend.model.t2w.flow.decoder.estimator
    solver = getattr(getattr(backend.model.t2w, "cached", None), "solver", None)
    return {"lm": len(static.graphs) if static is not None else 0,
            "flow": len(getattr(estimator, "graphs", {}))
            + len(getattr(solver, "graphs", {}) or {})}


def cache_gib(backend: CosyVoiceBackend) -> dict[str, float]:
    """GiB the caches hold: the LM's KV slots (allocated once) and the flow's K/V cache, if any."""
    assert isinstance(backend.lm, TorchLMDriver) and backend.model is not None
    lm_bytes = sum(t.nbytes for t in backend.lm.runner.cache.buffers())
    out = {"lm": lm_bytes / GIB, "flow": 0.0}
    cache = getattr(getattr(backend.model.t2w, "cached", None), "cache", None)
    if cache is not None and hasattr(cache, "info"):
        info = cache.info()
        out.update(flow=float(info.get("gib_total", 0.0)),
                   flow_used=float(info.get("gib_used", 0.0)),
                   flow_per_stream=float(info.get("gib_per_stream", 0.0)),
                   flow_stream_capacity=float(info.get("stream_capacity", 0.0)))
    return out


def solo_lm(backend: CosyVoiceBackend, n: int, text: str, tag: str,
            steps: int = SOLO_STEPS) -> dict[str, float]:
    """The LM step alone at batch `n`: n streams of `text` decoding with the flow idle (ms p50,
    p99)."""
    lm, model = backend.lm, backend.model
    assert lm is not None and model is not None
    voice = backend.get_voice(backend.voices()[0].voice_id)
    lm_input = model.frontend.lm_input(text, voice.prompt, Mode.ZERO_SHOT)
    keys = [f"{tag}-solo-{n}-{i}" for i in range(min(n, lm.num_free))]
    failed = lm.start([LMStart(k, lm_input, False, (), seed=i) for i, k in enumerate(keys)])
    live = [k for k in keys if k not in failed]
    device = model.device
    times: list[float] = []
    try:
        for i in range(steps + 3):
            if not live:
                break
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = lm.step(live)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 3:  # the first steps after a prefill are not the steady step
                times.append(time.perf_counter() - start)
            live = [k for k in live if not out[k].is_finished]
    finally:
        for k in keys:
            lm.stop(k)
    ordered = sorted(times) or [float("nan")]
    return {"batch": float(len(keys) - len(failed)), "p50_ms": 1000 * rank(ordered, 0.5),
            "p99_ms": 1000 * rank(ordered, 0.99), "steps": float(len(times))}


def rank(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile of sorted values."""
    return values[max(0, math.ceil(q * len(values)) - 1)]


def run_pass(backend: CosyVoiceBackend, n: int, text: str, tag: str, deadline: float = math.inf,
             max_steps: int = 1 << 16) -> dict[str, Any]:
    """N requests at once, stepped together to the end: TTFA, gaps and audio per request.

    Raises TimeoutError past `deadline` (time.perf_counter()) or `max_steps`
    steps; whatever ends the pass, its requests are released.
    """
    voice = backend.voices()[0].voice_id
    items = [backend.prepare(make_request(f"{tag}-{n}-{i}", text, voice)) for i in range(n)]
    first: dict[str, float] = {}
    audio_s: dict[str, float] = {item.request_id: 0.0 for item in items}
    gaps: dict[str, float] = {}
    live = list(items)
    start = time.perf_counter()
    num_steps = 0
    # the first FIRST_STEPS steps' end times: where a slow first audio went
    step_ends: list[float] = []
    first_step: dict[str, int] = {}
    try:
        while live:
            if time.perf_counter() > deadline or num_steps >= max_steps:
                raise TimeoutError(f"expected {n} streams to finish within the budget and "
                                   f"{max_steps} steps, got {len(live)} still running after "
                                   f"{num_steps} steps")
            results = backend.step(live)
            num_steps += 1
            now = time.perf_counter() - start
            if num_steps <= FIRST_STEPS:
                step_ends.append(now)
            for item, result in zip(list(live), results, strict=True):
                if result.error is not None:
                    raise RuntimeError(f"request {item.request_id} failed: {result.error!r}")
                key = item.request_id
                if len(result.pcm):
                    if key not in first:
                        first[key] = now
                        first_step[key] = num_steps
                    elif now - first[key] > audio_s[key]:  # the listener ran out before this chunk
                        gaps[key] = max(gaps.get(key, 0.0), now - first[key] - audio_s[key])
                    audio_s[key] += len(result.pcm) / SAMPLE_RATE
                if result.is_finished:
                    backend.release(item)
                    live.remove(item)
    finally:
        for item in live:  # a failed pass must not hold KV-cache slots into the next one
            backend.release(item)
    wall = time.perf_counter() - start
    ttfa = sorted(first.values()) or [float("nan")]
    return {"streams": n, "steps": num_steps, "wall_s": wall, "silent": n - len(first),
            "ttfa_p50_ms": 1000 * rank(ttfa, 0.5), "ttfa_p95_ms": 1000 * rank(ttfa, 0.95),
            "ttfa_max_ms": 1000 * ttfa[-1], "audio_s_mean": statistics.mean(audio_s.values()),
            "audio_s_per_s": sum(audio_s.values()) / wall,
            "streams_with_gaps": len(gaps), "max_gap_ms": 1000 * max(gaps.values(), default=0.0),
            "first_audio_step_p50": rank(sorted(first_step.values()) or [0], 0.5),
            "first_steps_ms": [round(1000 * (b - a), 1)
                               for a, b in zip([0.0] + step_ends, step_ends, strict=False)]}


def make_request(request_id: str, text: str, voice: str) -> SynthesisRequest:
    """A request stepped without an engine, in this build's shape or the build before's (which
    took a due time: 0.0, every request equally due, as this build's default)."""
    fields = {f.name for f in dataclasses.fields(SynthesisRequest)}
    extra: dict[str, Any] = {"deadline": 0.0} if "deadline" in fields else {}
    return SynthesisRequest(RequestId(request_id), text, voice, **extra)


def flow_streams_of(backend: CosyVoiceBackend) -> int:
    """Streams per flow call, as this build resolved them at load (the build before: its config)."""
    resolved = getattr(backend, "resolved", None)
    if resolved is not None:
        return int(resolved.flow_streams)
    return int(getattr(backend.config, "flow_streams", 0))


def random_model_parts() -> tuple[Any, Any, Any, Any]:
    """The random-checkpoint writers, where this checkout keeps them (tests/support/, or tests/
    in older layouts): (QWEN2_05B, QWEN2_TINY, write_random_model_dir, write_reference_wav)."""
    try:
        from tests.support import cosyvoice_random_checkpoint as checkpoint
        from tests.support import cosyvoice_random_parts as parts
    except ImportError:  # a build before the tests moved into rooms
        checkpoint = importlib.import_module("tests.cosyvoice_random_checkpoint")
        parts = importlib.import_module("tests.cosyvoice_random_parts")
    return (checkpoint.QWEN2_05B, checkpoint.QWEN2_TINY, checkpoint.write_random_model_dir,
            parts.write_reference_wav)


def build_config(args: argparse.Namespace, model_dir: Path, wav: Path, device: torch.device,
                 streams: list[int]) -> CosyVoiceBackendConfig:
    """The backend's options; those this build does not have (the anchor's) are left out, and
    said."""
    options: dict[str, Any] = {
        "model_dir": model_dir, "device": device.type, "lm_dtype": args.lm_dtype,
        "flow_dtype": args.flow_dtype,
        "decode_mode": args.decode_mode, "tokenizer": "bytes", "max_batch_size": max(streams),
        "max_streams": max(streams), "max_flow_streams": args.flow_streams, "max_len": 1024,
        "default_voice_audio": wav, "default_voice_text": "Hello there.",
        "flow_thread": args.flow_thread, "cudnn_attention": args.cudnn_attention}
    if args.max_flow_graph_row_frames is not None:
        options["max_flow_graph_row_frames"] = args.max_flow_graph_row_frames
    for pair in args.option:
        key, _, value = pair.partition("=")
        options[key] = value
    known = {f.name for f in dataclasses.fields(CosyVoiceBackendConfig)}
    left_out = sorted(set(options) - known)
    if left_out:
        print(f"this build has no option {', '.join(left_out)}: left out")
    # strings (--option) converted to each field's type, as --engine-option does; no VOXGATE_*
    # variable
    return CosyVoiceBackendConfig.from_options({k: v for k, v in options.items() if k in known},
                                               environ={})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (CI)")
    parser.add_argument("--version", type=int, choices=[2, 3], default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--streams", default="1,8,32,64,128,256")
    parser.add_argument("--text", default=ANSWER)
    parser.add_argument("--lm-dtype", default="auto")
    parser.add_argument("--flow-dtype", default="auto")
    parser.add_argument("--decode-mode", default="auto")
    parser.add_argument("--model-dir",
                        help="an existing model directory (default: write a random one)")
    parser.add_argument("--workdir", default=None,
                        help="where the random model directory is written")
    parser.add_argument("--flow-streams", type=int, default=0,
                        help="streams per flow call (default: the backend's, 128 on a GPU); fewer "
                             "capture fewer flow graphs at load")
    parser.add_argument("--max-flow-graph-row-frames", type=int, default=None,
                        help="largest flow call replayed as a CUDA graph (default: the backend's; "
                             "0: all)")
    parser.add_argument("--flow-thread", choices=["auto", "on", "off"], default="auto",
                        help="flow + vocoder on their own thread (auto: on a GPU)")
    parser.add_argument("--cudnn-attention", action="store_true",
                        help="allow cuDNN attention (the backend's default turns it off on a GPU)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="any other backend option (left out, and said, where this build has "
                             "none)")
    parser.add_argument("--label", default="this build",
                        help="which build runs (the JSON's `label`)")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--no-solo", action="store_true",
                        help="skip the LM-alone steps after each pass")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="wall-time budget of the whole run (model writing included)")
    parser.add_argument("--json", help="write the results here (after each N)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.streams, args.text, args.no_warmup = "cpu", "1,2", "Hi there.", True
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    streams = [int(n) for n in args.streams.split(",")]
    has_pyav = importlib.util.find_spec("av") is not None
    if not has_pyav:
        without_pyav()
    qwen_real, qwen_tiny, write_model, write_wav = random_model_parts()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="voxgate-cosyvoice-"))
    workdir.mkdir(parents=True, exist_ok=True)  # a --workdir that does not exist yet is made
    model_dir = (Path(args.model_dir) if args.model_dir
                 else workdir / f"cosyvoice{args.version}-random")
    started = time.perf_counter()
    if not (model_dir / "llm.pt").is_file():
        write_model(model_dir, args.version, qwen_tiny if args.smoke else qwen_real,
                    flow_size="tiny" if args.smoke else "real", with_frontend=True,
                    device=device, dtype=torch.float16)
    written = time.perf_counter()
    wav = workdir / "reference.wav"
    if not wav.is_file():
        write_wav(wav, seconds=3.0)
    config = build_config(args, model_dir, wav, device, streams)
    backend = CosyVoiceBackend(config)
    backend.load()
    loaded = time.perf_counter()
    # Random weights would stop any time (v3 masks only id 6561 below the minimum): forbid
    # every stop id there, so the text's length sets the answer's (2 tokens per byte, at least).
    assert isinstance(backend.lm, TorchLMDriver)
    backend.lm.runner.strict_min_length = True
    # The first device run spent 200 s of its budget here: say how much was the load (graph
    # captures).
    at_load = num_graphs(backend)
    print(f"[{args.label}] model written in {written - started:.1f} s, loaded in "
          f"{loaded - written:.1f} s (CUDA graphs captured at load: {at_load['lm']} LM, "
          f"{at_load['flow']} flow; {flow_streams_of(backend)} streams per flow call)")
    name = device.type if device.type == "cpu" else torch.cuda.get_device_name(device)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"label": args.label, "version": args.version, "device": name,
                              "pyav": has_pyav,
                              "rows": rows, "errors": {}, "capacity": 0,
                              "write_s": written - started,
                              "load_s": loaded - written, "graphs_at_load": at_load,
                              "flow_streams": flow_streams_of(backend),
                              "cache_gib": cache_gib(backend),
                              "options": {k: str(v) for k, v in dataclasses.asdict(config).items()}}
    deadline = started + args.budget_s
    max_steps = 4 * config.max_len  # a pass takes at most max_len LM steps and a final chunk
    for n in streams:
        if time.perf_counter() > deadline:
            result["errors"][str(n)] = f"skipped: the {args.budget_s:.0f} s budget was spent"
            continue
        try:
            if not args.no_warmup:
                run_pass(backend, n, WARMUP_TEXT, "warmup", deadline, max_steps)
            timer = StageTimer(device)
            instrument(backend, timer)
            before = num_graphs(backend)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                row = run_pass(backend, n, args.text, "run", deadline, max_steps)
                row["cache_gib"] = cache_gib(backend)  # before release: what the streams held
            finally:
                _uninstrument(backend)
            row["stages"] = timer.summary()
            lm_stage = row["stages"].get("lm_step", {})
            row["lm_step_p50_ms"] = lm_stage.get("ms_per_call", float("nan"))
            row["lm_step_p99_ms"] = lm_stage.get("p99_ms", float("nan"))
            if device.type == "cuda":
                row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            # a capture stalls its step (TTFA, gaps): the warm-up's short text does not reach every
            # bucket
            row["graphs_captured"] = {k: v - before[k] for k, v in num_graphs(backend).items()}
            if not args.no_solo and time.perf_counter() < deadline:
                solo = solo_lm(backend, n, args.text, "run")
                row["solo_step_p50_ms"], row["solo_step_p99_ms"] = solo["p50_ms"], solo["p99_ms"]
                row["lm_p99_over_solo"] = row["lm_step_p99_ms"] / solo["p50_ms"]
            rows.append(row)
        except Exception as exc:  # noqa: BLE001 (one N's failure must not lose the others' numbers)
            result["errors"][str(n)] = f"{type(exc).__name__}: {exc}"
        fine = [r["streams"] for r in rows if not r["streams_with_gaps"] and r["ttfa_p95_ms"] < 300]
        result["capacity"] = max(fine, default=0)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump(result, out, indent=1)
    assert backend.model is not None
    hidden = backend.model.model_dir.qwen_config()["hidden_size"]
    print(f"[{args.label}] CosyVoice {args.version} pipeline, random weights (LM hidden {hidden}), "
          f"{name}, LM {args.lm_dtype}, flow {args.flow_dtype}, decode {args.decode_mode}, "
          f"text of {len(args.text)} chars")
    print(table(rows))
    print(f"[{args.label}] gap-free with TTFA p95 < 300 ms up to: {result['capacity'] or 'none'} "
          f"of {streams} streams")
    for r in rows:
        print(f"{r['streams']} streams, first audio at step {r['first_audio_step_p50']} (p50); "
              f"first {len(r['first_steps_ms'])} steps, ms each: {r['first_steps_ms']}")
    for n_failed, error in result["errors"].items():
        print(f"{n_failed} streams: FAILED {error}")
    return result


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the passes (one line each)."""
    lines = [("| streams | TTFA p50 ms | TTFA p95 ms | gaps (streams) | max gap ms | audio s per s "
              "| LM step p50 "
             "/ p99 ms | LM alone p50 ms | p99 / alone | cache GiB (LM + flow) | flow ms/call "
             "(rows) | HiFT ms/call (rows) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st = r["stages"]
        flow, hift = st.get("flow", {}), st.get("hift", {})
        cache = r.get("cache_gib", {})
        lines.append(
            f"| {r['streams']} | {r['ttfa_p50_ms']:.0f} | {r['ttfa_p95_ms']:.0f} | "
            f"{r['streams_with_gaps']} | {r['max_gap_ms']:.0f} | {r['audio_s_per_s']:.1f} | "
            f"{r['lm_step_p50_ms']:.2f} / {r['lm_step_p99_ms']:.2f} | "
            f"{r.get('solo_step_p50_ms', float('nan')):.2f} | "
            f"{r.get('lm_p99_over_solo', float('nan')):.2f} | {cache.get('lm', 0.0):.2f} + "
            f"{cache.get('flow_used', cache.get('flow', 0.0)):.2f} | "
            f"{flow.get('ms_per_call', 0):.0f} ({flow.get('rows_per_call', 0):.1f}) | "
            f"{hift.get('ms_per_call', 0):.0f} ({hift.get('rows_per_call', 0):.1f}) |")
    return "\n".join(lines)


def without_pyav() -> None:
    """Stand-ins for the two PyAV uses a random-weight run reaches: reading the reference
    WAV (written here, 16-bit mono) and resampling it to 24 kHz for the prompt mel."""
    def read_wav(path: Path) -> tuple[np.ndarray, int]:
        with wave.open(str(path), "rb") as f:
            pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
            return (pcm.astype(np.float32) / 32768.0), f.getframerate()

    def resample(wav: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32).reshape(1, 1, -1))
        size = round(x.shape[-1] * target_rate / rate)
        return F.interpolate(x, size=size, mode="linear", align_corners=False).reshape(-1).numpy()

    print("PyAV is not installed: reading the reference with `wave`, resampling by interpolation")
    loader_module.read_audio = read_wav
    vars(voice_prompts_module)["resample"] = resample  # imported there by name from features.py


_ORIGINAL_VOCODE = getattr(t2w_module, VOCODER_NAME, None)


def _uninstrument(backend: CosyVoiceBackend) -> None:
    model = backend.model
    assert model is not None and backend.lm is not None
    solver = getattr(getattr(model.t2w, "cached", None), "solver", None)
    for obj, name in ((backend.lm, "step"), (model.t2w.flow, "infer"), (solver, "solve")):
        if obj is not None and name in getattr(obj, "__dict__", {}):
            delattr(obj, name)
    if _ORIGINAL_VOCODE is not None:
        setattr(t2w_module, VOCODER_NAME, _ORIGINAL_VOCODE)


if __name__ == "__main__":
    main()
