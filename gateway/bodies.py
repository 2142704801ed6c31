"""Request bodies read against one deadline for the whole body, not one per read.

A timeout per read lets a client hold its connection, and whatever the route
took for it, for ever: one byte every few seconds is never a stalled read.
`within` gives the body's chunks while the time since the first read is under
the deadline and raises `BodyTimeoutError` once it is over, however the bytes
trickle in. `POST /v1/audio/speech` (gateway/http/speech.py) and
`POST /v1/voices` (gateway/voices/upload.py) read their bodies through it; the
request head has its own timer (gateway/http/timeouts.py). A leaf, as
errors.py is: the rooms that take bodies import it, it imports none of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request


class BodyTimeoutError(Exception):
    """The body did not arrive whole within its deadline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the body did not arrive within {timeout_s:g} s")
        self.timeout_s = timeout_s


async def within(request: Request, timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks; BodyTimeoutError once `timeout_s` has passed since the first read."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks = request.stream().__aiter__()
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise BodyTimeoutError(timeout_s)
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), left)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise BodyTimeoutError(timeout_s) from None
        yield chunk
