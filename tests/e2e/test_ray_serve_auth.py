"""API keys on Ray Serve, end to end: `voxgate ray-serve` with keys in its environment, as an
operator starts it (docs/operations.md, "Keys on Ray Serve").

The command runs as a subprocess on a local cluster, its proxy bound to 0.0.0.0 and
VOXGATE_API_KEYS set. A hostile client reaches it on the machine's own non-loopback address
(loopback where there is none) naming `Host: localhost`, and every route a gateway replica
serves refuses it: 401 on HTTP under /v1/, 4401 (or the vendor's close) on every socket.
With the key, a turn speaks. Before this was fixed, replicas never read the keys and ran in
loopback mode: that same client was everyone's operator. The launcher's own refusals need
no cluster and run first.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import websockets

with warnings.catch_warnings():  # Ray's modules warn on import (pydantic v1-style fields)
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("ray", reason="the ray extra: pip install -e '.[ray]'")
from tests.e2e.test_voices import make_wav
from tests.support.server import REPO, free_port
from tests.support.wsclient import Client, speak

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ResourceWarning")]

KEY = "sk-ray-auth-0123456789"
CARTESIA_PCM = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VOXGATE_API_KEYS", "VOXGATE_ADMIN_KEYS"))}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **extra}


# -- the launcher refuses before Ray starts --------------------------------------------------------

def _launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "ray-serve", *args], check=False,
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_ray_serve_refuses_a_public_host_unless_keys_really_loaded(tmp_path: Path) -> None:
    comments_only = tmp_path / "keys"
    comments_only.write_text("# the keys go here\n\n")
    refusals = {
        "no keys": _launch(["--host", "0.0.0.0"], _clean_env()),
        "an empty variable": _launch(["--host", "0.0.0.0"], _clean_env(VOXGATE_API_KEYS=" , ")),
        "a file without keys": _launch(["--host", "0.0.0.0", "--api-keys-file", str(comments_only)],
                                       _clean_env()),
    }
    for why, done in refusals.items():
        assert done.returncode == 2, (why, done.stdout, done.stderr)
        assert "refusing to listen on 0.0.0.0 without API keys" in done.stdout, (why, done.stdout)
        assert "Started a local Ray instance" not in done.stdout + done.stderr, why
    missing = _launch(["--host", "0.0.0.0", "--api-keys-file", str(tmp_path / "absent")],
                      _clean_env())
    assert missing.returncode == 2 and "bad configuration" in missing.stdout


# -- a cluster with keys ---------------------------------------------------------------------------

def _outward_address() -> str:
    """This machine's own non-loopback address (no packet is sent), else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.255", 9))  # TEST-NET: only picks the outward interface
            address = str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
    return address if not address.startswith("127.") and address != "0.0.0.0" else "127.0.0.1"


class KeyedCluster:
    def __init__(self, port: int, address: str, log_path: Path) -> None:
        self.port, self.address, self.log_path = port, address, log_path
        self.url = f"http://{address}:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def socket(self, path: str, headers: dict[str, str] | None = None) -> Any:
        """A WebSocket to `address`, its Host header `localhost:<port>` as a rebound client
        sends."""
        sock = socket.create_connection((self.address, self.port), timeout=30)
        sock.setblocking(False)
        return await websockets.connect(f"ws://localhost:{self.port}{path}", sock=sock,
                                        max_size=None, additional_headers=headers or {})


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedCluster]:
    tmp = tmp_path_factory.mktemp("ray-auth")
    port, log_path = free_port(), tmp / "ray-serve.log"
    command = [sys.executable, "-m", "gateway.cli", "ray-serve", "--host", "0.0.0.0", "--port",
               str(port),
               "--gateway-replicas", "1", "--engine-replicas", "1", "--gateway-cpus", "0.25",
               "--engine-cpus", "0.5", "--data-dir", str(tmp / "data")]
    env = _clean_env(VOXGATE_API_KEYS=KEY, PYTHONPATH=str(REPO))
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    cluster = KeyedCluster(port, _outward_address(), log_path)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, \
                f"voxgate ray-serve exited {process.returncode}:\n{cluster.log()}"
            assert time.monotonic() < deadline, f"not ready in 300 s:\n{cluster.log()[-4000:]}"
            if "voxgate on Ray Serve: http://" in cluster.log():
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        yield cluster
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


async def _answer(ws: Any, send: list[dict[str, Any]], quiet_s: float = 8.0) -> list[str]:
    """Every frame a socket answers (msgpack read as JSON), then `close <code>` (or `open`
    when it stays quiet for `quiet_s`)."""
    out: list[str] = []
    try:
        for message in send:
            await ws.send(json.dumps(message))
    except websockets.ConnectionClosed:
        pass  # refused already: what it said is still to be read
    try:
        while True:
            frame = await asyncio.wait_for(ws.recv(), quiet_s)
            out.append(frame if isinstance(frame, str)
                       else json.dumps(msgpack.unpackb(frame), default=str))
    except asyncio.TimeoutError:
        out.append("open")
    except websockets.ConnectionClosed as closed:
        out.append(f"close {closed.rcvd.code}" if closed.rcvd else "close none")
    return out


