"""A route shell's engine requests: each read by a task of its own, all stopped together.

The sans-I/O session says `Submit` and `Cancel`; the shells that run it (the socket's
endpoint, gateway/http/turn.py) carry them out here, so how a request's audio is read
is written once: backpressure first (`wait_for_room` before each chunk is handed on:
while the client has not read what is queued, no more audio is taken, and the request's
playback clock in the engine stops with it, docs/architecture.md, "The backpressure
story"), a failure ends that request's context only (`on_error`), and `stop` ends every
read when the shell closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from engine.client import EngineClient
from engine.errors import VoxgateError
from engine.types import AudioChunk, RequestId, SynthesisRequest

log = logging.getLogger("voxgate.gateway")


class EngineRequests:
    """The engine requests a shell has open, each with the task that reads it."""

    def __init__(self, engine: EngineClient, *, name: str,
                 wait_for_room: Callable[[], Awaitable[bool]],
                 on_audio: Callable[[AudioChunk], None],
                 on_error: Callable[[RequestId, BaseException], None]) -> None:
        """`wait_for_room` returns once a chunk may be handed on, False when the shell is
        closing; `name` says whose requests they are in the log."""
        self.engine = engine
        self.name = name
        self._wait_for_room = wait_for_room
        self._on_audio, self._on_error = on_audio, on_error
        self._tasks: dict[RequestId, asyncio.Task[None]] = {}

    def start(self, request: SynthesisRequest) -> None:
        self._tasks[request.request_id] = asyncio.create_task(self._read(request))

    def cancel(self, request_id: RequestId) -> None:
        """The engine stops the request (a no-op once it ended) and its reading stops."""
        self.engine.cancel(request_id)
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def stop(self) -> None:
        """Every reading stops (the shell is closing; the session's `disconnect` cancels the
        requests themselves)."""
        for task in self._tasks.values():
            task.cancel()

    async def _read(self, request: SynthesisRequest) -> None:
        try:
            async for chunk in self.engine.submit(request):
                if not await self._wait_for_room():
                    return
                self._on_audio(chunk)
        except asyncio.CancelledError:
            raise
        except VoxgateError as exc:
            self._on_error(request.request_id, exc)
        except Exception as exc:  # ends this context only
            log.exception("%s: request %s failed", self.name, request.request_id)
            self._on_error(request.request_id, exc)
        finally:
            self._tasks.pop(request.request_id, None)
