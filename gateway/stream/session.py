"""The sans-I/O session: client messages and engine audio in, actions out.

Like python-websockets' protocol objects, `Session` does no I/O and reads no
clock: the endpoint passes `now` (monotonic seconds) into every call and
carries out the returned actions (send a frame, submit or cancel an engine
request, close). Tests drive it synchronously.

Rules implemented here are docs/protocol.md's "Rules the server keeps": contexts
play one after another in creation order; a closed context id answers
`context_closed` once; after `cancelled` no audio of that context follows;
`seq` has no gaps and `pts_ms` grows by `duration_ms` (each context's
`Playout`, gateway/stream/playout.py, keeps the last two and paces its audio).

Voices are chosen among those of the socket's tenant (a `CatalogView` of the
shared `VoiceCatalog`) and held there (with those mapped for other languages,
`voice_for`): the session's and each open context's, released on change, at a
context's end and on disconnect; a deleted voice speaks on for its holders.

What is not protocol lives beside it: the engine half in synthesis.py, the
media half in playout.py, what is kept of ended contexts in ended.py, the
typed client messages in messages.py, the server events in events.py,
options, limits and rates in options.py, a turn's bookkeeping in context.py.

Every route runs this one session: the native socket, the vendor sockets
(gateway/compat composes it and feeds it typed messages) and the HTTP speech
route (gateway/http/turn.py: a request is one flushed context). Each context's
encoder comes from `open_encoder`, in the route's output format
(gateway/audio/encoders.py), so its audio is encoded once, where it is framed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.errors import VoxgateError
from engine.types import AudioChunk, RequestId
from gateway.audio.encoders import AudioEncoder, EncoderFactory
from gateway.audio.formats import MULAW_SAMPLE_RATE, AudioFormat
from gateway.errors import CLOSE_IDLE_TIMEOUT, ProtocolError, error_message
from gateway.stream.actions import Action, Cancel, Close, Encode, Observe, Send, Submit
from gateway.stream.context import Context, ContextState
from gateway.stream.encoding import EncodeJob
from gateway.stream.ended import EndedContexts
from gateway.stream.events import (
    AudioEvent,
    Cancelled,
    ContextDone,
    SessionReady,
    SessionUpdated,
    encode_audio,
    encode_event,
)
from gateway.stream.messages import (
    CancelMessage,
    ClientMessage,
    CloseMessage,
    FlushMessage,
    PlaybackMessage,
    SessionUpdate,
    TextMessage,
    decode_message,
)
from gateway.stream.options import (
    InputRates,
    Limits,
    SessionOptions,
    apply_update,
    hold_voices,
)
from gateway.stream.playout import Playout
from gateway.stream.synthesis import Synthesis, frame_ready_audio
from gateway.text.routing import Languages, merge_voice_for
from gateway.text.segmenter import Segmenter, SegmenterConfig
from gateway.voices.catalog import VoiceChoices

log = logging.getLogger("voxgate.gateway")

#: opens the encoder of a new context (its id, the session's options then): the session's
#: output stage (gateway/audio/encoders.py); the HTTP route and vendor sockets pass their own
OpenEncoder = Callable[[str, SessionOptions], AudioEncoder]

__all__ = ["Action", "Cancel", "Close", "Observe", "OpenEncoder", "Send", "Session", "Submit"]


class Session:
    """One WebSocket connection's protocol state."""

    def __init__(self, session_id: str, *, catalog: VoiceChoices, sample_rate: int,
                 options: SessionOptions | None = None, limits: Limits | None = None,
                 admit: Callable[[str], None] = lambda key: None,
                 release: Callable[[str], None] = lambda key: None,
                 languages: Languages | None = None, encoders: EncoderFactory | None = None,
                 open_encoder: OpenEncoder | None = None, defer_encode: bool = False) -> None:
        """Holds its voices in `catalog` until `disconnect` (the caller validated them);
        `languages` routes segments by language (None: every one to the context's voice);
        `open_encoder` makes each context's encoder (None: the native codec of the options,
        opened by `encoders`, the app's factory); `defer_encode`: encodes go out as `Encode`
        actions, and come back through `receive_encoded` (gateway/stream/encoding.py)."""
        self.session_id = session_id
        self.catalog = catalog
        self.engine_sample_rate = sample_rate
        self.options = options or SessionOptions()
        self.limits = limits or Limits()
        hold_voices(catalog, hold=self.options.voices)
        self._is_holding_voice = True
        self._synthesis = Synthesis(session_id, admit=admit, release=release, languages=languages)
        self.encoders = encoders or EncoderFactory()
        self._open_encoder = open_encoder or self._open_native_encoder
        self.defer_encode = defer_encode
        self.contexts: dict[str, Context] = {}     # open, in creation order
        self._ended = EndedContexts()  # for the messages that come after a context's end
        self._playback_end = 0.0  # when the audio of finished contexts ends playing
        self.is_closing = False
        self.last_activity = 0.0
        self._rates = InputRates(self.limits)

    # -- entry points -------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        self.last_activity = now
        return [Send(SessionReady(self.session_id, self.options, self.limits))]

    def encode(self, action: Send) -> str | bytes:
        """The frame of a Send: an event in the session's encoding, audio as audio frames."""
        if isinstance(action.message, AudioEvent):
            return encode_audio(action.message, self.options)
        return encode_event(action.message, self.options.encoding)

    def idle_close(self, idle_s: float) -> list[Action]:
        """What closes a socket idle for `idle_s` (docs/protocol.md): `error`, then 4000."""
        return [Send(error_message(ProtocolError(
            "bad_message", f"closing after {idle_s:.0f} s without messages", fatal=True))),
            Close(CLOSE_IDLE_TIMEOUT, "idle timeout")]

    def has_context(self, context_id: str) -> bool:
        """`context_id` is open: it takes text or still speaks."""
        return context_id in self.contexts

    @property
    def num_open_contexts(self) -> int:
        return len(self.contexts)

    def receive_frame(self, raw: str | bytes, now: float) -> list[Action]:
        """One client frame: a rate-limit token, then decoded once and handled as its message.

        Bad input yields an `error`; the session goes on.
        """
        try:
            self.take_frame(now)
            message = decode_message(raw, self.limits.max_message_bytes)
        except ProtocolError as exc:
            return self._refused(exc)
        return self.receive_message(message, now)

    def receive_message(self, message: ClientMessage, now: float) -> list[Action]:
        """One typed client message: decoded from a frame, or built by a vendor adapter.

        Takes no rate-limit token (the frame it came in took one). Bad input
        yields an `error`; the session goes on.
        """
        self.last_activity = now
        try:
            return self._dispatch(message, now)
        except VoxgateError as exc:
            return self._refused(exc, getattr(message, "context_id", None))

    def take_frame(self, now: float) -> None:
        """A client frame came (the socket is not idle): its place in the message rate; raises
        `rate_limited` when none is left."""
        self.last_activity = now
        self._rates.take_message(now)

    def receive_audio(self, chunk: AudioChunk, now: float) -> list[Action]:
        if not self._synthesis.receive_audio(chunk):
            return []
        return self._pump(now)

    def receive_engine_error(self, request_id: RequestId, exc: BaseException,
                             now: float) -> list[Action]:
        """An engine failure ends that context only (docs/protocol.md, "Errors": `internal`)."""
        return self._fail(self._synthesis.pop_request(request_id), exc, now)

    def receive_encoded(self, context_id: str, job: EncodeJob, now: float) -> list[Action]:
        """An `Encode` is done: its frames join the context's playout, paced out as before; an
        encoder's fault ends that context only."""
        context = self.contexts.get(context_id)  # ids are used once: a later one is not it
        if context is None:
            return []
        try:
            context.playout.complete(job)
        except Exception as exc:  # noqa: BLE001 - reported to its context as `internal`
            log.error("session %s: encoding context %s failed: %r", self.session_id,
                      context_id, exc)
            return self._fail(context, exc, now)
        return self._pump(now)

    def _fail(self, context: Context | None, exc: BaseException, now: float) -> list[Action]:
        if context is None or context.is_closed:
            return []
        actions = self._refused(exc, context.context_id)
        actions += self._end_context(context, ContextState.FAILED)
        return actions + self._pump(now)

    def tick(self, now: float) -> list[Action]:
        """Timers: time-based text release, idle contexts flushed, realtime pacing."""
        actions: list[Action] = []
        for context in list(self.contexts.values()):
            if context.state is not ContextState.OPEN:
                continue
            if now >= context.last_text_at + self.limits.context_idle_timeout_s:
                # An abandoned turn (docs/protocol.md, "A turn"): speak what came and end it,
                # so that an open context cannot hold engine capacity or the socket forever.
                actions += self._flush_context(context, now)
            else:
                actions += self._submit_segments(context, context.segmenter.poll(now), now)
        return actions + self._pump(now)

    def is_idle(self, now: float) -> bool:
        """No client frame for the idle timeout, and no flushed context still speaking.

        Open contexts do not count: a socket that opens turns and goes silent is
        idle (its turns are flushed after `context_idle_timeout_s` anyway). A
        context still speaking does, because the client is listening to it.
        """
        if now < self.last_activity + self.limits.idle_timeout_s:
            return False
        return not any(c.state is ContextState.FLUSHED for c in self.contexts.values())

    def disconnect(self) -> list[Action]:
        """The socket is gone: free every context's engine work, capacity and voice (idempotent)."""
        actions: list[Action] = []
        for context in list(self.contexts.values()):
            actions += [a for a in self._end_context(context, ContextState.CANCELLED)
                        if isinstance(a, Cancel)]
        if self._is_holding_voice:
            self._is_holding_voice = False
            hold_voices(self.catalog, release=self.options.voices)
        return actions

    def next_wakeup(self) -> float | None:
        times = [t for c in self.contexts.values()
                 if c.state is ContextState.OPEN and (t := c.segmenter.next_deadline()) is not None]
        times += [c.last_text_at + self.limits.context_idle_timeout_s
                  for c in self.contexts.values()
                  if c.state is ContextState.OPEN]
        active = self._active_context()
        if active is not None and (due := active.playout.next_release()) is not None:
            times.append(due)
        return min(times) if times else None

    # -- client messages -----------------------------------------------------
    def _refused(self, exc: BaseException, context_id: str | None = None) -> list[Action]:
        event = error_message(exc, context_id)
        return [Send(event), Observe("error:" + event.code, 1)]

    def _dispatch(self, message: ClientMessage, now: float) -> list[Action]:
        if self.is_closing and not isinstance(message, CloseMessage):
            raise ProtocolError("bad_message", "the session is closing; no more messages are taken")
        if isinstance(message, TextMessage):
            return self._on_text(message, now)
        if isinstance(message, FlushMessage):
            return self._on_flush(message, now)
        if isinstance(message, CancelMessage):
            return self._on_cancel(message, now)
        if isinstance(message, PlaybackMessage):
            return self._on_playback(message)
        if isinstance(message, SessionUpdate):
            return self._on_update(message)
        return self._on_close(now)

    def _on_text(self, message: TextMessage, now: float) -> list[Action]:
        context_id, text = message.context_id, message.text
        context = self._open_context(context_id, now)
        if context is None:
            return self._ended.late_text(context_id)
        if context.state is not ContextState.OPEN:
            raise ProtocolError("context_closed",
                                f"context {context_id!r} was flushed; no more text is taken",
                                context_id=context_id)
        if context.num_text_chars + len(text) > self.limits.max_text_per_context:
            raise ProtocolError("text_too_long", f"context {context_id!r} would exceed "
                                f"{self.limits.max_text_per_context} characters; the delta was "
                                "dropped",
                                context_id=context_id)
        self._rates.take_text(text, now, context_id)
        context.num_text_chars += len(text)
        context.last_text_at = now
        actions = self._submit_segments(context, context.segmenter.push(text, now), now)
        if message.flush:
            actions += self._flush_context(context, now)
        return actions + self._pump(now)

    def _on_flush(self, message: FlushMessage, now: float) -> list[Action]:
        context_id = message.context_id
        context = self.contexts.get(context_id)
        if context is None:
            if context_id in self._ended:
                return self._ended.late_text(context_id)
            raise ProtocolError("bad_context_id",
                                f"no open context {context_id!r}; send text first",
                                context_id=context_id)
        return self._flush_context(context, now) + self._pump(now)

    def _on_cancel(self, message: CancelMessage, now: float) -> list[Action]:
        context_id, played_ms = message.context_id, message.played_ms
        if context_id is None:
            targets = list(self.contexts.values())
        elif context_id in self.contexts:
            targets = [self.contexts[context_id]]
        elif (done := self._ended.take_done(context_id)) is not None:
            # All audio was sent, but the listener may still be playing it (asap
            # pacing runs far ahead): split the text at what was heard.
            return [Send(done.cancelled(played_ms)), Observe("cancel", 1)]
        elif context_id in self._ended:
            # Already cancelled (or long finished): answer idempotently, nothing to stop.
            return [Send(Cancelled(context_id, None, played_ms, None, None))]
        else:
            raise ProtocolError("bad_context_id", f"no open context {context_id!r}",
                                context_id=context_id)
        # a played_ms reported with a cancel of all contexts applies to none of them alone
        answers = [c.cancelled(played_ms if context_id else None) for c in targets]
        actions: list[Action] = []
        for context, answer in zip(targets, answers, strict=True):
            actions += self._end_context(context, ContextState.CANCELLED)
            actions.append(Observe("cancel", 1))
            if context_id is not None:
                actions.append(Send(answer))
        if context_id is None:
            actions.append(Send(Cancelled(
                None, sum(a.audio_ms_sent or 0.0 for a in answers), played_ms,
                " ".join(a.spoken_text for a in answers if a.spoken_text),
                " ".join(a.unspoken_text for a in answers if a.unspoken_text))))
        return actions + self._pump(now)

    def _on_update(self, message: SessionUpdate) -> list[Action]:
        options = apply_update(self.options, message.changes, self.catalog.listed)
        if self._is_holding_voice:
            hold_voices(self.catalog, hold=options.voices, release=self.options.voices)
        self.options = options
        return [Send(SessionUpdated(options))]

    def _on_playback(self, message: PlaybackMessage) -> list[Action]:
        context_id = message.context_id
        context = self.contexts.get(context_id) or self._ended.done(context_id)
        if context is not None:
            context.played_ms = message.played_ms
        return []

    def _on_close(self, now: float) -> list[Action]:
        self.is_closing = True
        actions: list[Action] = []
        for context in list(self.contexts.values()):
            if context.state is ContextState.OPEN:
                actions += self._flush_context(context, now)
        return actions + self._pump(now)

    # -- contexts --------------------------------------------------------------
    def _open_context(self, context_id: str, now: float) -> Context | None:
        if context_id in self.contexts:
            return self.contexts[context_id]
        if context_id in self._ended:
            return None
        if len(self.contexts) >= self.limits.max_open_contexts:
            raise ProtocolError("too_many_contexts",
                                f"this socket holds {self.limits.max_open_contexts} "
                                "open contexts; flush or cancel one first", context_id=context_id)
        # Engine capacity is taken later, when the first segment goes to the
        # engine (`Synthesis.submit_ready`): text that never makes a segment holds none.
        key = f"{self.session_id}/{context_id}"
        options = self.options
        config = SegmenterConfig(max_buffer_delay_ms=options.max_buffer_delay_ms)
        playout = Playout(context_id, self._open_encoder(context_id, options),
                          is_realtime=options.pacing == "realtime",
                          frames_per_message=options.frames_per_message,
                          is_deferred=self.defer_encode)
        context = Context(context_id, key, Segmenter(config), playout, options, now,
                          last_text_at=now,
                          voice_for=merge_voice_for(self._synthesis.voice_for, options.voice_for))
        self.contexts[context_id] = context
        hold_voices(self.catalog, hold=context.voices)
        return context

    def _open_native_encoder(self, context_id: str, options: SessionOptions) -> AudioEncoder:
        rate = MULAW_SAMPLE_RATE if options.codec == "mulaw" else options.sample_rate
        fmt = AudioFormat(options.codec, rate, options.frame_ms, options.bitrate)
        return self.encoders.open(fmt, self.engine_sample_rate)

    def _flush_context(self, context: Context, now: float) -> list[Action]:
        if context.state is not ContextState.OPEN:
            return []
        actions = self._submit_segments(context, context.segmenter.flush(now), now)
        context.state = ContextState.FLUSHED
        return actions

    def _submit_segments(self, context: Context, texts: list[str], now: float) -> list[Action]:
        """Queue released segments, then submit as many as the look-ahead window allows."""
        self._synthesis.add_segments(context, texts, now)
        return self._submit_ready(now)

    def _submit_ready(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for context in self._synthesis.submit_ready(self.contexts, now, actions):
            actions += self._end_context(context, ContextState.FAILED)
        return actions

    def _end_context(self, context: Context, state: ContextState) -> list[Action]:
        actions = self._synthesis.cancel_pending(context)
        for segment in context.segments:
            segment.chunks.clear()
        context.playout.clear()
        context.segmenter.clear()
        context.state = state
        if state is ContextState.DONE:
            started_at = context.playout.play_started_at
            if started_at is not None:
                self._playback_end = started_at + context.audio_ms_sent / 1000.0
        self._ended.add(context, is_done=state is ContextState.DONE)
        self.contexts.pop(context.context_id, None)
        self._synthesis.release(context)
        hold_voices(self.catalog, release=context.voices)
        return actions

    # -- audio -------------------------------------------------------------------
    def _active_context(self) -> Context | None:
        return next(iter(self.contexts.values()), None)

    def _pump(self, now: float) -> list[Action]:
        """Frame ready audio of the active context, send what pacing allows, finish contexts."""
        actions: list[Action] = []
        while (context := self._active_context()) is not None:
            frame_ready_audio(context, now, actions)
            if (job := context.playout.take_job(now, self._playback_end)) is not None:
                actions.append(Encode(context.context_id, job))
            actions += self._submit_ready(now)
            if context.is_closed:
                continue  # refused admission: it ended, the next context is active
            for audio in context.playout.release(now, self._playback_end):
                actions += [Send(audio), Observe("audio_ms", audio.duration_ms)]
                late_s = now - (context.playout.play_started_at or now) - audio.pts_ms / 1000.0
                if late_s > 0:  # sent after its playback time: the server's view of a gap
                    actions.append(Observe("late_audio", late_s))
            if not context.is_drained():
                break
            actions.append(Send(ContextDone(context.context_id, context.audio_ms_sent,
                                            context.num_spoken)))
            actions += self._end_context(context, ContextState.DONE)
        if not self.contexts and self.is_closing:
            actions.append(Close(1000, "session closed by client"))
        return actions
