"""The `/v1/stream` endpoint: a thin I/O loop around the sans-I/O Session.

Three kinds of task per socket, all on the event loop: the reader (client
frames -> session), one consumer per engine request (chunks -> session), and
the writer (a byte-bounded send queue -> socket). A timer wakes the session
for time-based text release and realtime pacing. Encodes the session defers
(`Encode`) go to the app's worker thread (gateway/stream/encoding.py) and come
back to the session when done. Every action the session
returns is carried out in `_execute`, the only place that touches the socket
or the engine. Before any of it, `stream_endpoint` admits the socket through
the one door every socket shares (gateway/access/admission.py). The loop runs
any `SocketSession`: the native `Session`, or a vendor adapter's
(gateway/compat), which shapes its own frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.client import EngineClient
from engine.types import AudioChunk, RequestId
from gateway.access.admission import Refused, admit
from gateway.access.keys import presented_key
from gateway.errors import (
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL_ERROR,
    CLOSE_POLICY_VIOLATION,
    CLOSE_SLOW_CONSUMER,
    ProtocolError,
    error_message,
)
from gateway.stream.actions import (
    Action,
    Cancel,
    Close,
    Encode,
    Observe,
    Send,
    SendFrame,
    Submit,
)
from gateway.stream.encoding import MAX_ENCODING_MS, EncodeJob
from gateway.stream.engine_requests import EngineRequests
from gateway.stream.events import encode_json
from gateway.stream.options import Limits, SessionOptions, options_from_query
from gateway.stream.session import Session

if TYPE_CHECKING:  # types only: the app state holds the config, which reads stream's Limits
    from gateway.state import AppState

log = logging.getLogger("voxgate.gateway")


class SocketSession(Protocol):
    """The sans-I/O session a `Connection` runs: the native `Session`, or a vendor adapter's."""

    @property
    def session_id(self) -> str: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def last_activity(self) -> float:
        """When the client's last frame came (its idle clock)."""
        ...

    @property
    def num_open_contexts(self) -> int: ...

    def start(self, now: float) -> list[Action]: ...

    def receive_frame(self, raw: str | bytes, now: float) -> list[Action]: ...

    def receive_audio(self, chunk: AudioChunk, now: float) -> list[Action]: ...

    def receive_engine_error(self, request_id: RequestId, exc: BaseException,
                             now: float) -> list[Action]: ...

    def receive_encoded(self, context_id: str, job: EncodeJob, now: float) -> list[Action]: ...

    def tick(self, now: float) -> list[Action]: ...

    def next_wakeup(self) -> float | None: ...

    def is_idle(self, now: float) -> bool: ...

    def disconnect(self) -> list[Action]: ...

    def idle_close(self, idle_s: float) -> list[Action]:
        """How this wire closes a socket idle for `idle_s`."""
        ...

    def encode(self, action: Send) -> str | bytes:
        """The frame of a Send, the session's own or one the loop made (slow consumer)."""
        ...


