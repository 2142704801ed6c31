"""A request body read against one deadline for all of it (gateway/bodies.py).

The body is a real Starlette Request fed by an ASGI `receive` that trickles
bytes in; the deadline is short so that the test is quick, and the trickle is
faster than it, so a deadline per read would never fire.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from gateway.bodies import BodyTimeoutError, within


def trickling_request(num_chunks: int | None, interval_s: float) -> Request:
    """A POST whose body comes one byte per `interval_s` (None: never ends)."""
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        await asyncio.sleep(interval_s)  # the trickle is the subject: a byte per interval
        sent += 1
        more = num_chunks is None or sent < num_chunks
        return {"type": "http.request", "body": b"x", "more_body": more}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    return Request(scope, receive)


async def read_all(request: Request, timeout_s: float) -> bytes:
    return b"".join([chunk async for chunk in within(request, timeout_s)])


def test_a_body_that_trickles_in_is_cut_off_by_the_total_deadline() -> None:
    async def main() -> bytes:  # a deadline per read never fires: the guard ends the test then
        return await asyncio.wait_for(read_all(trickling_request(None, interval_s=0.02), 0.3), 30.0)

    with pytest.raises(BodyTimeoutError, match="did not arrive within 0.3 s"):
        asyncio.run(main())


def test_a_body_that_ends_within_the_deadline_is_read_whole() -> None:
    assert asyncio.run(read_all(trickling_request(5, interval_s=0.001), timeout_s=30.0)) == b"xxxxx"
