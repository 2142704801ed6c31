"""`voxgate serve --workers N`: the engine in this process, the app in N worker processes.

The process that runs `voxgate serve` becomes the engine process. It loads the
backend and starts the `Engine` as a single-process server would, serves it on
a Unix socket in a private folder (host.py), binds the listening socket, and
starts N workers: `voxgate serve` again, with the same options and the
listening socket handed down, each running uvicorn with the app over a
`WorkerEngine` (child.py). The workers accept on the one socket, so the kernel
spreads connections over them.

Lifecycle:
- A worker that exits while the server runs is started again (its engine
  contexts, socket counts and requests are released when its channel closes);
  one that keeps dying (`MAX_RESTARTS` in `RESTART_WINDOW_S`) stops the server
  with exit status 1, and says so.
- SIGTERM or SIGINT: every worker gets one SIGTERM and drains as `voxgate
  serve` does (open contexts may finish within the grace period, then the
  sockets close with 1001); workers still running after the grace period and
  `STOP_SLACK_S` are killed; then the engine stops.
- Workers run in their own session (a terminal's Ctrl-C reaches only this
  process, which passes on one SIGTERM) and die with this process (child.py).
  The private folder (`FOLDER_PREFIX`, the pid, in $TMPDIR) goes when this
  process ends; a killed one's is removed by the next engine process to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.access.fair_share import FairShareConfig
from gateway.access.tokens import SessionTokens
from gateway.app import build_engine
from gateway.config import GatewayConfig
from gateway.workers.host import EngineHost

log = logging.getLogger("voxgate.gateway")

#: restarts of workers within RESTART_WINDOW_S seconds past which the server stops
MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0
#: seconds a draining worker gets beyond the shutdown grace before it is killed
STOP_SLACK_S = 10.0
MAX_WORKERS = 64
#: the private folder of an engine process (its channel, the workers' metric files), in $TMPDIR
FOLDER_PREFIX = "voxgate-workers-"


class Supervisor:
    """The engine process of a multi-process server (see the module doc)."""

    def __init__(self, config: GatewayConfig, num_workers: int, worker_argv: list[str]) -> None:
        if not 2 <= num_workers <= MAX_WORKERS:
            raise ValueError(f"--workers must be within 1-{MAX_WORKERS}, got {num_workers}")
        self.config = config
        self.num_workers = num_workers
        self.worker_argv = worker_argv  # `serve` and its options, less --workers
        _remove_stale_folders()
        self.folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
        self.channel = self.folder / "engine.sock"
        self.metrics_dir = self.folder / "metrics"
        self.metrics_dir.mkdir()
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts: list[float] = []
        self.listener: socket.socket | None = None
        self._stop = asyncio.Event()
        self.exit_code = 0

    def run(self) -> int:
        try:
            asyncio.run(self._main())
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        return self.exit_code

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        engine = build_engine(self.config)
        await engine.start()
        host = EngineHost(engine, self.channel, share=FairShareConfig(self.config.engine_share),
                          tokens=SessionTokens(ttl_s=self.config.session_token_ttl_s))
        try:
            await host.start()
            self.listener = _listen(self.config.host, self.config.port)
            for index in range(self.num_workers):
                self._start_worker(index)
            log.info("voxgate: the engine process %d serves %d workers on %s:%d", os.getpid(),
                     self.num_workers, self.config.host, self.config.port)
            while not self._stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.25)
                self._check_workers()
            await self._stop_workers()
        finally:
            for process in self.workers.values():
                if process.poll() is None:
                    process.kill()
            await host.stop()
            await engine.stop()
            if self.listener is not None:
                self.listener.close()

    def _start_worker(self, index: int) -> None:
        assert self.listener is not None
        fd = self.listener.fileno()
        import gateway

        root = str(Path(gateway.__file__).resolve().parents[1])  # this build, in every worker
        path = os.environ.get("PYTHONPATH", "")
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
               "PYTHONPATH": root + (os.pathsep + path if path else "")}
        command = [sys.executable, "-m", "gateway.cli", *self.worker_argv,
                   "--worker-channel", str(self.channel), "--worker-fd", str(fd),
                   "--worker-index", str(index), "--worker-parent", str(os.getpid())]
        self.workers[index] = subprocess.Popen(command, pass_fds=[fd], env=env,
                                               start_new_session=True)
        log.info("worker %d started (pid %d)", index, self.workers[index].pid)

    def _check_workers(self) -> None:
        for index, process in list(self.workers.items()):
            code = process.poll()
            if code is None or self._stop.is_set():
                continue
            _mark_dead(process.pid, self.metrics_dir)
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(self.restarts) > MAX_RESTARTS:
                log.error("voxgate: workers exited %d times in %.0f s (worker %d: status %s); "
                          "stopping the server", len(self.restarts), RESTART_WINDOW_S, index, code)
                self.exit_code = 1
                self._stop.set()
                return
            log.warning("worker %d (pid %d) exited with status %s; starting it again", index,
                        process.pid, code)
            self._start_worker(index)

    async def _stop_workers(self) -> None:
        log.info("stopping: %d workers drain (grace %.0f s)", len(self.workers),
                 self.config.shutdown_grace_s)
        for process in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_grace_s + STOP_SLACK_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.workers.values()):
            await asyncio.sleep(0.1)
        for index, process in self.workers.items():
            if process.poll() is None:
                log.error("worker %d did not stop in time; killed", index)
                process.kill()
            process.wait()


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket every worker accepts on (IPv6 where `host` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _remove_stale_folders() -> None:
    """The folders of engine processes that were killed (nothing of theirs runs any more)."""
    for folder in Path(tempfile.gettempdir()).glob(FOLDER_PREFIX + "*-*"):
        pid = folder.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or folder.owner() != _user():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            continue


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _mark_dead(pid: int, folder: Path) -> None:
    """Its open sessions and contexts leave the sums; its counters stay in the totals."""
    from prometheus_client import multiprocess

    with contextlib.suppress(OSError):
        multiprocess.mark_process_dead(pid, str(folder))  # type: ignore[no-untyped-call]
