"""One speech request as one turn of a native session: the I/O shell the HTTP route runs.

The request's text is one context of the sans-I/O `Session` the sockets drive
(gateway/stream/session.py), flushed at once: the same segmenter, routing by
language, admission, look-ahead window, due times and cancel, and the audio
encoded once in the response's format by the context's playout. `SpeechTurn`
carries out the actions the session returns, as the socket's `Connection`
does (gateway/stream/endpoint.py): engine requests started (one consumer task
each, feeding chunks back) and cancelled, and each `audio` message's bytes
queued for the response body, which `body` yields. A consumer stops taking
chunks while the body holds more than `max_buffered_bytes` the client has not
read, so the engine stops making audio nobody reads (docs/architecture.md,
"The backpressure story"). `close` ends it all at once and is synchronous: it
runs while the response task is being cancelled (the client went away),
where an await could be interrupted before the end.

The route keeps the metric it always kept, text skipped by language, and says
what was skipped once per request in the log, without the text.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from engine.client import EngineClient
from engine.errors import VoxgateError
from engine.types import RequestId, SynthesisRequest
from gateway.errors import ErrorEvent
from gateway.metrics import Metrics
from gateway.stream.actions import Action, Cancel, Observe, Send, Submit
from gateway.stream.events import AudioEvent, ContextDone, TextSkipped
from gateway.stream.messages import TextMessage
from gateway.stream.session import Session
from gateway.stream.skipped import SkippedText

log = logging.getLogger("voxgate.gateway")

CONTEXT_ID = "speech"


class SpeechTurn:
    """The request's one context, from `begin` to `close` (see the module doc)."""

    def __init__(self, session: Session, engine: EngineClient, metrics: Metrics, *,
                 max_buffered_bytes: int) -> None:
        self.session = session
        self.engine = engine
        self.metrics = metrics
        self.max_buffered_bytes = max_buffered_bytes
        self.refusal: ErrorEvent | None = None  # an error before any audio: the answer is it
        self.num_spoken: int | None = None       # segments spoken, once done
        self.skipped = SkippedText()
        self.is_closed = False
        self._has_audio = False
        self._consumers: dict[RequestId, asyncio.Task[None]] = {}
        self._body: deque[bytes] = deque()
        self._body_bytes = 0
        self._is_done = False
        self._wake = asyncio.Event()  # set when the body has bytes or is done
        self._room = asyncio.Event()  # set while the body is under its limit
        self._room.set()

    @property
    def key(self) -> str:
        return self.session.session_id

    def begin(self, text: str) -> None:
        """The whole input, flushed: its first segments go to the engine now (admission too)."""
        now = time.monotonic()
        self.session.start(now)
        self._execute(self.session.receive_message(TextMessage(CONTEXT_ID, text, flush=True), now))

    async def body(self) -> AsyncIterator[bytes]:
        """The audio bytes, in order, as they are made; ends when the turn does."""
        while True:
            while self._body:
                data = self._body.popleft()
                self._body_bytes -= len(data)
                if self._body_bytes <= self.max_buffered_bytes:
                    self._room.set()
                yield data
            if self._is_done or self.is_closed:
                return
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        """Cancel every engine request of the turn, let go of capacity and voices (idempotent)."""
        if self.is_closed:
            return
        self.is_closed = True
        for task in self._consumers.values():
            task.cancel()
        self._execute(self.session.disconnect())
        self._wake.set()
        self._room.set()
        if self.skipped:
            log.info("speech %s: skipped %s: no voice for it", self.key, self.skipped.summary())

    # -- the session's actions ---------------------------------------------------
    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._on_event(action)
            elif isinstance(action, Submit):
                self._start(action.request)
            elif isinstance(action, Cancel):
                self.engine.cancel(action.request_id)
                task = self._consumers.pop(action.request_id, None)
                if task is not None:
                    task.cancel()
            elif isinstance(action, Observe) and action.name.startswith("skipped:"):
                # the route's one metric; TTFA and audio sent are the sockets'
                self.metrics.observe(action.name, action.value)

    def _on_event(self, action: Send) -> None:
        event = action.message
        if isinstance(event, AudioEvent):
            self._has_audio = True
            data = event.data
            if data:
                self._body.append(data)
                self._body_bytes += len(data)
                self._wake.set()
        elif isinstance(event, TextSkipped):
            self.skipped.add(event)
        elif isinstance(event, ContextDone):
            self.num_spoken = event.num_segments
            self._is_done = True
            self._wake.set()
        elif isinstance(event, ErrorEvent):
            if self._has_audio:  # mid-body: the body ends short, as a closed socket would
                log.warning("speech %s: ended early: %s", self.key, event.message)
            elif self.refusal is None:
                self.refusal = event
            self._is_done = True
            self._wake.set()

    def _start(self, request: SynthesisRequest) -> None:
        self._consumers[request.request_id] = asyncio.create_task(self._consume(request))

    async def _consume(self, request: SynthesisRequest) -> None:
        try:
            async for chunk in self.engine.submit(request):
                while self._body_bytes > self.max_buffered_bytes and not self.is_closed:
                    self._room.clear()  # the client reads slowly: stop taking its audio
                    await self._room.wait()
                if self.is_closed:
                    return
                self._execute(self.session.receive_audio(chunk, time.monotonic()))
        except asyncio.CancelledError:
            raise
        except VoxgateError as exc:
            self._execute(self.session.receive_engine_error(request.request_id, exc,
                                                            time.monotonic()))
        except Exception as exc:  # ends this turn only
            log.exception("speech %s: request %s failed", self.key, request.request_id)
            self._execute(self.session.receive_engine_error(request.request_id, exc,
                                                            time.monotonic()))
        finally:
            self._consumers.pop(request.request_id, None)
