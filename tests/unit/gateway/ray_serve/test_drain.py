"""The scale-down drain's plumbing (gateway/ray_serve/drain.py), without Ray: Serve's shutdown
runs on its own loop and the app's sockets on another, so the drain crosses loops. Serve's hook
itself is tested on a local cluster (tests/e2e/test_ray_serve.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import pytest

from gateway.ray_serve.drain import drain_grace_s, run_drain
from tests.support.wait import wait_until


@pytest.fixture
def app_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on its own thread, as Serve runs a replica's user code."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def test_the_drain_runs_on_the_apps_loop_and_is_waited_for(
        app_loop: asyncio.AbstractEventLoop) -> None:
    seen: list[object] = []

    async def drain() -> None:
        # a drain that takes a while: the subject is that it is waited for
        await asyncio.sleep(0.05)
        seen.append(asyncio.get_running_loop())

    asyncio.run(run_drain(drain, app_loop, timeout_s=10))
    assert seen == [app_loop]


def test_a_failing_drain_is_logged_and_serves_shutdown_goes_on(
        app_loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture) -> None:
    async def drain() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="voxgate.gateway"):
        asyncio.run(run_drain(drain, app_loop, timeout_s=10))  # does not raise
    assert "drain failed" in caplog.text and "boom" in caplog.text


def test_a_drain_past_its_timeout_is_given_up_and_cancelled(
        app_loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture) -> None:
    cancelled = threading.Event()

    async def drain() -> None:
        try:
            await asyncio.Event().wait()  # never set
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with caplog.at_level(logging.WARNING, logger="voxgate.gateway"):
        asyncio.run(run_drain(drain, app_loop, timeout_s=0.1))
    assert "took over" in caplog.text
    wait_until(cancelled.is_set, timeout=5, message="the drain cancelled on the app's loop")


def test_the_drain_leaves_serve_a_margin_of_its_shutdown_budget() -> None:
    assert drain_grace_s(120.0) == 110.0
    assert drain_grace_s(5.0) == 0.0
