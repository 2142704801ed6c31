"""`AsyncVoxgate`: one WebSocket session to a voxgate server, and the turns on it.

    async with AsyncVoxgate("ws://127.0.0.1:8000/v1/stream", api_key=KEY) as vg:
        turn = vg.speak(llm_deltas)            # a str, an iterable or an async iterable
        async for chunk in turn:               # AudioChunk: pcm, pts_ms, words, skipped
            play(chunk.pcm)
        heard = await turn.cancel(played_ms=1840)   # barge-in: what was heard

One reader task per socket reads every frame, decodes it once (wire.py) and
routes it to its turn by `context_id`: several turns share one socket, and
their audio comes one turn after the other, in the order they were created
(docs/protocol.md, "Contexts"). Options that the URL can carry go in its
query; the rest (`instructions`, `voice_for`) in a `session.update` before
the session is handed out.

Reconnection is opt-in (`reconnect=True` or a `Reconnect`). When the socket
drops, the turns in flight fail with `ConnectionLost` (their text may have
been half spoken, so they are not replayed), and the session reconnects for
the turns after them: at once in the background after an unexpected close,
or at the next turn after an idle close (4000); with capped, jittered
exponential backoff (backoff.py). Without it the session stays closed and
every later turn raises `ConnectionLost`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from voxgate_client.audio import AUDIO_MODES, Decoder, require
from voxgate_client.backoff import Reconnect, retry_advice_s
from voxgate_client.errors import (
    Busy,
    ConnectionLost,
    NoAnswer,
    ServerError,
    Unauthorized,
    VoxgateError,
    server_error,
)
from voxgate_client.turn import TextSource, Turn, TurnListener
from voxgate_client.wire import (
    HAS_MSGPACK,
    Audio,
    BadFrame,
    Cancelled,
    Done,
    Error,
    Ready,
    Segment,
    TextSkipped,
    Updated,
    decode,
    encode,
)

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; only read by type checkers

log = logging.getLogger("voxgate.client")

#: options the handshake's query string carries (the others go in a `session.update`)
QUERY_OPTIONS = ("voice", "language", "codec", "sample_rate", "bitrate", "frame_ms",
                 "frames_per_message", "encoding", "audio_as", "pacing", "speed",
                 "max_buffer_delay_ms")
CLOSE_IDLE_TIMEOUT = 4000
MAX_RECENT_TURNS = 8  # ended turns still routed: late answers (a cancel after done, errors)


def stream_url(url: str, query: dict[str, Any]) -> str:
    """ws(s)://host:port/v1/stream?... from an http(s) or ws(s) URL, with `query` added."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"expected a ws(s):// or http(s):// URL, got {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/v1/stream"
    merged = dict(parse_qsl(parts.query))
    merged.update({k: str(v) for k, v in query.items()})
    return urlunsplit((scheme, parts.netloc, path, urlencode(merged), ""))


