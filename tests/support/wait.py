"""Waiting for a condition in tests, instead of sleeping a fixed time.

A fixed sleep is either too short on a slow box (the test fails) or makes a
negative check pass vacuously (nothing happened yet). `wait_until` polls a
predicate until it holds and fails with a message when it never does. A
negative check waits instead for something that must come first (an answer to
a later message, a task that would have done the thing finishing) and then
checks that the thing did not happen.

`message` is a string or a function that makes one when the wait fails, so
it can say what the value was then ("voxgate_sessions stayed at 1").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
Message = str | Callable[[], str]


def _failure(timeout: float, message: Message, predicate: object) -> AssertionError:
    text = message() if callable(message) else message
    return AssertionError(f"not true after {timeout:g} s: {text or repr(predicate)}")


def wait_until(predicate: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.02,
               message: Message = "") -> T:
    """The predicate's first truthy value; AssertionError after `timeout` seconds without one."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(timeout, message, predicate)
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], T | Awaitable[T]], *, timeout: float = 10.0,
                           interval: float = 0.02, message: Message = "") -> T:
    """`wait_until` for asyncio tests: the event loop runs while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise _failure(timeout, message, predicate)
        await asyncio.sleep(interval)
