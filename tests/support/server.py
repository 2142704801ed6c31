"""A real voxgate server for end-to-end tests: `voxgate serve` (or uvicorn on an app factory) as a
subprocess on loopback, and the helpers to talk to it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.wait import async_wait_until, wait_until

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A running `voxgate serve`; `url` is http://127.0.0.1:PORT."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric from /metrics."""
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith((name + " ", name + "{}")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    async def metric_reaches(self, name: str, value: float, timeout: float = 30.0) -> None:
        """Wait, the event loop running, until an unlabelled metric reads `value`."""
        await async_wait_until(lambda: self.metric(name) == value, timeout=timeout, interval=0.1,
                               message=lambda: f"{name} stayed at {self.metric(name)}, expected "
                                               f"{value}")

    def stop(self, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


def start_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                 ready_timeout: float = 90.0, app_factory: str | None = None,
                 port: int | None = None) -> ServerProcess:
    """Start `voxgate serve` (or uvicorn on `app_factory`) on `port` (a free one by default);
    wait for /readyz."""
    port = port or free_port()
    log_path = tmp_path / f"server-{port}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.setdefault("VOXGATE_DATA_DIR", str(tmp_path / "data"))
    if app_factory is None:
        command = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port",
                   str(port)]
    else:
        command = [sys.executable, "-m", "uvicorn", app_factory, "--factory", "--host", "127.0.0.1",
                   "--port", str(port)]
    with open(log_path, "wb") as log_file:  # the child keeps its own handle
        process = subprocess.Popen([*command, *args], cwd=REPO, env=full_env, stdout=log_file,
                                   stderr=subprocess.STDOUT)
    server = ServerProcess(process, port, log_path)

    def is_ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            return httpx.get(server.url + "/readyz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(is_ready, timeout=ready_timeout, interval=0.2)
    except AssertionError:
        server.stop()
        raise RuntimeError(f"server not ready after {ready_timeout} s:\n{server.log()}") from None
    return server
