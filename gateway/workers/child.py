"""One gateway worker of `voxgate serve --workers N`: the app over the engine process's engine.

`build_worker_app` makes the ordinary app (gateway/app.py) with a
`WorkerEngine` in place of an in-process engine, then gives its `AppState` the
engine process's admission: the one fair share, the one socket count and the
one table of session tokens (control.py). The rest of the app is as in one
process; /metrics sums every worker's counters (gateway/metrics.py,
multiprocess mode), whose open sessions and contexts this worker writes every
`METRICS_REFRESH_S`.

`watch_parent` ties the worker's life to the engine process's: the kernel
sends SIGTERM when the parent dies (Linux's parent-death signal), and a
worker that finds itself orphaned at start, or that loses the engine channel,
stops as `voxgate serve` does on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import AppState
from gateway.workers.client import WorkerEngine
from gateway.workers.control import SharedFairShare, SharedKeyCounter, SharedSessionTokens

log = logging.getLogger("voxgate.gateway")

#: seconds between this worker's writes of its open sessions and contexts for /metrics
METRICS_REFRESH_S = 0.5
_PR_SET_PDEATHSIG = 1


def watch_parent(parent_pid: int) -> None:
    """SIGTERM this process when the engine process dies (Linux); stop now if it has."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        raise SystemExit("voxgate worker: the engine process is gone")


def _stop_self() -> None:
    log.error("worker %d: the engine channel is gone; stopping", os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)


def build_worker_app(config: GatewayConfig, channel: Path, worker: int) -> Starlette:
    engine = WorkerEngine(channel, worker=worker, on_lost=_stop_self)
    app = create_app(config, engine)
    state: AppState = app.state.voxgate
    state.fair_share = SharedFairShare(engine.control)
    state.key_counter = SharedKeyCounter(engine.control)
    state.session_tokens = SharedSessionTokens(engine.control, config.session_token_ttl_s)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[Any]:
        async with inner(app) as value:
            refresher = asyncio.get_running_loop().create_task(_refresh(state))
            try:
                yield value
            finally:
                refresher.cancel()

    app.router.lifespan_context = lifespan
    return app


async def _refresh(state: AppState) -> None:
    while True:
        state.metrics.refresh()
        await asyncio.sleep(METRICS_REFRESH_S)