class Connection:
    """One accepted socket and its session."""

    def __init__(self, websocket: WebSocket, session: SocketSession, engine: EngineClient,
                 app_state: AppState) -> None:
        self.ws = websocket
        self.session = session
        self.engine = engine
        self.state = app_state
        self.metrics = app_state.metrics
        self._requests = EngineRequests(engine, name=f"session {session.session_id}",
                                        wait_for_room=self._wait_for_room,
                                        on_audio=self._on_audio, on_error=self._on_engine_error)
        self._outbox: deque[str | bytes | Close] = deque()
        self._outbox_bytes = 0
        self._room = asyncio.Event()       # set while the outbox is under its soft limit
        self._room.set()
        self._encoding_ms = 0.0            # PCM handed to the encode worker, not yet back
        self._last_progress = time.monotonic()
        self._wake_writer = asyncio.Event()
        self._wake_timer = asyncio.Event()
        self._timer_at: float | None = None  # when the timer next ticks (None: only when woken)
        self._closing: Close | None = None
        self._done = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None

    async def run(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name="writer")
        timer = asyncio.create_task(self._timer_loop(), name="timer")
        reader = asyncio.create_task(self._read_loop(), name="reader")
        try:
            self._execute(self.session.start(time.monotonic()))
            # The socket is done when the client leaves (reader) or the server
            # closed it, cleanly or by force (writer), or a task failed.
            await asyncio.wait({reader, timer, self._writer}, return_when=asyncio.FIRST_COMPLETED)
            self._check_failed(reader, timer)
            if not self._writer.done() and self._closing is not None:
                await self._drain_writer(self._writer)
        finally:
            for task in (timer, reader):
                task.cancel()
            self._requests.stop()
            self._execute(self.session.disconnect())
            self._writer.cancel()

    async def _drain_writer(self, writer: asyncio.Task[None]) -> None:
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, OSError,
                                 RuntimeError):
            await asyncio.wait_for(asyncio.shield(writer), timeout=2.0)

    def _check_failed(self, *tasks: asyncio.Task[None]) -> None:
        """A reader or timer that raised is a server bug: log it, close with 1011.

        Without this its exception would never be read, and the client would see
        the socket drop (1006) with no error event and nothing in the log.
        """
        for task in tasks:
            if not task.done() or task.cancelled() or task.exception() is None:
                continue
            log.error("session %s: %s task failed; closing with 1011", self.session.session_id,
                      task.get_name(), exc_info=task.exception())
            self._send(Send(error_message(ProtocolError(
                "internal", "internal error; the server logged it", fatal=True))))
            self._close(Close(CLOSE_INTERNAL_ERROR, "internal error"))
            return

    @property
    def num_open_contexts(self) -> int:
        return self.session.num_open_contexts

    def close_going_away(self) -> None:
        """Server shutdown: close with 1001 after what is queued."""
        self._close(Close(CLOSE_GOING_AWAY, "server is shutting down"))

    # -- reading ---------------------------------------------------------------
    async def _read_loop(self) -> None:
        idle = self.session.limits.idle_timeout_s
        while not self._done.is_set():
            # The idle clock is the client's: its last frame (Session.is_idle),
            # not whether it holds open contexts.
            wait = self.session.last_activity + idle - time.monotonic()
            if wait <= 0:
                wait = min(idle, 1.0)  # past it, but a context is still speaking: look again soon
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout=wait)
            except asyncio.TimeoutError:
                if not self.session.is_idle(time.monotonic()):
                    continue
                self._execute(self.session.idle_close(idle))
                return
            except (WebSocketDisconnect, RuntimeError):
                return
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            self._execute(self.session.receive_frame(raw, time.monotonic()))
            if self._closing is not None:
                return

    # -- engine requests ---------------------------------------------------------
    def _on_audio(self, chunk: AudioChunk) -> None:
        self._execute(self.session.receive_audio(chunk, time.monotonic()))

    def _on_engine_error(self, request_id: RequestId, exc: BaseException) -> None:
        self._execute(self.session.receive_engine_error(request_id, exc, time.monotonic()))

    @property
    def _soft_limit(self) -> int:
        return self.session.limits.max_send_buffer_bytes // 4

    async def _wait_for_room(self) -> bool:
        """Wait until the outbox drains below its soft limit; False once the socket is closing.

        Backpressure, the guard against a client that stops reading (docs/architecture.md,
        "The backpressure story").
        """
        timeout = self.session.limits.slow_consumer_timeout_s
        while self._closing is None and (self._outbox_bytes > self._soft_limit
                                         or self._encoding_ms > MAX_ENCODING_MS):
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), timeout)
            except asyncio.TimeoutError:
                if time.monotonic() - self._last_progress >= timeout:
                    self._slow_consumer(f"nothing read for {timeout:g} s")
        return self._closing is None

    # -- acting ------------------------------------------------------------------
    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._send(action)
            elif isinstance(action, SendFrame):
                self._send_frame(action.frame)
            elif isinstance(action, Submit):
                self._requests.start(action.request)
            elif isinstance(action, Cancel):
                self._requests.cancel(action.request_id)
            elif isinstance(action, Encode):
                self._encode(action)
            elif isinstance(action, Observe):
                self.metrics.observe(action.name, action.value)
            elif isinstance(action, Close):
                self._close(action)
        # The timer is woken only for a wakeup sooner than the one it waits for: not once per
        # chunk and message (a wakeup that moved later costs one early tick, which looks again).
        wakeup = self.session.next_wakeup()
        if wakeup is not None and (self._timer_at is None or wakeup < self._timer_at):
            self._wake_timer.set()

    def _encode(self, action: Encode) -> None:
        self._encoding_ms += action.job.pcm_ms

        def encoded(job: EncodeJob) -> None:  # on the event loop, once the worker is done
            self._encoding_ms -= job.pcm_ms
            self._room.set()  # a consumer waiting on the encodes looks again
            self._execute(self.session.receive_encoded(action.context_id, job, time.monotonic()))

        self.state.encoding.submit(action.job, encoded)

    def _send(self, action: Send) -> None:
        if self._closing is None:
            self._send_frame(self.session.encode(action))

    def _send_frame(self, frame: str | bytes) -> None:
        if self._closing is not None:
            return
        self._outbox.append(frame)
        self._outbox_bytes += len(frame)
        self._wake_writer.set()
        if self._outbox_bytes > self.session.limits.max_send_buffer_bytes:
            self._slow_consumer(f"over {self.session.limits.max_send_buffer_bytes} bytes queued")

    def _slow_consumer(self, why: str) -> None:
        """A client that stops reading may not grow server memory (docs/architecture.md,
        "The backpressure story")."""
        if self._closing is not None:
            return
        # The writer is stuck on a full socket: drop what is queued and end the
        # connection by force (the close frame may never get through).
        self._outbox.clear()
        self._outbox_bytes = 0
        slow = error_message(ProtocolError("slow_consumer", "the client is not reading its audio "
                                           f"({why}); closing", fatal=True))
        self._outbox.append(self.session.encode(Send(slow)))
        self.metrics.observe("error:slow_consumer", 1)
        self._close(Close(CLOSE_SLOW_CONSUMER, "slow consumer"))
        log.warning("session %s: slow consumer (%s), closing", self.session.session_id, why)
        if self._writer is not None:
            self._writer.cancel()
        self._room.set()

    def _close(self, action: Close) -> None:
        if self._closing is None:
            self._closing = action
            self._outbox.append(action)
            self._wake_writer.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                while not self._outbox:
                    self._wake_writer.clear()
                    await self._wake_writer.wait()
                frame = self._outbox.popleft()
                if isinstance(frame, Close):
                    await self.ws.close(frame.code, frame.reason)
                    return
                if isinstance(frame, bytes):
                    await self.ws.send_bytes(frame)
                else:
                    await self.ws.send_text(frame)
                self._outbox_bytes -= len(frame)
                self._last_progress = time.monotonic()
                if self._outbox_bytes <= self._soft_limit:
                    self._room.set()
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        finally:
            self._done.set()

    async def _timer_loop(self) -> None:
        while True:
            wakeup = self.session.next_wakeup()
            self._timer_at = wakeup
            self._wake_timer.clear()
            delay = None if wakeup is None else max(0.0, wakeup - time.monotonic())
            try:
                await asyncio.wait_for(self._wake_timer.wait(), timeout=delay)
                continue
            except asyncio.TimeoutError:
                pass
            self._execute(self.session.tick(time.monotonic()))


