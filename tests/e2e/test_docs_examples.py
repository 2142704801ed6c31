"""The examples in docs/ run as written against a real server: docs/examples/stream_client.py
(docs/protocol.md, docs/client.md) and the 15-line voice agent of docs/client.md."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import threading
import wave
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import REPO, ServerProcess
from voxgate_client import ListSink

CLIENT_PATH = {"PYTHONPATH": os.pathsep.join([str(REPO / "clients/python"),
                                              os.environ.get("PYTHONPATH", "")])}


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "docs/examples/stream_client.py"), *args],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **CLIENT_PATH})


def test_stream_client_example_saves_speech(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "answer.wav"
    result = run_example(server.ws_url, str(out))
    assert result.returncode == 0, result.stderr
    assert "segment at 0 ms: Sure!" in result.stdout and "done:" in result.stdout
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 24000
        assert wav.getnframes() / 24000 > 3.0


def test_stream_client_example_barges_in_and_says_what_was_heard(
        server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "cut.wav"
    result = run_example(server.ws_url, str(out), "--barge-in-ms", "1500")
    assert result.returncode == 0, result.stderr
    assert "barge-in at 1500 ms; heard: 'Sure! The capital" in result.stdout
    with wave.open(str(out)) as wav:
        assert 1.5 <= wav.getnframes() / 24000 < 3.0


LLM_ANSWER = ("Paris is the capital of France. It sits on the Seine, and it has been the "
              "capital for most of a thousand years.")


@pytest.fixture
def fake_openai() -> Iterator[str]:
    """An OpenAI-compatible chat endpoint streaming a fixed answer (no LLM runs here, and CI
    has no key): the real `openai` SDK reads it as it reads the real one."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/chat/completions" and body["stream"] is True
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            words = LLM_ANSWER.replace(" ", "\0 ").split("\0")
            deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
            deltas += [{"content": w} for w in words] + [{}]
            for n, delta in enumerate(deltas):
                chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0,
                         "model": body["model"], "choices": [{
                             "index": 0, "delta": delta,
                             "finish_reason": "stop" if n == len(deltas) - 1 else None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("barge_in", [False, True], ids=["played-out", "barge-in"])
def test_the_fifteen_line_voice_agent_speaks_an_openai_stream_and_barges_in(
        server: ServerProcess, fake_openai: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], barge_in: bool) -> None:
    """As written, but with a recording sink for the speakers (there is no sound device here)
    and a timer for the Enter key (there is no console)."""
    spec = importlib.util.spec_from_file_location("voice_agent",
                                                  REPO / "docs/examples/voice_agent.py")
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    code = (REPO / "docs/examples/voice_agent.py").read_text()
    body = code[code.index("async def main"):code.index('if __name__ == "__main__":')]
    assert len([line for line in body.splitlines() if line.strip()]) <= 15
    sinks: list[ListSink] = []
    monkeypatch.setattr(agent, "Speakers", lambda: sinks.append(ListSink()) or sinks[-1])
    monkeypatch.setattr(agent, "key_press", lambda: asyncio.sleep(1.5) if barge_in
                        else asyncio.get_running_loop().create_future())  # Enter, or never
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_BASE_URL", fake_openai)
    asyncio.run(asyncio.wait_for(agent.main(server.ws_url), 120))
    heard = capsys.readouterr().out.split("The listener heard: ", 1)[1].strip()
    (sink,) = sinks
    assert sink.chunks and sink.chunks[0].pcm is not None  # decoded Opus reached the speakers
    if barge_in:
        assert heard and LLM_ANSWER.startswith(heard) and heard != LLM_ANSWER
        assert sink.cleared == 1
    else:
        assert heard == LLM_ANSWER
        assert sum(c.duration_ms for c in sink.chunks) > 4000
