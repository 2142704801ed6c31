"""Server CPU per second of audio on an ElevenLabs socket in MP3, beside another build, in one run.

    python -m bench.bench_compat_cpu                       # this checkout alone
    python -m bench.bench_compat_cpu --baseline fc0b9c1    # and the build before, side by side
    python -m bench.bench_compat_cpu --baseline /path/to/checkout --turns 30 --rounds 3

Each build runs as its own `voxgate serve` (the default piper voice), started
from its checkout's root with this interpreter; `--baseline` takes a checkout
or a git revision, which is checked out into a temporary `git worktree` for
the run and removed after. Both servers start first and are measured in
turns, round after round, so drift on a shared machine falls on both.

A round is `--turns` turns on one `multi-stream-input` socket asking for
`--format` (default `mp3_44100_128`, the vendor's default): a fixed answer of
four sentences sent as one text, then the bare flush and `close_context` with
which Pipecat and LiveKit end a turn, read to its `isFinal`. The audio
delivered is decoded here (PyAV: MP3 or Ogg read whole, raw formats by their
byte rate), so the count is the client's, the same for every build.

The server's CPU comes from /proc (utime + stime, in clock ticks), read before
and after each round: the whole process, and its main thread alone. The main
thread runs the event loop: the gateway's own work (segmenting, encoding,
framing, JSON and base64, the socket) and the engine's scheduling, while the
synthesis itself runs on the engine's worker threads. So the second figure is
where a change to the gateway shows; the first is what a user pays in all.
The table gives both, per second of audio delivered, each build's rounds
summed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import av
import websockets

REPO = Path(__file__).resolve().parents[1]
ANSWER = ("Sure, I can help with that. The train leaves at eight in the morning from the main "
          "station. It takes about two hours to get there. Bring a jacket, since it will be "
          "cold when you arrive.")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass
class Build:
    name: str
    root: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    audio_s: float = 0.0
    process_cpu_s: float = 0.0
    loop_cpu_s: float = 0.0
    rounds: list[tuple[float, float, float]] = field(default_factory=list)


def cpu_s(pid: int, thread: int | None = None) -> float:
    """utime + stime of a process (all its threads), or of one of its threads, in seconds."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # fields 14 and 15 of stat(5)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(build: Build, workdir: Path) -> None:
    build.port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(build.root)}
    log = (workdir / f"{build.name}.log").open("wb")
    build.process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1",
         "--port", str(build.port), "--data-dir", str(workdir / f"{build.name}-data"),
         "--log-level", "warning"], cwd=build.root, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if build.process.poll() is not None:
            raise RuntimeError(f"{build.name}: the server exited with {build.process.returncode}; "
                               f"see {workdir / f'{build.name}.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{build.port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{build.name}: the server was not ready within 120 s")


def audio_seconds(data: bytes, output_format: str) -> float:
    """What a client hears of one context's audio bytes."""
    kind, rate = output_format.split("_")[:2]
    if kind in ("mp3", "opus"):
        with av.open(io.BytesIO(data), "r", format="mp3" if kind == "mp3" else "ogg") as container:
            stream = container.streams.audio[0]
            samples = sum(int(frame.samples) for frame in container.decode(stream))
            return samples / float(stream.rate)
    width = 2 if kind == "pcm" else 1
    return len(data) / width / int(rate)


async def run_round(build: Build, turns: int, output_format: str, round_id: int) -> float:
    """`turns` turns on one socket; the seconds of audio delivered."""
    url = (f"ws://127.0.0.1:{build.port}/v1/text-to-speech/joe/multi-stream-input"
           f"?output_format={output_format}")
    total = 0.0
    async with websockets.connect(url, max_size=None) as ws:
        for turn in range(turns):
            context_id = f"r{round_id}t{turn}"
            for frame in ({"text": " ", "context_id": context_id},
                          {"text": ANSWER + " ", "context_id": context_id},
                          {"context_id": context_id, "flush": True},
                          {"context_id": context_id, "close_context": True}):
                await ws.send(json.dumps(frame))
            audio = b""
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if message.get("error"):
                    raise RuntimeError(f"{build.name}: {message}")
                if message.get("audio"):
                    audio += base64.b64decode(message["audio"])
                if message.get("isFinal"):
                    break
            total += audio_seconds(audio, output_format)
    return total


async def measure(builds: list[Build], args: argparse.Namespace) -> None:
    for build in builds:  # warm-up: first turns load caches, first encoders, first frames
        await run_round(build, 2, args.format, -1)
    for round_id in range(args.rounds):
        order = builds if round_id % 2 == 0 else builds[::-1]
        for build in order:
            assert build.process is not None
            pid = build.process.pid
            before = cpu_s(pid), cpu_s(pid, pid)
            audio_s = await run_round(build, args.turns, args.format, round_id)
            await asyncio.sleep(0.2)  # the last frames' bookkeeping, then read
            after = cpu_s(pid), cpu_s(pid, pid)
            build.rounds.append((audio_s, after[0] - before[0], after[1] - before[1]))
            build.audio_s += audio_s
            build.process_cpu_s += after[0] - before[0]
            build.loop_cpu_s += after[1] - before[1]


def checkout(baseline: str, workdir: Path) -> tuple[Path, bool]:
    """(the baseline's root, whether it is a worktree made here)."""
    if Path(baseline).is_dir():
        return Path(baseline).resolve(), False
    path = workdir / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), baseline],
                   check=True, capture_output=True)
    return path, True


def describe(root: Path) -> str:
    """The checkout's commit, `+` when its tree has changes of its own."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(root), *argv], check=False, capture_output=True,
                              text=True).stdout.strip()

    dirty = "+" if git("status", "--porcelain") else ""
    return (git("rev-parse", "--short", "HEAD") or "?") + dirty


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--baseline", help="another checkout, or a git revision to check out")
    parser.add_argument("--format", default="mp3_44100_128", help="the ElevenLabs output_format")
    parser.add_argument("--turns", type=int, default=20, help="turns per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-compat-cpu-"))
    builds = [Build("this", REPO)]
    made_worktree = False
    if args.baseline:
        root, made_worktree = checkout(args.baseline, workdir)
        builds.append(Build("baseline", root))
    commit = {build.name: describe(build.root) for build in builds}
    try:
        for build in builds:
            start(build, workdir)
        asyncio.run(measure(builds, args))
    finally:
        for build in builds:
            if build.process is not None:
                build.process.terminate()
                build.process.wait(20)
        if made_worktree:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(workdir / "baseline")], check=False, capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"ElevenLabs multi-stream-input, {args.format}, {args.rounds} rounds x {args.turns} "
          f"turns per build, {os.cpu_count()} CPUs")
    print(f"{'build':10} {'commit':9} {'audio s':>8} {'CPU s':>7} {'CPU ms/audio s':>15} "
          f"{'loop CPU s':>11} {'loop ms/audio s':>16}")
    for build in builds:
        print(f"{build.name:10} {commit[build.name]:9} {build.audio_s:8.1f} "
              f"{build.process_cpu_s:7.2f} {1000 * build.process_cpu_s / build.audio_s:15.1f} "
              f"{build.loop_cpu_s:11.2f} {1000 * build.loop_cpu_s / build.audio_s:16.1f}")
    for build in builds:
        per_round = ", ".join(f"{1000 * loop / audio:.1f}" for audio, _, loop in build.rounds)
        print(f"{build.name}: loop ms per audio s by round: {per_round}")


if __name__ == "__main__":
    main()
