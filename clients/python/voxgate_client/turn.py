"""One spoken turn (a protocol context): text in, audio out, and its end.

A `Turn` comes from `AsyncVoxgate.speak`. Its text goes out in order (from the
source given to `speak`, or `push`/`flush`); the session's reader routes the
turn's events to it; `async for chunk in turn` yields its audio as
`AudioChunk`s until `context.done`, and raises the turn's error if it failed.
It ends exactly once: DONE (`context.done`), CANCELLED (`cancel`), or FAILED
(an `error` naming it, the connection lost, its text source raising).

Memory is bounded: the events waiting for the consumer are capped by their
audio length (`max_queued_ms`) and count; past that the session's reader stops
reading the socket until the consumer catches up, and the server's own
backpressure slows its engine (docs/architecture.md, "The backpressure
story"). A consumer that never iterates a turn therefore stalls the turns
after it: iterate each turn, hand it to a `Player`, or cancel it.

A `TurnListener` turns the queue off: the reader calls it for every event as
the frame is read, nothing is decoded or queued, and iteration yields nothing.
The load tool runs this way (docs/loadtest.md).
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from voxgate_client.audio import AudioChunk, Decoder
from voxgate_client.errors import (
    ConnectionLost,
    ContextClosed,
    NoAnswer,
    ServerError,
    VoxgateError,
)
from voxgate_client.wire import Audio, Cancelled, Done, Segment, TextSkipped

if TYPE_CHECKING:
    from voxgate_client.session import AsyncVoxgate

TextSource = str | Iterable[str | None] | AsyncIterable[str | None]


class TurnState(enum.Enum):
    OPEN = "open"            # taking text
    FLUSHED = "flushed"      # all text sent; being spoken
    DONE = "done"            # `context.done`: all audio received
    CANCELLED = "cancelled"  # `cancel` sent (answered, or the turn had no text yet)
    FAILED = "failed"        # an error ended it

    @property
    def is_ended(self) -> bool:
        return self in (TurnState.DONE, TurnState.CANCELLED, TurnState.FAILED)


@dataclass(slots=True, frozen=True)
class Heard:
    """What the listener heard of a turn, and what it did not (docs/protocol.md, "Barge-in").

    From the server's `cancelled` after a barge-in; after a turn played to its end,
    every spoken segment (`is_cancelled` False) and the skipped text as unspoken.
    """

    spoken_text: str
    unspoken_text: str
    played_ms: float | None
    audio_ms_sent: float | None
    is_cancelled: bool


class TurnListener:
    """Called by the session's reader, in order, for each event of one turn as it is read
    (`speak(listener=...)`): no queue, no decoding. Override what you need."""

    __slots__ = ()

    def on_segment(self, event: Segment) -> None: ...
    def on_audio(self, event: Audio) -> None: ...
    def on_skipped(self, event: TextSkipped) -> None: ...
    def on_done(self, event: Done) -> None: ...
    def on_cancelled(self, event: Cancelled) -> None: ...

    def on_error(self, error: ServerError) -> None:
        """An `error` event naming this turn (every one, also after the turn ended)."""

    def on_failed(self, error: BaseException) -> None:
        """The turn failed without an error of its own: connection lost, the session
        closed, a fatal session error, or its text source raised."""


class Turn:
    """One context: see the module doc. Made by `AsyncVoxgate.speak`."""

    def __init__(self, session: AsyncVoxgate, context_id: str, decoder: Decoder | None,
                 listener: TurnListener | None, max_queued_ms: float,
                 max_queued: int) -> None:
        self.context_id = context_id
        self.state = TurnState.OPEN
        self.segments: list[Segment] = []
        self.skipped: list[TextSkipped] = []
        self.audio_ms = 0.0  # received (without a listener)
        self.done: Done | None = None
        self.cancelled: Cancelled | None = None
        self.error: BaseException | None = None
        self.listener = listener
        self.generation: int | None = None  # the connection its text went out on
        self._session = session
        self._decoder = decoder
        self._max_queued_ms = max_queued_ms
        self._max_queued = max_queued
        self._queue: deque[Segment | Audio | TextSkipped] = deque()
        self._queued_ms = 0.0
        self._wakeup = asyncio.Event()  # the consumer's
        self._room = asyncio.Event()  # the reader's
        self._room.set()
        self.ended = asyncio.Event()
        self._answer: asyncio.Future[Cancelled] | None = None
        self._is_stopped = False  # no more text goes out (cancel, failure)
        self._num_sent = 0
        self._text: list[str] = []
        self._feeder: asyncio.Task[None] | None = None
        self._segment: Segment | None = None  # the consumer's view
        self._words: deque[Any] = deque()
        self._pending_skipped: list[TextSkipped] = []
        self._is_flushed_out = False
        if listener is not None:
            # The reader's hot path calls the listener itself, one call per frame of audio
            # less (the load tool's 128-256 sessions); `audio_ms` is then the listener's
            # to count.
            self._on_audio = listener.on_audio  # type: ignore[method-assign,assignment]

    def __repr__(self) -> str:
        return f"<Turn {self.context_id} {self.state.value}>"

    @property
    def text(self) -> str:
        """The text sent so far, joined exactly as sent."""
        return "".join(self._text)

    # -- text out ----------------------------------------------------------------------
    async def push(self, text: str, *, flush: bool = False) -> None:
        """Send a text delta (any fragment); `flush=True`: it is the last one."""
        if not isinstance(text, str):
            raise TypeError(f"expected text as str, got {type(text).__name__}")
        self._check_open()
        message: dict[str, Any] = {"type": "text", "context_id": self.context_id, "text": text}
        if flush:
            message["flush"] = True
            self.state = TurnState.FLUSHED
        self._text.append(text)
        await self._send(message, is_text=True)

    async def flush(self) -> None:
        """No more text comes: what is buffered is spoken, then the turn is done."""
        if self._num_sent == 0:
            await self.push("", flush=True)  # the server knows no context before its text
            return
        self._check_open()
        self.state = TurnState.FLUSHED
        await self._send({"type": "flush", "context_id": self.context_id})

    async def _send(self, message: dict[str, Any], *, is_text: bool = False) -> None:
        """Send one of this turn's messages on the connection its first text went out on.

        No lock: websockets writes a frame to the socket when `send` is called, before
        it awaits anything, so frames go out in the order of the calls. Between the
        check that the turn still takes text and the write, only connecting awaits: the
        check is made again after it, and `_num_sent` counts a text before its frame is
        written, so that a `cancel` knows whether the server has the context.
        """
        session = self._session
        try:
            if self.generation != session._generation or session._ws is None:
                if self.generation is not None:  # its connection went: the turn went with it
                    raise self.error or session._lost or ConnectionLost(
                        f"turn {self.context_id}'s connection closed")
                await session._ensure_connected()
                if message["type"] != "cancel" and (self._is_stopped or self.state.is_ended):
                    self._check_open()  # cancelled (or failed) while connecting: raises
                self.generation = session._generation
            if is_text:
                self._num_sent += 1
            await session._send(message)
        except ConnectionLost as exc:  # no connection for this turn: it cannot go on
            self._fail(exc)
            raise

    def _check_open(self) -> None:
        if self.state is TurnState.FAILED and self.error is not None:
            raise self.error
        if self._is_stopped or self.state is not TurnState.OPEN:
            raise ContextClosed("context_closed", f"turn {self.context_id} is "
                                f"{self.state.value}; no more text is taken",
                                context_id=self.context_id)

    def _feed(self, source: TextSource) -> None:
        self._feeder = asyncio.create_task(self._run_feeder(source),
                                           name=f"voxgate-feed-{self.context_id}")

    async def _run_feeder(self, source: TextSource) -> None:
        try:
            if isinstance(source, str):
                await self.push(source, flush=True)
                return
            if isinstance(source, AsyncIterable):
                async for delta in source:
                    if self._is_stopped:
                        break
                    if delta is not None:  # e.g. an OpenAI chunk without content
                        await self.push(delta)
            else:
                for delta in source:
                    if self._is_stopped:
                        break
                    if delta is not None:
                        await self.push(delta)
            if not self._is_stopped and self.state is TurnState.OPEN:
                await self.flush()
        except (ContextClosed, asyncio.CancelledError):
            pass  # the turn ended (or was cancelled): the rest of the text is dropped
        except VoxgateError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001  (the source raised: the turn fails with it)
            self._fail(exc)
            self._session._cancel_quietly(self)
        finally:
            closer = getattr(source, "aclose", None)
            if closer is not None:
                await asyncio.shield(closer())

    async def report(self, played_ms: float) -> None:
        """Tell the server how much of the turn's audio was heard (a `playback` report)."""
        if self._num_sent and self.state is not TurnState.FAILED:
            await self._send({"type": "playback", "context_id": self.context_id,
                              "played_ms": round(played_ms, 1)})

    # -- barge-in ------------------------------------------------------------------------
    async def cancel(self, played_ms: float | None = None, *, timeout: float = 10.0) -> Heard:
        """Stop the turn now and return what was heard, from the server's `cancelled`.

        `played_ms`: how much of its audio the listener heard (a `Player` knows); without
        it the server uses the last `playback` report, else what it sent. No audio of
        the turn is yielded after this returns. Raises the turn's error if it failed,
        `NoAnswer` if no answer came within `timeout` seconds.
        """
        if self.state is TurnState.FAILED and self.error is not None:
            raise self.error
        self._is_stopped = True  # from here no text goes out (see _send)
        self._drop_queue()
        if self._feeder is not None and not self._feeder.done():
            self._feeder.cancel()
        if self._answer is None:
            loop = asyncio.get_running_loop()
            self._answer = loop.create_future()
            if self._num_sent == 0:  # the server has no such context: nothing to stop
                self._answer.set_result(Cancelled(self.context_id, 0.0, played_ms, "", "",
                                                  loop.time()))
                self._end(TurnState.CANCELLED)
            else:
                if self.state.is_ended:
                    self._session._keep_routed(self)  # its answer must find it
                message: dict[str, Any] = {"type": "cancel", "context_id": self.context_id}
                if played_ms is not None:
                    message["played_ms"] = round(played_ms, 1)
                await self._send(message)
        try:
            answer = await asyncio.wait_for(asyncio.shield(self._answer), timeout)
        except asyncio.TimeoutError:
            raise NoAnswer(f"no answer to the cancel of turn {self.context_id} within "
                           f"{timeout:g} s") from None
        return self._heard(answer)

    def _heard(self, answer: Cancelled) -> Heard:
        if answer.spoken_text is None:  # the server no longer remembered it: all was sent
            return self.heard_all(is_cancelled=True)
        return Heard(answer.spoken_text, answer.unspoken_text or "", answer.played_ms,
                     answer.audio_ms_sent, True)

    def heard_all(self, *, is_cancelled: bool = False) -> Heard:
        """What a listener heard who played the turn to its end: every spoken segment."""
        return Heard(" ".join(s.text.strip() for s in self.segments if s.text.strip()),
                     " ".join(s.text.strip() for s in self.skipped if s.text.strip()),
                     self.audio_ms, self.audio_ms, is_cancelled)

    # -- events in (called by the session's reader) ----------------------------------------
    def _on_segment(self, event: Segment) -> None:
        self.segments.append(event)
        if self.listener is not None:
            self.listener.on_segment(event)
        elif not self._is_stopped:
            self._put(event, 0.0)

    def _on_audio(self, event: Audio) -> bool:
        """Take a frame of audio; True when the queue is full and the reader must wait.
        (A listener's turn has its listener's `on_audio` here instead: see __init__.)"""
        self.audio_ms += event.duration_ms
        if not self._is_stopped and not self.state.is_ended:
            self._put(event, event.duration_ms)
        return not self._room.is_set()

    def _on_skipped(self, event: TextSkipped) -> None:
        self.skipped.append(event)
        if self.listener is not None:
            self.listener.on_skipped(event)
        elif not self._is_stopped:
            self._put(event, 0.0)

    def _on_done(self, event: Done) -> None:
        self.done = event
        if self.listener is not None:
            self.listener.on_done(event)
        self._end(TurnState.DONE)

    def _on_cancelled(self, event: Cancelled) -> None:
        self.cancelled = event
        if self.listener is not None:
            self.listener.on_cancelled(event)
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(event)
        self._end(TurnState.CANCELLED)

    def _on_error(self, error: ServerError) -> None:
        if self.listener is not None:
            self.listener.on_error(error)
        if error.code != "context_closed" or not self.state.is_ended:
            self._fail(error, notify=False)

    def _fail(self, error: BaseException, *, notify: bool = True) -> None:
        """End the turn with `error` (a no-op once it ended); `notify`: tell the listener."""
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(error)
            self._answer.exception()  # retrieved here: a cancel() may never await it
        if self.state.is_ended:
            return
        self.error = error
        self._is_stopped = True
        if notify and self.listener is not None:
            self.listener.on_failed(error)
        self._end(TurnState.FAILED)

    def _end(self, state: TurnState) -> None:
        if self.state.is_ended:
            return
        self.state = state
        self.ended.set()
        self._wakeup.set()
        self._session._on_turn_end(self)

    # -- the queue -----------------------------------------------------------------------
    def _put(self, event: Segment | Audio | TextSkipped, ms: float) -> None:
        self._queue.append(event)
        self._queued_ms += ms
        if self._queued_ms > self._max_queued_ms or len(self._queue) > self._max_queued:
            self._room.clear()
        self._wakeup.set()

    async def _wait_room(self) -> None:
        await self._room.wait()

    def _drop_queue(self) -> None:
        self._queue.clear()
        self._queued_ms = 0.0
        self._room.set()
        self._wakeup.set()

    def __aiter__(self) -> Turn:
        return self

    async def __anext__(self) -> AudioChunk:
        queue = self._queue
        while True:
            if queue:
                event = queue.popleft()
                if isinstance(event, Audio):
                    self._queued_ms -= event.duration_ms
                if not self._room.is_set() and self._queued_ms <= self._max_queued_ms / 2:
                    self._room.set()  # hysteresis: the reader resumes with room to spare
                if isinstance(event, Audio):
                    return self._chunk(event)
                if isinstance(event, Segment):
                    self._segment = event
                    self._words = deque(event.words or ())
                else:
                    self._pending_skipped.append(event)
                continue
            if self.state is TurnState.FAILED and self.error is not None:
                raise self.error
            if self._is_stopped or self.state.is_ended:
                if self.state is TurnState.DONE and not self._is_flushed_out:
                    self._is_flushed_out = True
                    assert self.done is not None
                    tail = self._decoder.flush(self.context_id, self.done.received_at) \
                        if self._decoder is not None else None
                    if tail is not None:
                        return self._attach(tail)
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()

    def _chunk(self, event: Audio) -> AudioChunk:
        if self._decoder is None:  # a listener turn is not iterated; be safe anyway
            raise RuntimeError(f"turn {self.context_id} has a listener: it yields no audio")
        return self._attach(self._decoder.decode(event))

    def _attach(self, chunk: AudioChunk) -> AudioChunk:
        chunk.segment = self._segment
        end_ms = chunk.pts_ms + chunk.duration_ms
        words = self._words
        while words and words[0].start_ms < end_ms:
            chunk.words.append(words.popleft())
        if self._pending_skipped:
            chunk.skipped, self._pending_skipped = self._pending_skipped, []
        return chunk
