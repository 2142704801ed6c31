"""Decode step time of the CosyVoice speech LM per batch size, eager against CUDA graphs.

Random weights at the real CosyVoice 2/3 LM size (Qwen2-0.5B body, 24 layers,
hidden 896), bf16, the slot KV cache of lm/runner.py. For each batch size, `feed`
advances that many streams by one token, each with `--context` positions
already in its cache (the cache's contents do not change the timing, so no
prefill is run); warm-up, then the median of `--steps` steps. Modes:
"dynamic" (eager, exact shapes), "static" (eager, bucketed shapes),
"cuda_graphs" (the static step replayed as a CUDA graph per bucket). A step
is the whole decode step of lm/decode_step.py: the token chosen on the device
(sampling included; here given, as teacher forcing does) and fed. Beside it,
`bare_ms`: the forward alone (embedding, the layers, the head) for the same
rows, replayed as one graph on a GPU: the floor a step is held to (the issue's
target: a step within 1.5x of it).
A case that fails is reported in `errors` and the others go on; `--json` is
rewritten after every case, so a run cut short keeps what it measured.

One device call (about 2 minutes on an H200):

    python -m bench.gpu_cosyvoice_lm --json /tmp/lm.json

CPU smoke run (tiny sizes; CI runs it so the script does not rot):

    python -m bench.gpu_cosyvoice_lm --smoke
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

from bench.gpu_common import DTYPES, Results, device_name, median_ms
from engine.backends.cosyvoice.lm.runner import LMStream, SpeechLMRunner
from engine.backends.cosyvoice.lm.sampling import RasConfig, draw_uniforms, sample_tokens
from engine.backends.cosyvoice.models.qwen2 import CacheView
from tests.support.cosyvoice_random_checkpoint import QWEN2_05B, QWEN2_TINY, random_speech_lm


def fake_streams(runner: SpeechLMRunner, n: int, context: int) -> list[LMStream]:
    """`n` streams that own slots 0..n-1 with `context` positions cached (no prefill: timing
    only)."""
    streams = []
    for _ in range(n):
        slot = runner._free.pop()
        stream = LMStream(slot=slot, min_len=0, max_len=1 << 30, is_greedy=True, prompt_len=context,
                          num_cached=context, tokens=[])
        runner._owners[slot] = stream
        streams.append(stream)
    return streams


def time_decode(runner: SpeechLMRunner, streams: list[LMStream], context: int, steps: int,
                warmup: int) -> float:
    """Median ms of one `feed` (one token for every stream) at a fixed cache length."""
    tokens = [i % 6561 for i in range(len(streams))]
    # serving never captures: capture first
    if runner.static is not None and runner.static.use_graphs:
        runner.static.capture(*runner.static.buckets_for([s.slot for s in streams],
                                                         [context] * len(streams)))

    def rewind() -> None:
        for s in streams:
            s.num_cached = context

    return median_ms(lambda: runner.feed(streams, tokens), runner.device, steps, warmup,
                     before=rewind)


def time_bare(runner: SpeechLMRunner, n: int, context: int, steps: int, warmup: int) -> float:
    """Median ms of the forward alone for rows [0, n) at `context` cached positions (a CUDA graph on
    a GPU, eager elsewhere): no sampling, no input copies, no read-back."""
    device, lm = runner.device, runner.lm
    kv = context + 1
    if runner.static is not None:
        kv = runner.static.buckets_for(list(range(n)), [context] * n)[1]
    tokens = torch.zeros(n, dtype=torch.long, device=device)
    view = CacheView(runner.cache, torch.arange(n, device=device),
                     torch.full((n, 1), context, dtype=torch.long, device=device), kv_len=kv,
                     row_range=(0, n))

    def body() -> torch.Tensor:
        return lm.head_logp(lm.forward_hidden(lm.token_embeds(tokens).to(runner.dtype),
                                              view)[:, -1])

    run = body
    with torch.inference_mode():
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                body()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            run = graph.replay  # type: ignore[assignment]
        return median_ms(run, device, steps, warmup)


def time_sampling(runner: SpeechLMRunner, n: int, steps: int) -> float:
    """Median ms of choosing `n` tokens by RAS, the per-stream uniforms included (as `step`
    does)."""
    logp = torch.randn(n, runner.spec.num_rows, device=runner.device).log_softmax(-1)
    history = torch.full((n, runner.ras.win_size), -1, dtype=torch.long, device=runner.device)
    is_greedy = torch.zeros(n, dtype=torch.bool, device=runner.device)
    seeds, step = list(range(n)), itertools.count()

    def choose() -> None:
        uniforms = draw_uniforms(seeds, [next(step)] * n, runner.device)
        sample_tokens(logp, history, is_greedy, runner.ras, uniforms)

    return median_ms(choose, runner.device, steps, warmup=2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (CI)")
    parser.add_argument("--version", type=int, choices=[2, 3], default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512,1024")
    parser.add_argument("--modes", default="dynamic,cuda_graphs")
    parser.add_argument("--context", type=int, default=400, help="cached positions per stream")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.batches, args.modes = "1,2,4", "dynamic,static"
        args.context, args.max_len, args.steps, args.warmup = 16, 64, 2, 1
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    torch.manual_seed(0)
    lm = random_speech_lm(args.version, QWEN2_TINY if args.smoke else QWEN2_05B, seed=0,
                          device=device)
    lm = lm.to(DTYPES[args.dtype])
    lm.body.reset_rope(device)
    lm.body.lm_head.weight = torch.nn.Parameter(torch.empty(0, lm.body.config.hidden_size,
                                                            device=device),
                                                requires_grad=False)
    result: dict[str, Any] = {"version": args.version, "device": str(device), "dtype": args.dtype,
                              "context": args.context, "rows": [], "sampling_ms": {}, "bare_ms": {},
                              "errors": {}}
    save = Results(result, args.json).save

    rows: list[dict[str, Any]] = result["rows"]
    for mode in modes:
        try:
            runner = SpeechLMRunner(lm, max(batches), args.max_len, RasConfig(), seed=0,
                                    decode_mode=mode)
        except Exception as exc:  # noqa: BLE001 (one mode's failure must not lose the others' numbers)
            result["errors"][mode] = f"{type(exc).__name__}: {exc}"
            save()
            continue
        for n in batches:
            streams = fake_streams(runner, n, args.context)
            try:
                ms = time_decode(runner, streams, args.context, args.steps, args.warmup)
                rows.append({"mode": mode, "batch": n, "decode_ms": ms,
                             "tokens_per_s": n / ms * 1000})
                if mode == modes[-1]:  # the fastest mode's runner: its buckets
                    bare = time_bare(runner, n, args.context, args.steps, args.warmup)
                    result["bare_ms"][n] = bare
                    rows[-1]["over_bare"] = ms / bare
            except Exception as exc:  # noqa: BLE001 (as above: the next batch may still run)
                result["errors"][f"{mode} {n}"] = f"{type(exc).__name__}: {exc}"
            for s in streams:
                runner.free(s)
            save()
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sampling: dict[int, float] = result["sampling_ms"]
    for n in batches:
        try:
            sampling[n] = time_sampling(SpeechLMRunner(lm, 1, 8), n, args.steps)
        except Exception as exc:  # noqa: BLE001 (as above)
            result["errors"][f"sampling {n}"] = f"{type(exc).__name__}: {exc}"
        save()
    print(f"CosyVoice {args.version} LM, {'tiny' if args.smoke else 'Qwen2-0.5B'} random weights, "
          f"{args.dtype}, {device} ({device_name(device)}), "
          f"{args.context} cached positions")
    header = ("| batch | " + " | ".join(f"{m} step ms" for m in modes)
              + " | forward alone ms | step / alone | RAS sampling ms (eager) | best tokens/s |")
    print(header)
    print("|" + "---|" * (len(modes) + 5))
    bare_ms: dict[int, float] = result["bare_ms"]
    for n in batches:
        per_mode = {r["mode"]: r["decode_ms"] for r in rows if r["batch"] == n}
        cells = " | ".join(f"{per_mode[m]:.2f}" if m in per_mode else "-" for m in modes)
        best = f"{n / min(per_mode.values()) * 1000:.0f}" if per_mode else "-"
        sampled = f"{sampling[n]:.2f}" if n in sampling else "-"
        alone = f"{bare_ms[n]:.2f}" if n in bare_ms else "-"
        has_ratio = n in bare_ms and modes[-1] in per_mode
        ratio = f"{per_mode[modes[-1]] / bare_ms[n]:.2f}" if has_ratio else "-"
        print(f"| {n} | {cells} | {alone} | {ratio} | {sampled} | {best} |")
    for case, error in result["errors"].items():
        print(f"{case}: FAILED {error}")
    return result


if __name__ == "__main__":
    main()
