"""Capacity through the product's own path: `voxgate serve --engine cosyvoice` under the load tool.

Serves a CosyVoice model directory (on the GPU: the random one at real sizes
that the pipeline bench writes) as a user would, with `--voice default`,
`--engine-option tokenizer=bytes` and a reference WAV as the default voice,
and plays staggered talking sessions against it with the load tool
(loadtest/: each session streams an answer's sentences in as an LLM would,
listens to the audio on a playback clock, thinks, and takes the next turn),
one level of sessions after another. Per level: TTFA p50 and p95, gaps,
turns finished and refused, audio seconds per wall second, and whether it
holds (TTFA p95 <= 300 ms, no gap, every turn served: loadtest.metrics.passes).
At the end the server's /metrics (the engine's counters) are kept.

The answers are short (two or three sentences, `ANSWERS`): random weights
read bytes, two speech tokens per byte at least (`--strict-min-length`, as
the pipeline bench does: random weights would otherwise stop at any time), so
a sentence of 40 characters is about 3 s of audio, and a session takes
several turns per level.

The server runs as a child process of this script (`--child`), so the same
script serves another checkout's engine (the build before: its root on
PYTHONPATH, `--root`); the load tool is always this checkout's.

One device call (bench/gpu_all.sh runs it after the pipeline bench wrote the model):

    python -m bench.gpu_gateway_load --model-dir MODEL --reference REF.wav --json /tmp/gateway.json

CPU smoke run (a tiny model; tests/unit/bench/test_gpu_scripts.py):

    python -m bench.gpu_gateway_load --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ANSWERS = [
    "Sure, I can help with that. The train leaves at eight. It takes about two hours.",
    "Good question. Most people sleep better in a cool room. Try it for a week.",
    "The store opens at nine today. It closes early on Sunday.",
    "I checked the forecast for you. It looks mild and dry. A light jacket is enough.",
    "Yes, that works. I moved the meeting to Friday. Everyone got the new invite.",
    "Here is the short version. Mix the flour and the water. Let it rest for an hour.",
    "That is a fair point. The second plan costs less. It also takes less time.",
    "Thanks for waiting. Your order shipped this morning. It should arrive on Tuesday.",
]


# -- the server (a child process) ------------------------------------------------------------------


def child_main(argv: list[str]) -> int:
    """Run `voxgate` with `argv`; with --strict-min-length first, every stop id is forbidden below
    the LM's minimum length (random weights: the text sets the answer's length)."""
    strict = "--strict-min-length" in argv
    argv = [a for a in argv if a != "--strict-min-length"]
    if strict:
        from engine.backends.cosyvoice.lm.runner import SpeechLMRunner

        init = SpeechLMRunner.__init__

        def strict_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.strict_min_length = True

        SpeechLMRunner.__init__ = strict_init  # type: ignore[method-assign]
    import gateway
    from gateway.cli import main as voxgate_main

    print(f"voxgate from {Path(gateway.__file__).resolve().parents[1]}", flush=True)
    return int(voxgate_main(argv) or 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, port: int, workdir: Path,
                 log_path: Path) -> subprocess.Popen[bytes]:
    root = Path(args.root).resolve()
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--strict-min-length",
               "serve",
               "--engine", "cosyvoice", "--model-dir", str(args.model_dir), "--voice", "default",
               "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(workdir / "data"),
               "--shutdown-grace", "2", "--engine-option", "tokenizer=bytes",
               "--engine-option", f"default_voice_audio={args.reference}",
               "--engine-option", "default_voice_text=Hello there."]
    for option in args.engine_option:
        command += ["--engine-option", option]
    command += args.server_arg
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(root),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    with log_path.open("wb") as log:
        return subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"expected the server to start, got exit code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("expected the server to be ready within the budget, got no answer from "
                       "/readyz")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def engine_metrics(url: str) -> dict[str, float]:
    """The server's voxgate_* samples without labels, and its histograms' buckets (keyed
    `name{le="bound"}`, as /metrics writes them), from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        is_bucket = name.endswith("\"}") and "_bucket{le=" in name
        if line.startswith("voxgate_") and ("{" not in name or is_bucket) and value:
            try:
                out[name] = float(value.split()[0])
            except ValueError:
                continue
    return out


