"""Scale-down drain: a gateway replica that Serve stops finishes its turns, then closes with 1001.

Serve stops a replica (scale-down, redeploy, `serve delete`, `serve shutdown`)
by calling its actor's `perform_graceful_shutdown`, which waits until the
replica has no ongoing request left and only then runs the deployment's
`__del__`. A WebSocket is one ongoing request for its whole life, so the
gateway would hear of the stop only once every socket was gone: Serve waits
out `graceful_shutdown_timeout_s` and then kills the replica, cutting live
turns. Serve has no public hook for "you are being stopped" (2.58), so
`install` wraps that method of Serve's replica class in this process (one
replica per process) to run the gateway's own drain first: the same
`gateway.app.drain` as `voxgate serve` on SIGTERM. New sockets are refused,
open contexts finish, then every socket is closed with 1001; Serve's wait
that follows finds no ongoing request. The proxy stops routing to a stopping
replica by itself. `tests/e2e/test_ray_serve.py` checks all of it on a local
cluster; an upgrade of Ray must rerun it (docs/scaling.md, like routing.py's
hooks).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("voxgate.gateway")

#: seconds of Serve's shutdown budget (`graceful_shutdown_timeout_s`) kept back from the drain
#: for what follows it: Serve's own wait for requests (a 2 s loop) and the app's lifespan shutdown
SERVE_SHUTDOWN_MARGIN_S = 10.0

_WRAPPED = "__voxgate_drain__"


def drain_grace_s(shutdown_grace_s: float) -> float:
    """How long open contexts may finish, out of Serve's `graceful_shutdown_timeout_s`."""
    return max(0.0, shutdown_grace_s - SERVE_SHUTDOWN_MARGIN_S)


def install(drain: Callable[[], Awaitable[None]], loop: asyncio.AbstractEventLoop,
            timeout_s: float) -> bool:
    """Run `drain()` on `loop` when Serve starts stopping this process's replica.

    `loop` is the replica's user-code loop (the app's sockets live there; Serve
    calls the shutdown on its own loop). Waits at most `timeout_s` for the
    drain; Serve's shutdown goes on after it whatever happens. Returns False,
    leaving Serve's behaviour as it is, when Serve's replica class lacks the
    method (another Ray version).
    """
    try:
        from ray.serve._private.replica import Replica
    except ImportError:
        log.warning("scale-down will not drain: Ray Serve's replica class was not found")
        return False
    original = getattr(Replica, "perform_graceful_shutdown", None)
    if original is None:
        log.warning("scale-down will not drain: Ray Serve's replica has no "
                    "perform_graceful_shutdown")
        return False
    original = getattr(original, _WRAPPED, original)  # installed twice: wrap Serve's method once

    @functools.wraps(original)
    async def perform_graceful_shutdown(self: Any) -> Any:
        await run_drain(drain, loop, timeout_s)
        return await original(self)

    setattr(perform_graceful_shutdown, _WRAPPED, original)
    setattr(Replica, "perform_graceful_shutdown", perform_graceful_shutdown)  # noqa: B010
    return True


async def run_drain(drain: Callable[[], Awaitable[None]], loop: asyncio.AbstractEventLoop,
                    timeout_s: float) -> None:
    """`drain()` on `loop` (maybe another thread's), waited for at most `timeout_s`; never
    raises."""
    async def on_loop() -> None:
        await drain()

    try:
        future = asyncio.run_coroutine_threadsafe(on_loop(), loop)
        await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except asyncio.TimeoutError:
        log.warning("the gateway's drain took over %.0f s; Serve stops the replica as it is",
                    timeout_s)
    except Exception:  # a failed drain must not stop Serve from stopping the replica
        log.exception("the gateway's drain failed; Serve stops the replica as it is")
