"""Waiting for a condition in tests, instead of sleeping a fixed time.

A fixed sleep is either too short on a slow box (the test fails) or makes a
negative check pass vacuously (nothing happened yet). `wait_until` polls a
predicate until it holds and fails with a message when it never does;
`still_false_after` is the one honest form of a negative check: the thing
did not happen while something else that must come first did.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.02,
               message: str = "") -> T:
    """The predicate's first truthy value; AssertionError after `timeout` seconds without one."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true after {timeout:g} s: {message or predicate!r}")
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], T | Awaitable[T]], *, timeout: float = 10.0,
                           interval: float = 0.02, message: str = "") -> T:
    """`wait_until` for asyncio tests: the event loop runs while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true after {timeout:g} s: {message or predicate!r}")
        await asyncio.sleep(interval)