async def refuse(websocket: WebSocket, frame: str, close_code: int, reason: str, *,
                 subprotocol: str | None = None) -> None:
    """Answer a socket that is not served: accept, one frame saying why, close.

    `subprotocol`: the one the client offered that the server takes (a browser that offered
    some fails the handshake, and so never reads the frame, when none is answered)."""
    await websocket.accept(subprotocol)
    await websocket.send_text(frame)
    await websocket.close(close_code, reason[:120])


#: where the native socket takes its key, for the `unauthorized` answer
KEY_HINT = "Authorization: Bearer <key>, or ?api_key= (or a ?token=) for browsers"


async def stream_endpoint(websocket: WebSocket) -> None:
    state: AppState = websocket.app.state.voxgate
    config = state.config
    engine: EngineClient = state.engine
    query = dict(websocket.query_params)
    try:
        admission = admit(state, websocket, presented_key(websocket.headers, query),
                          protocol="native", key_hint=KEY_HINT)
    except Refused as refusal:
        await refuse(websocket, encode_json(error_message(refusal).to_wire()), refusal.close_code,
                     refusal.code)
        return
    with admission:
        voices = state.catalog.view(admission.principal)  # its tenant's voices, and the shared ones
        try:
            options = options_from_query(query, SessionOptions(voice=config.voice), voices.listed)
        except ProtocolError as exc:
            exc.fatal = True
            await refuse(websocket, encode_json(error_message(exc).to_wire()),
                         CLOSE_POLICY_VIOLATION, exc.code)
            return
        # Made before the first await, so the voice just validated is held at once.
        session = Session(uuid.uuid4().hex[:16], catalog=voices, sample_rate=engine.sample_rate,
                          options=options, limits=config.limits, admit=admission.admit_context,
                          release=admission.release_context, languages=state.languages,
                          encoders=state.encoders, defer_encode=True)
        await serve_session(websocket, session, Connection(websocket, session, engine, state),
                            state)


async def serve_session(websocket: WebSocket, session: SocketSession, connection: Connection,
                        state: AppState, *, subprotocol: str | None = None) -> None:
    """Accept the socket and run `connection` (native or a vendor adapter's) until it ends.

    The connection is counted in the app's open connections while it runs (the
    sessions and contexts gauges read them at scrape time); the session lets go
    of its voice at the end even if `run` never started (a no-op after `run`).
    """
    try:
        await websocket.accept(subprotocol)
        state.connections.add(connection)
        try:
            await connection.run()
        finally:
            state.connections.discard(connection)
    finally:
        session.disconnect()