class AsyncVoxgate:
    """A session on voxgate's `/v1/stream` socket (see the module doc).

    `audio`: "int16" or "float32" (decoded PCM as numpy arrays; Opus needs PyAV) or "raw"
    (as sent: Opus packets, PCM16 or mu-law bytes). `encoding`: "auto" (msgpack when
    installed, else JSON with base64 audio), "msgpack" or "json". `**options`: the
    session's options (docs/protocol.md, "Options"): voice, codec, sample_rate, speed,
    pacing, instructions, voice_for... `max_queued_ms`: how much audio a turn holds
    for its consumer before the socket waits. `on_error`: called with each error event
    that names no turn (a `ServerError`), which is otherwise logged.
    """

    def __init__(self, url: str, *, api_key: str | None = None, token: str | None = None,
                 audio: str = "int16", encoding: str = "auto",
                 reconnect: bool | Reconnect = False, open_timeout: float = 10.0,
                 max_queued_ms: float = 30_000.0, max_queued: int = 4096,
                 on_error: Callable[[ServerError], None] | None = None,
                 max_size: int | None = 2**24, **options: Any) -> None:
        if audio not in AUDIO_MODES:
            raise ValueError(f"expected audio one of {', '.join(AUDIO_MODES)}, got {audio!r}")
        if encoding not in ("auto", "msgpack", "json"):
            raise ValueError(f"expected encoding 'auto', 'msgpack' or 'json', got {encoding!r}")
        if encoding == "msgpack" and not HAS_MSGPACK:
            raise ValueError("encoding='msgpack' needs msgpack: "
                                             "pip install 'voxgate-client[msgpack]'")
        if max_queued_ms <= 0 or max_queued < 1:
            raise ValueError(f"expected max_queued_ms > 0 and max_queued >= 1, got "
                             f"{max_queued_ms}, {max_queued}")
        Decoder(audio, 48000)  # fails now, not at the first turn, if an extra is missing
        if audio != "raw" and options.get("codec", "opus") == "opus":
            require("av", "av", f"audio={audio!r} with codec 'opus'")
        self.url = url
        self.audio = audio
        self._api_key = api_key
        self._token = token
        self._binary = encoding == "msgpack" or (encoding == "auto" and HAS_MSGPACK)
        wanted = dict(options)
        wanted["encoding"] = "msgpack" if self._binary else "json"
        if not HAS_MSGPACK:
            wanted["audio_as"] = "base64"  # audio is msgpack otherwise
        self._wanted = wanted
        self._reconnect = Reconnect() if reconnect is True else reconnect or None
        self._open_timeout = open_timeout
        self._max_queued_ms = max_queued_ms
        self._max_queued = max_queued
        self._max_size = max_size
        self.on_error = on_error
        self.session_id: str | None = None
        self.options: dict[str, Any] = {}  # the effective options (session.ready / updated)
        self.limits: dict[str, Any] = {}
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._generation = 0
        self._connecting: asyncio.Task[None] | None = None
        self._lost: ConnectionLost | None = None
        self._is_closing = False
        self._turns: dict[str, Turn] = {}  # open
        self._recent: OrderedDict[str, Turn] = OrderedDict()  # ended, still routed
        self._num_turns = 0
        self._update: asyncio.Future[dict[str, Any]] | None = None
        self._busy_streak = 0
        self._rng = random.Random()

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def is_connected(self) -> bool:
        return self._ws is not None

    async def connect(self) -> None:
        """Open the socket (once; reconnects happen by themselves when enabled).

        Raises `Unauthorized`, `Busy` (the server is at its socket limit),
        `ServerError` (bad options), or `ConnectionLost` (refused, timed out).
        """
        if self._ws is not None:
            return
        await self._open()

    async def close(self) -> None:
        """Close the socket; turns still open fail with `ConnectionLost`."""
        self._is_closing = True
        if self._connecting is not None:
            self._connecting.cancel()
        ws, reader = self._ws, self._reader
        if ws is not None:
            await ws.close()
        if reader is not None:
            await asyncio.gather(reader, return_exceptions=True)
        self._fail_open(ConnectionLost("the session was closed"))

    async def _open(self) -> None:
        query = {k: v for k, v in self._wanted.items() if k in QUERY_OPTIONS and v is not None}
        if self._token is not None:
            query["token"] = self._token
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
        url = stream_url(self.url, query)
        try:
            ws = await asyncio.wait_for(connect(
                url, additional_headers=headers, compression=None, max_size=self._max_size,
                open_timeout=None, close_timeout=2.0), self._open_timeout)
        except asyncio.TimeoutError:
            raise ConnectionLost(f"no connection to {self.url} within "
                                 f"{self._open_timeout:g} s") from None
        except (OSError, InvalidHandshake) as exc:
            raise ConnectionLost(f"cannot connect to {self.url}: {exc}") from exc
        try:
            ready = await self._handshake(ws)
        except BaseException:
            await ws.close()
            raise
        self._generation += 1
        self._ws = ws
        self._lost = None
        self.session_id = ready.session_id
        self.options, self.limits = ready.options, ready.limits
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(ws), name="voxgate-reader")
        rest = {k: v for k, v in self._wanted.items() if k not in QUERY_OPTIONS}
        if rest:
            try:
                await self.update(**rest)
            except BaseException:
                await self.close()
                raise

    async def _handshake(self, ws: ClientConnection) -> Ready:
        """The first frame: `session.ready`, or the `error` a refused socket gets."""
        loop = asyncio.get_running_loop()
        try:
            frame = await asyncio.wait_for(ws.recv(), self._open_timeout)
            event = decode(frame, loop.time())
        except asyncio.TimeoutError:
            raise NoAnswer(f"no session.ready within {self._open_timeout:g} s") from None
        except ConnectionClosed as exc:
            raise ConnectionLost(f"the server closed the socket at once ({exc})",
                                 close_code=exc.rcvd.code if exc.rcvd else None) from None
        except BadFrame as exc:
            raise ConnectionLost(f"the server's first frame is unreadable: {exc}") from None
        if isinstance(event, Error):
            raise self._error(event)
        if not isinstance(event, Ready):
            raise ConnectionLost(f"expected session.ready first, got {type(event).__name__}")
        return event

    # -- turns -------------------------------------------------------------------------------
    def speak(self, text: TextSource | None = None, *, context_id: str | None = None,
              listener: TurnListener | None = None) -> Turn:
        """A new turn speaking `text`: a str (one message), or an iterable or async iterable
        of deltas (None deltas are skipped), sent as they come and flushed at the end.
        Without `text`, send it with `turn.push()` and `turn.flush()`.

        `listener`: see `TurnListener` (no queue, no decoding; the turn yields nothing).
        """
        if context_id is None:
            while context_id is None or context_id in self._turns or context_id in self._recent:
                self._num_turns += 1
                context_id = f"t{self._num_turns}"
        elif context_id in self._turns or context_id in self._recent:
            raise ValueError(f"context_id {context_id!r} was used on this session; a context "
                             "id is used once")
        decoder = None
        if listener is None:
            rate = 8000 if self.options.get("codec") == "mulaw" else int(
                self.options.get("sample_rate") or self._wanted.get("sample_rate") or 48000)
            decoder = Decoder(self.audio, rate)
        turn = Turn(self, context_id, decoder, listener, self._max_queued_ms, self._max_queued)
        self._turns[context_id] = turn
        if text is not None:
            turn._feed(text)
        return turn

    async def update(self, **options: Any) -> dict[str, Any]:
        """Change options for the turns made afterwards; returns the effective options.
        Raises `ServerError` (`unsupported_option`, `unknown_voice`) if refused."""
        while self._update is not None:  # one at a time: answers carry no id
            await asyncio.gather(self._update, return_exceptions=True)
        loop = asyncio.get_running_loop()
        self._update = loop.create_future()
        try:
            await self._send({"type": "session.update", **options})
            effective = await asyncio.wait_for(asyncio.shield(self._update), self._open_timeout)
        except asyncio.TimeoutError:
            raise NoAnswer(f"no session.updated within {self._open_timeout:g} s") from None
        finally:
            self._update = None
        self._wanted.update(options)
        self.options = effective
        return effective

    def _keep_routed(self, turn: Turn) -> None:
        """An ended turn waiting for an answer (a late cancel) is routed again, whatever its age."""
        if turn.context_id not in self._turns and turn.context_id not in self._recent:
            self._on_turn_end(turn, force=True)

    def _on_turn_end(self, turn: Turn, *, force: bool = False) -> None:
        if self._turns.pop(turn.context_id, None) is not None or force:
            self._recent[turn.context_id] = turn
            while len(self._recent) > MAX_RECENT_TURNS:
                self._recent.popitem(last=False)

    # -- sending -----------------------------------------------------------------------------
    async def _send(self, message: dict[str, Any]) -> None:
        ws = self._ws
        if ws is None:
            await self._ensure_connected()
            ws = self._ws
            assert ws is not None
        try:
            await ws.send(encode(message, self._binary))
        except ConnectionClosed as exc:
            raise self._lost or ConnectionLost(f"the connection closed ({exc})") from None

    def _cancel_quietly(self, turn: Turn) -> None:
        """Stop a failed turn on the server too, answer or not (its text source raised)."""
        if turn.generation == self._generation and self._ws is not None:
            message = {"type": "cancel", "context_id": turn.context_id}
            task = asyncio.get_running_loop().create_task(self._send(message))
            task.add_done_callback(_retrieve)

    # -- connection --------------------------------------------------------------------------
    async def _ensure_connected(self) -> None:
        if self._ws is not None:
            return
        if self._is_closing:
            raise ConnectionLost("the session was closed")
        if self._reconnect is None:
            raise self._lost or ConnectionLost("not connected: call connect() first")
        if self._connecting is None:
            self._start_reconnect(first_delay=False)
        assert self._connecting is not None
        await asyncio.shield(self._connecting)

    def _start_reconnect(self, *, first_delay: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._reconnect_loop(first_delay),
                                                      name="voxgate-reconnect")
        task.add_done_callback(_retrieve)
        self._connecting = task

    async def _reconnect_loop(self, first_delay: bool) -> None:
        policy = self._reconnect
        assert policy is not None
        attempt = 0
        try:
            while True:
                if first_delay or attempt:  # full jitter: a fleet does not knock all at once
                    await asyncio.sleep(policy.delay_s(attempt))
                try:
                    await self._open()
                    log.info("voxgate: reconnected (session %s)", self.session_id)
                    return
                except Unauthorized:
                    raise  # trying again cannot help
                except (ConnectionLost, NoAnswer, Busy) as exc:
                    attempt += 1
                    if policy.max_attempts is not None and attempt >= policy.max_attempts:
                        raise ConnectionLost(f"gave up reconnecting after {attempt} attempts: "
                                             f"{exc}") from exc
                    log.info("voxgate: reconnect attempt %d failed: %s", attempt, exc)
        finally:
            self._connecting = None

    async def _read(self, ws: ClientConnection) -> None:
        clock = asyncio.get_running_loop().time
        turns, recent = self._turns, self._recent
        code: int | None = None
        reason = ""
        try:
            async for frame in ws:
                try:
                    event = decode(frame, clock())
                except BadFrame as exc:
                    log.warning("voxgate: %s", exc)
                    continue
                if type(event) is Audio:  # the hot path: one per frame of audio
                    turn = turns.get(event.context_id) or recent.get(event.context_id)
                    if turn is not None and turn._on_audio(event):  # its queue is full
                        await turn._wait_room()
                elif event is not None:
                    self._dispatch(event)
        except ConnectionClosed:
            pass
        finally:
            if ws.close_code is not None:
                code, reason = ws.close_code, ws.close_reason or ""
            self._on_closed(ws, code, reason)

    def _dispatch(self, event: Any) -> None:
        if isinstance(event, Error):
            self._on_error_event(event)
            return
        if isinstance(event, Updated):
            if self._update is not None and not self._update.done():
                self._update.set_result(event.options)
            return
        turn = self._turns.get(event.context_id) or self._recent.get(event.context_id)
        if turn is None:
            return
        if isinstance(event, Segment):
            self._busy_streak = 0  # admitted
            turn._on_segment(event)
        elif isinstance(event, TextSkipped):
            turn._on_skipped(event)
        elif isinstance(event, Done):
            turn._on_done(event)
        elif isinstance(event, Cancelled):
            turn._on_cancelled(event)

    def _error(self, event: Error) -> ServerError:
        as_dict = {"code": event.code, "message": event.message,
                   "context_id": event.context_id, "fatal": event.fatal}
        advice = 1.0
        if event.code in ("busy", "rate_limited"):
            self._busy_streak += 1
            advice = retry_advice_s(self._busy_streak, self._rng)
        return server_error(as_dict, retry_after_s=advice)

    def _on_error_event(self, event: Error) -> None:
        error = self._error(event)
        if event.context_id is not None:
            turn = self._turns.get(event.context_id) or self._recent.get(event.context_id)
            if turn is not None:
                was_open = event.context_id in self._turns
                turn._on_error(error)
                if was_open and event.code not in ("busy", "context_closed"):
                    self._cancel_quietly(turn)  # a refused delta: the rest must not be spoken
                return
        if self._update is not None and not self._update.done() and event.code in (
                "unsupported_option", "unknown_voice", "bad_message"):
            self._update.set_exception(error)
            return
        if self.on_error is not None:
            self.on_error(error)
        else:
            log.warning("voxgate: server error %s: %s", event.code, event.message)
        if event.fatal:
            self._fail_open(error)

    def _fail_open(self, error: BaseException) -> None:
        for turn in list(self._turns.values()):
            turn._fail(error)
        if self._update is not None and not self._update.done():
            self._update.set_exception(error)

    def _on_closed(self, ws: ClientConnection, code: int | None, reason: str) -> None:
        if self._ws is not ws:
            return
        self._ws = None
        if self._is_closing:
            why = "the session was closed"
        else:
            why = f"the connection closed ({code} {reason})" if code else "the connection dropped"
        self._lost = ConnectionLost(why, close_code=code)
        self._fail_open(self._lost)
        if self._is_closing or self._reconnect is None:
            return
        if code != CLOSE_IDLE_TIMEOUT and self._connecting is None:
            self._start_reconnect(first_delay=True)  # lazily, at the next turn, after idling


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Read a background task's outcome, so that a failure is not reported as unretrieved
    (its turn, or the next caller of `_ensure_connected`, sees it)."""
    if not task.cancelled():
        exc = task.exception()
        if exc is not None and not isinstance(exc, VoxgateError):
            log.error("voxgate: background task failed", exc_info=exc)
