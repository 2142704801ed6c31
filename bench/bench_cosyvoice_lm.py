"""Speed of voxgate's CosyVoice speech LM: prefill, batched decode, sampling.

Random weights (no download) at the real Qwen2-0.5B size or tiny; fixed seed,
warm-up, a printed table. Decode is timed through `SpeechLMRunner.feed`
(given tokens: the batch never shrinks), sampling separately on the same
log-probs.

    python -m bench.bench_cosyvoice_lm --size 0.5b --device cuda --dtype bfloat16 --batches 1,64,256
    python -m bench.bench_cosyvoice_lm --size tiny --device cpu --batches 1,8
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.backends.cosyvoice.lm.runner import SpeechLMRunner
from engine.backends.cosyvoice.lm.sampling import RasConfig, draw_uniforms, sample_tokens
from tests.support.cosyvoice_random_checkpoint import QWEN2_05B, QWEN2_TINY, random_speech_lm


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "0.5b"], default="tiny")
    parser.add_argument("--version", type=int, choices=[2, 3], default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--text-len", type=int, default=30)
    parser.add_argument("--prompt-speech-len", type=int, default=150)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    lm = random_speech_lm(
        args.version, QWEN2_05B if args.size == "0.5b" else QWEN2_TINY, seed=0, device=device
    ).to(dtype)
    lm.body.reset_rope(device)
    lm.requires_grad_(False)
    max_len = 1 + args.text_len + 8 + 1 + args.prompt_speech_len + args.warmup + args.steps + 8
    runner = SpeechLMRunner(lm, max(batches), max_len, RasConfig(), seed=0)
    gen = torch.Generator().manual_seed(0)
    eop = [151646]
    print(
        f"# CosyVoice {args.version} LM, {args.size}, {device}, {args.dtype}, "
        f"prompt {max_len - args.steps - args.warmup - 8} positions"
    )
    print("| batch | prefill ms/request | decode ms/step | sample ms/step | tokens/s |")
    print("|---:|---:|---:|---:|---:|")
    for batch in batches:
        streams = []
        sync(device)
        start = time.perf_counter()
        for _ in range(batch):
            text = torch.randint(0, 150000, (args.text_len,), generator=gen).tolist()
            speech = torch.randint(0, 6561, (args.prompt_speech_len,), generator=gen).tolist()
            streams.append(runner.add_request(text, eop + text[:8], speech))
        sync(device)
        prefill_ms = (time.perf_counter() - start) * 1000 / batch
        tokens = torch.randint(0, 6561, (args.warmup + args.steps, batch), generator=gen).tolist()
        for i in range(args.warmup):
            runner.feed(streams, tokens[i])
        sync(device)
        start = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            runner.feed(streams, tokens[i])
        sync(device)
        decode_ms = (time.perf_counter() - start) * 1000 / args.steps
        logp = runner.logp(streams)
        history = torch.full((batch, 10), -1, dtype=torch.long, device=device)
        greedy = torch.zeros(batch, dtype=torch.bool, device=device)
        sync(device)
        start = time.perf_counter()
        for step in range(args.steps):  # the per-stream uniforms included, as SpeechLMRunner.step
            uniforms = draw_uniforms(range(batch), [step] * batch, device)
            sample_tokens(logp, history, greedy, runner.ras, uniforms).tolist()
        sync(device)
        sample_ms = (time.perf_counter() - start) * 1000 / args.steps
        rate = batch * 1000 / (decode_ms + sample_ms)
        print(f"| {batch} | {prefill_ms:.1f} | {decode_ms:.2f} | {sample_ms:.2f} | {rate:.0f} |")
        for stream in streams:
            runner.free(stream)


if __name__ == "__main__":
    main()
