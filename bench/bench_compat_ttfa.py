"""TTFA through the ElevenLabs-compatible socket against voxgate's own socket, in one run.

    python -m bench.bench_compat_ttfa                 # starts its own server on a free port
    python -m bench.bench_compat_ttfa --turns 60 --port 8000   # against a running server

One server, one socket per protocol, one turn at a time (no load). Each turn
streams a first sentence word by word, then ends it (native `flush`;
ElevenLabs `{"context_id", "flush": true}`) and times, on the client, from
that last send to the first audio frame received. Both sockets ask for the
same audio (PCM16 at 24 kHz, encoded alike for both), so the difference is
the adapter: message translation, base64 and JSON instead of binary msgpack,
and the client's own decoding of them. Turns
alternate between the protocols (seeded order), so drift on a shared machine
falls on both. A third column is the ElevenLabs socket in mp3_44100_128 (the
vendor's default), which encodes MP3 instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import websockets

from bench.bench_ttfa import native_turn

SENTENCES = [
    "The quick answer is yes, and here is why.",
    "Paris has been the capital of France for a very long time.",
    "Let me walk you through the three steps.",
    "That depends on how much memory your server has.",
    "Here is a short summary of the meeting notes.",
]
Turn = Callable[[Any, str, str], Awaitable[float]]


async def elevenlabs_turn(ws: Any, context_id: str, sentence: str) -> float:
    for word in sentence.split(" "):
        await ws.send(json.dumps({"text": word + " ", "context_id": context_id}))
    sent_at = time.perf_counter()
    await ws.send(json.dumps({"context_id": context_id, "flush": True}))
    await ws.send(json.dumps({"context_id": context_id, "close_context": True}))
    first: float | None = None
    while True:
        message = json.loads(await ws.recv())
        if message.get("audio") and first is None:
            first = time.perf_counter() - sent_at
        if message.get("isFinal"):
            assert first is not None
            return first


def adapter_cost_us(turns: int) -> dict[str, list[float]]:
    """The server's own work on the path to first audio, sans-I/O, per turn (microseconds).

    The same turn into the native `Session` and into the ElevenLabs adapter:
    the flush message, then the engine's first chunk (100 ms of PCM), up to the
    first audio frame encoded for the socket. No engine, no socket, no clock
    but `perf_counter`: the end-to-end numbers above are noisy on a shared
    machine; this is the adapter's cost itself.
    """
    import numpy as np

    from engine.types import AudioChunk
    from gateway.compat.elevenlabs import ElevenLabsMultiSession, parse_output_format
    from gateway.stream.actions import Send, SendFrame, Submit
    from gateway.stream.events import AudioEvent, encode_audio
    from gateway.stream.options import Limits, SessionOptions
    from gateway.stream.session import Session
    from gateway.voices.catalog import VoiceCatalog

    rate = 22050
    pcm = (np.sin(np.arange(rate // 10) / 7.0) * 0.3).astype(np.float32)
    out: dict[str, list[float]] = {"native": [], "elevenlabs": []}

    def first_frame(actions: list[Any], options: SessionOptions) -> bytes | str | None:
        for action in actions:
            if isinstance(action, SendFrame) and '"audio":"' in str(action.frame):
                return action.frame
            if isinstance(action, Send) and isinstance(action.message, AudioEvent):
                return encode_audio(action.message, options)
        return None

    for kind, timings in out.items():
        for turn in range(turns + 20):  # 20 warm-up turns
            options = SessionOptions(voice="joe", codec="pcm16", sample_rate=24000)
            if kind == "native":
                session: Session | ElevenLabsMultiSession = Session(
                    "bench", catalog=VoiceCatalog({"joe"}), sample_rate=rate, options=options)
                words = [json.dumps({"type": "text", "context_id": "c", "text": w + " "})
                         for w in SENTENCES[turn % len(SENTENCES)].split(" ")]
                flush = json.dumps({"type": "flush", "context_id": "c"})
            else:
                session = ElevenLabsMultiSession("bench", catalog=VoiceCatalog({"joe"}),
                                                 sample_rate=rate, options=options, limits=Limits(),
                                                 output=parse_output_format("pcm_24000"),
                                                 admit=lambda key: None, release=lambda key: None)
                words = [json.dumps({"text": w + " ", "context_id": "c"})
                         for w in SENTENCES[turn % len(SENTENCES)].split(" ")]
                flush = json.dumps({"context_id": "c", "flush": True})
            session.start(0.0)
            actions = []
            for word in words:
                actions += session.receive_frame(word, 0.0)
            started = time.perf_counter()
            actions += session.receive_frame(flush, 0.0)
            # the turn's first segment (the segmenter may have cut it early, before the flush)
            submit = next(a for a in actions if isinstance(a, Submit))
            chunk = AudioChunk(submit.request.request_id, pcm, rate, is_last=False)
            frame = first_frame(session.receive_audio(chunk, 0.0), options)
            elapsed = time.perf_counter() - started
            assert frame is not None
            if turn >= 20:
                timings.append(elapsed * 1e6)
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(port: int, turns: int, seed: int) -> dict[str, list[float]]:
    base = f"ws://127.0.0.1:{port}"
    urls = {
        "native (pcm16 24k)": f"{base}/v1/stream?codec=pcm16&sample_rate=24000",
        "elevenlabs (pcm_24000)":
            f"{base}/v1/text-to-speech/joe/multi-stream-input?output_format=pcm_24000",
        "elevenlabs (mp3_44100_128)":
            f"{base}/v1/text-to-speech/joe/multi-stream-input?output_format=mp3_44100_128",
    }
    turn_of: dict[str, Turn] = {name: native_turn if name.startswith("native") else elevenlabs_turn
                                for name in urls}
    sockets = {name: await websockets.connect(url, max_size=None) for name, url in urls.items()}
    await sockets["native (pcm16 24k)"].recv()  # session.ready
    results: dict[str, list[float]] = {name: [] for name in urls}
    rng = random.Random(seed)
    try:
        for turn in range(turns + 3):  # three warm-up rounds
            order = list(urls)
            rng.shuffle(order)
            sentence = SENTENCES[turn % len(SENTENCES)]
            for name in order:
                ttfa = await turn_of[name](sockets[name], f"t{turn}", sentence)
                if turn >= 3:
                    results[name].append(ttfa * 1000.0)
    finally:
        for ws in sockets.values():
            await ws.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, help="a running voxgate (default: start one)")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    server = None
    port = args.port
    if port is None:
        from tests.support.server import free_port

        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port",
                                   str(port),
                                   "--log-level", "warning"],
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        import httpx

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
    try:
        results = asyncio.run(run(port, args.turns, args.seed))
    finally:
        if server is not None:
            server.terminate()
            server.wait(20)
    costs = adapter_cost_us(max(200, args.turns * 5))
    native = statistics.median(results["native (pcm16 24k)"])
    print(f"TTFA, one turn at a time, {args.turns} turns per protocol (ms, client-side)")
    print(f"{'socket':28} {'p50':>7} {'p95':>7} {'mean':>7} {'p50 - native':>13}")
    for name, values in results.items():
        p50 = statistics.median(values)
        print(f"{name:28} {p50:7.1f} {_percentile(values, 0.95):7.1f} "
              f"{statistics.fmean(values):7.1f} {p50 - native:+13.1f}")

    base_us = statistics.median(costs["native"])
    print("\nServer work from the flush to the first audio frame, sans-I/O "
          f"({len(costs['native'])} turns, us)")
    print(f"{'path':28} {'p50':>7} {'p95':>7} {'p50 - native':>13}")
    for name, values in costs.items():
        p50 = statistics.median(values)
        print(f"{name:28} {p50:7.0f} {_percentile(values, 0.95):7.0f} {p50 - base_us:+13.0f}")


if __name__ == "__main__":
    main()