# -- the load --------------------------------------------------------------------------------------


def level_row(sessions: int, summary: dict[str, Any], holds: bool) -> dict[str, Any]:
    ttfa, turns, gaps = summary["ttfa_segment_ms"], summary["turns"], summary["gaps"]
    return {"sessions": sessions, "holds": holds, "ttfa_p50_ms": ttfa.get("p50"),
            "ttfa_p95_ms": ttfa.get("p95"),
            "gaps": gaps["count"], "gap_ms": gaps["total_ms"], "turns_started": turns["started"],
            "turns_completed": turns["completed"], "turns_failed": turns["failed"],
            "turns_timed_out": turns["timed_out"], "turns_aborted": turns["aborted"],
            "errors": summary["errors"], "audio_s_per_s": summary["audio"]["per_wall_second"],
            "client_cpu_share_of_machine": summary["run"]["client_cpu_share_of_machine"]}


async def run_levels(args: argparse.Namespace, url: str, corpus_path: Path, deadline: float,
                     result: dict[str, Any], save: Any) -> None:
    from loadtest.config import LoadConfig
    from loadtest.corpus import load_corpus
    from loadtest.metrics import passes
    from loadtest.runner import run_fixed

    config = LoadConfig(url=url, corpus_path=str(corpus_path), token_rate=args.token_rate,
                        think_s=args.think, drain_s=args.drain, turn_timeout_s=args.turn_timeout,
                        query={"voice": "default"})
    corpus = load_corpus(corpus_path)
    for n in args.levels:
        if time.monotonic() + args.duration + args.drain + 5 > deadline:
            result["errors"][str(n)] = "skipped: the budget was spent"
            continue
        level = await run_fixed(config, corpus, n, args.duration, "gateway")
        holds = passes(level.summary, args.ttfa_target_ms)
        row = level_row(n, level.summary, holds)
        result["levels"].append(row)
        ttfa = ("-" if row["ttfa_p50_ms"] is None
                else f"{row['ttfa_p50_ms']:.0f} / {row['ttfa_p95_ms']:.0f}")
        print(f"[{result['label']}] {n} sessions: TTFA p50 / p95 {ttfa} ms, "
              f"{row['gaps']} gaps, {row['turns_completed']} of {row['turns_started']} turns done, "
              f"errors {row['errors']}: {'holds' if holds else 'fails'}", flush=True)
        save()


