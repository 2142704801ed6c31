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
from engine.types import AudioChunk, RequestId
from gateway.errors import ErrorEvent
from gateway.metrics import Metrics
from gateway.stream.actions import Action, Cancel, Observe, Send, Submit
from gateway.stream.engine_requests import EngineRequests
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
        self._requests = EngineRequests(engine, name=f"speech {session.session_id}",
                                        wait_for_room=self._wait_for_room,
                                        on_audio=self._on_audio, on_error=self._on_engine_error)
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
        self._requests.stop()
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
                self._requests.start(action.request)
            elif isinstance(action, Cancel):
                self._requests.cancel(action.request_id)
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

    async def _wait_for_room(self) -> bool:
        """Until the body has room (the client reads slowly: its audio waits); False once
        the turn is closed."""
        while self._body_bytes > self.max_buffered_bytes and not self.is_closed:
            self._room.clear()
            await self._room.wait()
        return not self.is_closed

    def _on_audio(self, chunk: AudioChunk) -> None:
        self._execute(self.session.receive_audio(chunk, time.monotonic()))

    def _on_engine_error(self, request_id: RequestId, exc: BaseException) -> None:
        self._execute(self.session.receive_engine_error(request_id, exc, time.monotonic()))