async def _keyless_sockets(cluster: KeyedCluster) -> dict[str, list[str]]:
    eleven = "/v1/text-to-speech/joe/stream-input?output_format=pcm_16000"
    turns: dict[str, tuple[str, list[dict[str, Any]]]] = {
        "stream": ("/v1/stream",
                   [{"type": "text", "context_id": "c", "text": "Hello.", "flush": True}]),
        "stream.token": ("/v1/stream?token=vxt_forged", []),
        "stream.api_key": ("/v1/stream?api_key=sk-wrong-0123456789", []),
        "elevenlabs.wrong_key": (eleven, [{"text": " ", "xi_api_key": "sk-wrong-0123456789"}]),
        "elevenlabs.no_key": (eleven, [{"text": " "}, {"text": "Hello there. "}]),
        "elevenlabs.silent": (eleven, []),
        "elevenlabs.multi": ("/v1/text-to-speech/joe/multi-stream-input", [{"text": " "}]),
        "cartesia": ("/tts/websocket?cartesia_version=2025-04-16",
                     [{"transcript": "Hello.", "context_id": "c", "continue": False,
                       "voice": {"mode": "id", "id": "joe"}, "output_format": CARTESIA_PCM}]),
        "deepgram": ("/v1/speak?model=joe&sample_rate=16000",
                     [{"type": "Speak", "text": "Hello."}]),
    }
    answers = {}
    for name, (path, send) in turns.items():
        try:
            ws = await cluster.socket(path)
        except websockets.InvalidStatus as refused:
            answers[name] = [f"refused {refused.response.status_code}"]
            continue
        async with ws:
            answers[name] = await _answer(ws, send)
    return answers


def test_every_route_refuses_a_caller_without_a_key_whatever_host_it_names(
        keyed: KeyedCluster) -> None:
    host = {"Host": "localhost"}  # what passed loopback mode's check
    with httpx.Client(base_url=keyed.url, timeout=60, headers=host) as http:
        answers = {
            "GET /v1/voices": http.get("/v1/voices"),
            "GET /v1/voices/joe": http.get("/v1/voices/joe"),
            "POST /v1/voices": http.post("/v1/voices",
                                         data={"id": "mine", "text": "Hello, this is me."},
                                         files={"audio": ("ref.wav", make_wav(1.5), "audio/wav")}),
            "DELETE /v1/voices/mine": http.delete("/v1/voices/mine"),
            "POST /v1/audio/speech": http.post("/v1/audio/speech",
                                               json={"input": "Hello.", "voice": "joe"}),
            "POST /v1/session-tokens": http.post("/v1/session-tokens"),
            "a wrong key": http.get("/v1/voices",
                                    headers={"Authorization": "Bearer sk-wrong-0123456789"}),
        }
        assert {route: r.status_code for route, r in answers.items()} == dict.fromkeys(answers, 401)
        assert all(r.json()["code"] == "unauthorized" for r in answers.values())
        for path in ("/healthz", "/readyz", "/metrics", "/"):  # open by design (docs/operations.md)
            assert http.get(path).status_code == 200, path
    sockets = asyncio.run(asyncio.wait_for(_keyless_sockets(keyed), 180))
    for name, frames in sockets.items():
        # An ElevenLabs socket waits for a first-message key, then closes 1008 at its deadline.
        expected = "close 1008" if name == "elevenlabs.silent" else "close 4401"
        assert frames[-1] == expected, (name, frames)
        assert any("unauthorized" in f for f in frames[:-1]), (name, frames)
        assert not any('"audio"' in f or '"chunk"' in f for f in frames), (name, frames)


def test_the_key_from_the_launchers_environment_speaks_on_every_kind_of_route(
        keyed: KeyedCluster) -> None:
    assert "auth is on: 1 API key(s)" in keyed.log()
    bearer = {"Authorization": f"Bearer {KEY}", "Host": "localhost"}
    with httpx.Client(base_url=keyed.url, timeout=120) as http:
        assert http.get("/v1/voices", headers=bearer).status_code == 200
        speech = http.post("/v1/audio/speech", headers=bearer,
                           json={"input": "Keys reach the replicas.", "voice": "joe",
                                 "response_format": "pcm"})
        assert speech.status_code == 200 and len(speech.content) > 24000  # half a second of PCM16

    async def turn() -> dict[str, Any]:
        sock = socket.create_connection((keyed.address, keyed.port), timeout=30)
        sock.setblocking(False)
        client = await Client.connect(f"ws://localhost:{keyed.port}/v1/stream", sock=sock,
                                      additional_headers={"Authorization": f"Bearer {KEY}"})
        try:
            return await asyncio.wait_for(speak(client, "k", "The key came through Ray."), 120)
        finally:
            await client.close()

    assert asyncio.run(turn())["audio_ms"] > 500