def table(rows: list[dict[str, Any]]) -> str:
    lines = [("| sessions | TTFA p50 / p95 ms | gaps (total ms) | turns done / started | refused "
              "or failed | audio s per s | holds |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        p50, p95 = r["ttfa_p50_ms"], r["ttfa_p95_ms"]
        ttfa = "-" if p50 is None else f"{p50:.0f} / {p95:.0f}"
        lines.append(f"| {r['sessions']} | {ttfa} | {r['gaps']} ({r['gap_ms']:.0f}) | "
                     f"{r['turns_completed']} / {r['turns_started']} | "
                     f"{r['turns_failed'] + r['turns_timed_out']} | {r['audio_s_per_s']:.1f} | "
                     f"{'yes' if r['holds'] else 'no'} |")
    return "\n".join(lines)


def ensure_model(model_dir: Path, reference: Path, tiny: bool) -> None:
    """Write the random model (real sizes, or tiny) and a 3 s reference where they are missing."""
    import torch

    from tests.support.cosyvoice_random_checkpoint import (
        QWEN2_05B,
        QWEN2_TINY,
        write_random_model_dir,
    )
    from tests.support.cosyvoice_random_parts import write_reference_wav

    if not (model_dir / "llm.pt").is_file():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        write_random_model_dir(model_dir, 3, QWEN2_TINY if tiny else QWEN2_05B,
                               flow_size="tiny" if tiny else "real",
                               with_frontend=True, device=device, dtype=torch.float16)
    if not reference.is_file():
        write_reference_wav(reference, seconds=3.0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model on the CPU, two short levels (CI)")
    parser.add_argument("--model-dir",
                        help="the CosyVoice model directory to serve (default: a random one "
                        "written under --workdir)")
    parser.add_argument("--reference",
                        help="the default voice's reference WAV, transcript 'Hello there.' "
                        "(default: a synthetic 3 s one written under --workdir)")
    parser.add_argument("--root", default=str(REPO),
                        help="the checkout whose gateway and engine serve")
    parser.add_argument("--label", default="this build")
    parser.add_argument("--levels", default="1,8,32,64,128", help="sessions per level, in order")
    parser.add_argument("--duration", type=float, default=20.0,
                        help="seconds per level (turns start)")
    parser.add_argument("--drain", type=float, default=10.0,
                        help="seconds the last turns may finish")
    parser.add_argument("--think", type=float, default=1.0,
                        help="mean pause between a session's turns")
    parser.add_argument("--token-rate", type=float, default=40.0, help="LLM tokens per second")
    parser.add_argument("--turn-timeout", type=float, default=30.0)
    parser.add_argument("--ttfa-target-ms", type=float, default=300.0)
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="another `voxgate serve` argument (repeat; e.g. "
                             "--server-arg=--max-contexts=256)")
    parser.add_argument("--workdir",
                        help="where the server's data and log go (default: a new temp dir)")
    parser.add_argument("--server-log", help="copy the server's log here at the end")
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall time for the whole run")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="voxgate-gateway-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.levels, args.duration, args.drain, args.think = "1,2", 4.0, 8.0, 0.5
        args.engine_option = ["sampling=greedy", "num_threads=1", *args.engine_option]
    args.model_dir = Path(args.model_dir or workdir / "cosyvoice3-random").resolve()
    args.reference = Path(args.reference or workdir / "reference.wav").resolve()
    ensure_model(args.model_dir, args.reference, tiny=args.smoke)
    args.levels = [int(n) for n in args.levels.split(",")]
    corpus_path = workdir / "answers.jsonl"
    corpus_path.write_text("".join(json.dumps({"id": f"g{i}", "lang": "en", "text": text}) + "\n"
                                   for i, text in enumerate(ANSWERS)), encoding="utf-8")
    result: dict[str, Any] = {"label": args.label, "levels": [], "errors": {}, "capacity": 0,
                              "engine_options": args.engine_option, "server_args": args.server_arg}

    def save() -> None:
        fine = [r["sessions"] for r in result["levels"] if r["holds"]]
        held = [n for n in fine if all(r["holds"] for r in result["levels"] if r["sessions"] <= n)]
        result["capacity"] = max(held, default=0)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / "server.log"
    proc = start_server(args, port, workdir, log_path)
    try:
        wait_ready(url, proc, deadline)
        result["load_s"] = time.monotonic() - started
        print(f"[{args.label}] voxgate serve --engine cosyvoice ready in {result['load_s']:.0f} s",
              flush=True)
        asyncio.run(run_levels(args, url, corpus_path, deadline, result, save))
        result["metrics"] = engine_metrics(url)
    except Exception as exc:  # noqa: BLE001 (what was measured is kept and said)
        result["errors"]["run"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop_server(proc)
        save()
        if args.server_log:
            Path(args.server_log).write_bytes(log_path.read_bytes())
    print(table(result["levels"]))
    metrics = result.get("metrics", {})
    print(f"[{args.label}] holds up to {result['capacity'] or 'none'} sessions; engine: "
          f"{metrics.get('voxgate_engine_audio_seconds_total', 0):.0f} audio s in "
          f"{metrics.get('voxgate_engine_busy_seconds_total', 0):.0f} busy s, max contexts "
          f"{metrics.get('voxgate_engine_max_contexts', 0):.0f}")
    for key, error in result["errors"].items():
        print(f"{key}: FAILED {error}")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2:]))
    main()
