"""`voxgate ray-serve` from a fresh install of the ray extra alone (.ci/extras): ready, one turn,
stop.

Runs the documented command (docs/scaling.md) as a user would, with the
plain install plus `.[ray]` and nothing else: no pytest, no httpx. It waits
for /readyz through Serve's proxy, speaks one turn over the WebSocket, checks
that real Opus comes back (decoded: speech of a plausible length, not
silence), then stops the command with SIGINT and expects it to exit 0.
Usage: python .ci/smoke_ray_serve.py [--timeout-s 300]
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
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import websockets

from gateway.audio.codecs import decode_opus_packets

TEXT = "Hello from the ray extra. This turn went through Serve's proxy, both tiers and back."
# the console script of the venv this runs in
COMMAND = [str(Path(sys.executable).parent / "voxgate"), "ray-serve", "--gateway-replicas", "2",
           "--engine-replicas", "1",
           "--gateway-cpus", "0.5", "--engine-cpus", "1"]  # three replicas in two CPUs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen[bytes], log_path: Path,
               timeout_s: float) -> float:
    """Seconds until the command says it serves and /readyz answers 200; raises if the command
    exits or time runs out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise AssertionError(f"voxgate ray-serve exited with {process.returncode} before ready")
        if "voxgate on Ray Serve: http://" not in log_path.read_text(errors="replace"):
            time.sleep(0.5)
            continue
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"/readyz not 200 within {timeout_s:.0f} s")


async def one_turn(ws_url: str) -> tuple[np.ndarray, dict[str, object]]:
    """Speak TEXT on one socket; the decoded audio and the context.done event."""
    packets: list[bytes] = []
    async with websockets.connect(ws_url, max_size=None) as ws:
        ready = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert ready["type"] == "session.ready", ready
        await ws.send(json.dumps({"type": "text", "context_id": "smoke", "text": TEXT,
                                  "flush": True}))
        while True:
            frame = await asyncio.wait_for(ws.recv(), 60)
            message = (msgpack.unpackb(frame, raw=False) if isinstance(frame, bytes)
                       else json.loads(frame))
            if message["type"] == "audio":
                assert message["codec"] == "opus", message["codec"]
                packets.extend(message["packets"])
            elif message["type"] == "error":
                raise AssertionError(f"error event: {message}")
            elif message["type"] == "context.done":
                return decode_opus_packets(packets, 48000), message


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="for ready (Ray starts slowly)")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp(prefix="voxgate-ray-smoke-")) / "ray-serve.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen([*COMMAND, "--port", str(port)], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        ready_s = wait_ready(url, process, log_path, args.timeout_s)
        audio, done = asyncio.run(one_turn(url.replace("http://", "ws://") + "/v1/stream"))
        seconds = len(audio) / 48000
        rms = float(np.sqrt(np.mean(audio**2))) if len(audio) else 0.0
        assert seconds > 2.0, f"{seconds:.2f} s of audio for two sentences"
        assert rms > 0.01, f"the decoded audio is near silence (rms {rms:.4f})"
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)
        assert code == 0, f"voxgate ray-serve exited with {code} after SIGINT"
        print(f"ray-serve smoke: ready in {ready_s:.1f} s, one turn of {seconds:.2f} s of Opus "
              f"(rms {rms:.3f}, {done['segments']} segments), stopped cleanly; "
              f"{time.monotonic() - started:.1f} s in all")
        return 0
    except BaseException:
        print(f"ray-serve smoke failed; the command's log ({log_path}), last lines:",
              file=sys.stderr)
        print("\n".join(log_path.read_text(errors="replace").splitlines()[-60:]), file=sys.stderr)
        raise
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
