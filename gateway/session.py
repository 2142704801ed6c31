"""The sans-I/O session: client messages and engine audio in, actions out.

Like python-websockets' protocol objects, `Session` does no I/O and reads no
clock: the endpoint passes `now` (monotonic seconds) into every call and
carries out the returned actions (send a frame, submit or cancel an engine
request, close). Tests drive it synchronously.

Rules implemented here are PROTOCOL.md's "Rules the server keeps": contexts
play one after another in creation order; a closed context id answers
`context_closed` once; after `cancelled` no audio of that context follows;
`seq` has no gaps and `pts_ms` grows by `duration_ms`.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineBusyError, VoxgateError
from engine.types import AudioChunk, RequestId, SamplingParams, SynthesisRequest
from gateway.audio import make_encoder
from gateway.context import Context, ContextState, Segment
from gateway.errors import ProtocolError, error_message
from gateway.messages import (
    PROTOCOL_VERSION,
    Limits,
    SessionOptions,
    TokenBucket,
    apply_update,
    context_id_of,
    decode_frame,
    optional_ms,
)
from gateway.segmenter import Segmenter, SegmenterConfig

log = logging.getLogger("voxgate.gateway")

#: Seconds of speech per character, to guess when a segment's audio will run out.
EST_S_PER_CHAR = 0.065
REALTIME_LEAD_MS = 1500.0
FRAMES_PER_MESSAGE = 5
MAX_REMEMBERED_CLOSED = 4096
MAX_SEGMENTS_AHEAD = 4
MAX_RECENT_DONE = 8


@dataclass(slots=True, frozen=True)
class Send:
    message: dict[str, Any]
    is_audio: bool = False


@dataclass(slots=True, frozen=True)
class Submit:
    request: SynthesisRequest


@dataclass(slots=True, frozen=True)
class Cancel:
    request_id: RequestId


@dataclass(slots=True, frozen=True)
class Close:
    code: int
    reason: str = ""


@dataclass(slots=True, frozen=True)
class Observe:
    """A measurement for metrics (name, value)."""

    name: str
    value: float


Action = Send | Submit | Cancel | Close | Observe


class Session:
    """One WebSocket connection's protocol state."""

    def __init__(self, session_id: str, *, voice_ids: set[str], sample_rate: int,
                 options: SessionOptions | None = None, limits: Limits | None = None,
                 admit: Callable[[str], None] = lambda key: None,
                 release: Callable[[str], None] = lambda key: None) -> None:
        self.session_id = session_id
        self.voice_ids = voice_ids
        self.engine_sample_rate = sample_rate
        self.options = options or SessionOptions()
        self.limits = limits or Limits()
        self._admit = admit
        self._release = release
        self.contexts: dict[str, Context] = {}     # open, in creation order
        self._closed: OrderedDict[str, bool] = OrderedDict()  # id -> already answered
        self._recent_done: OrderedDict[str, Context] = OrderedDict()  # for late cancels
        self._by_request: dict[RequestId, Context] = {}
        self._request_ids = itertools.count()
        self._playback_end = 0.0  # when the audio of finished contexts ends playing
        self.is_closing = False
        self.last_activity = 0.0
        limits = self.limits
        self._message_rate = TokenBucket(limits.max_messages_per_s, limits.max_messages_per_s * limits.burst_s)
        self._text_rate = TokenBucket(limits.max_text_chars_per_s, limits.max_text_chars_per_s * limits.burst_s)

    # -- entry points -------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        self.last_activity = now
        return [Send({"type": "session.ready", "session_id": self.session_id,
                      "protocol": PROTOCOL_VERSION, "options": self.options.to_wire(),
                      "limits": self.limits.to_wire()})]

    def receive_frame(self, raw: str | bytes, now: float) -> list[Action]:
        """One client frame. Bad input yields an `error`; the session goes on."""
        self.last_activity = now
        context_id: str | None = None
        try:
            if not self._message_rate.take(1, now):
                raise ProtocolError("rate_limited", f"more than {self.limits.max_messages_per_s:g} "
                                    "messages per second; the message was dropped")
            message = decode_frame(raw, self.limits.max_message_bytes)
            context_id = message.get("context_id") if isinstance(message.get("context_id"), str) else None
            return self._dispatch(message, now)
        except VoxgateError as exc:
            return [Send(error_message(exc, context_id)), Observe("error:" + exc.code, 1)]

    def receive_audio(self, chunk: AudioChunk, now: float) -> list[Action]:
        context = self._by_request.get(chunk.request_id)
        if context is None or context.is_closed:
            return []
        segment = context.segment_for(chunk.request_id)
        if segment is None:
            return []
        segment.chunks.append(chunk)
        if chunk.words is not None:
            segment.words = chunk.words
        if chunk.is_last:
            segment.is_synthesized = True
            self._by_request.pop(chunk.request_id, None)
        return self._pump(now)

    def receive_engine_error(self, request_id: RequestId, exc: BaseException,
                             now: float) -> list[Action]:
        """An engine failure ends that context only (PROTOCOL.md `internal`)."""
        context = self._by_request.pop(request_id, None)
        if context is None or context.is_closed:
            return []
        actions: list[Action] = [Send(error_message(exc, context.context_id)),
                                 Observe("error:" + getattr(exc, "code", "internal"), 1)]
        actions += self._end_context(context, ContextState.FAILED)
        return actions + self._pump(now)

    def tick(self, now: float) -> list[Action]:
        """Timers: time-based text release and realtime pacing."""
        actions: list[Action] = []
        for context in list(self.contexts.values()):
            if context.state is ContextState.OPEN:
                actions += self._submit_segments(context, context.segmenter.poll(now), now)
        return actions + self._pump(now)

    def disconnect(self) -> list[Action]:
        """The socket is gone: free every context's engine work and capacity."""
        actions: list[Action] = []
        for context in list(self.contexts.values()):
            actions += [a for a in self._end_context(context, ContextState.CANCELLED)
                        if isinstance(a, Cancel)]
        return actions

    def next_wakeup(self) -> float | None:
        times = [t for c in self.contexts.values()
                 if c.state is ContextState.OPEN and (t := c.segmenter.next_deadline()) is not None]
        active = self._active_context()
        if active is not None and active.outbox and self.options.pacing == "realtime":
            times.append(self._release_time(active, active.outbox[0][0]))
        return min(times) if times else None

    # -- client messages -----------------------------------------------------
    def _dispatch(self, message: dict[str, Any], now: float) -> list[Action]:
        kind = message["type"]
        if self.is_closing and kind != "close":
            raise ProtocolError("bad_message", "the session is closing; no more messages are taken")
        if kind == "text":
            return self._on_text(message, now)
        if kind == "flush":
            return self._on_flush(message, now)
        if kind == "cancel":
            return self._on_cancel(message, now)
        if kind == "playback":
            return self._on_playback(message)
        if kind == "session.update":
            self.options = apply_update(self.options, message, self.voice_ids)
            return [Send({"type": "session.updated", "options": self.options.to_wire()})]
        if kind == "close":
            return self._on_close(now)
        raise ProtocolError("bad_message", f"unknown message type {kind[:40]!r}; expected one of "
                            "session.update, text, flush, cancel, playback, close")

    def _on_text(self, message: dict[str, Any], now: float) -> list[Action]:
        context_id = context_id_of(message, required=True)
        assert context_id is not None
        text = message.get("text")
        if not isinstance(text, str):
            raise ProtocolError("bad_message", f"text must be a string, got {type(text).__name__}",
                                context_id=context_id)
        flush = message.get("flush", False)
        if not isinstance(flush, bool):
            raise ProtocolError("bad_message", f"flush must be a boolean, got {type(flush).__name__}")
        context = self._open_context(context_id, now)
        if context is None:
            return self._closed_answer(context_id)
        if context.state is not ContextState.OPEN:
            raise ProtocolError("context_closed", f"context {context_id!r} was flushed; no more text is taken",
                                context_id=context_id)
        if context.num_text_chars + len(text) > self.limits.max_text_per_context:
            raise ProtocolError("text_too_long", f"context {context_id!r} would exceed "
                                f"{self.limits.max_text_per_context} characters; the delta was dropped",
                                context_id=context_id)
        if not self._text_rate.take(len(text), now):
            raise ProtocolError("rate_limited", f"more than {self.limits.max_text_chars_per_s:g} characters "
                                "of text per second; the delta was dropped", context_id=context_id)
        context.num_text_chars += len(text)
        actions = self._submit_segments(context, context.segmenter.push(text, now), now)
        if flush:
            actions += self._flush_context(context, now)
        return actions + self._pump(now)

    def _on_flush(self, message: dict[str, Any], now: float) -> list[Action]:
        context_id = context_id_of(message, required=True)
        assert context_id is not None
        context = self.contexts.get(context_id)
        if context is None:
            if context_id in self._closed:
                return self._closed_answer(context_id)
            raise ProtocolError("bad_context_id", f"no open context {context_id!r}; send text first",
                                context_id=context_id)
        return self._flush_context(context, now) + self._pump(now)

    def _on_cancel(self, message: dict[str, Any], now: float) -> list[Action]:
        context_id = context_id_of(message, required=False)
        played_ms = optional_ms(message, "played_ms")
        if context_id is None:
            targets = list(self.contexts.values())
        elif context_id in self.contexts:
            targets = [self.contexts[context_id]]
        elif context_id in self._recent_done:
            # All audio was sent, but the listener may still be playing it (asap
            # pacing runs far ahead): split the text at what was heard.
            done = self._recent_done.pop(context_id)
            heard = played_ms if played_ms is not None else done.played_ms
            heard = done.audio_ms_sent if heard is None else min(heard, done.audio_ms_sent)
            spoken, unspoken = done.split_heard(heard)
            return [Send({"type": "cancelled", "context_id": context_id,
                          "audio_ms_sent": round(done.audio_ms_sent, 1), "played_ms": played_ms,
                          "spoken_text": spoken, "unspoken_text": unspoken}), Observe("cancel", 1)]
        elif context_id in self._closed:
            # Already cancelled (or long finished): answer idempotently, nothing to stop.
            return [Send({"type": "cancelled", "context_id": context_id, "audio_ms_sent": None,
                          "played_ms": played_ms, "spoken_text": None, "unspoken_text": None})]
        else:
            raise ProtocolError("bad_context_id", f"no open context {context_id!r}", context_id=context_id)
        actions: list[Action] = []
        spoken_all: list[str] = []
        unspoken_all: list[str] = []
        sent_total = 0.0
        for context in targets:
            heard = played_ms if played_ms is not None and context_id is not None else context.played_ms
            if heard is None or heard > context.audio_ms_sent:
                heard = context.audio_ms_sent
            spoken, unspoken = context.split_heard(heard)
            sent_total += context.audio_ms_sent
            spoken_all.append(spoken)
            unspoken_all.append(unspoken)
            actions += self._end_context(context, ContextState.CANCELLED)
            actions.append(Observe("cancel", 1))
            if context_id is not None:
                actions.append(Send({"type": "cancelled", "context_id": context.context_id,
                                     "audio_ms_sent": round(context.audio_ms_sent, 1),
                                     "played_ms": played_ms if played_ms is not None else context.played_ms,
                                     "spoken_text": spoken, "unspoken_text": unspoken}))
        if context_id is None:
            actions.append(Send({"type": "cancelled", "context_id": None,
                                 "audio_ms_sent": round(sent_total, 1), "played_ms": played_ms,
                                 "spoken_text": " ".join(s for s in spoken_all if s),
                                 "unspoken_text": " ".join(u for u in unspoken_all if u)}))
        return actions + self._pump(now)

    def _on_playback(self, message: dict[str, Any]) -> list[Action]:
        context_id = context_id_of(message, required=True)
        played_ms = optional_ms(message, "played_ms")
        if played_ms is None:
            raise ProtocolError("bad_message", "'playback' needs a number field 'played_ms'")
        context = self.contexts.get(context_id or "") or self._recent_done.get(context_id or "")
        if context is not None:
            context.played_ms = played_ms
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
        if context_id in self._closed:
            return None
        if len(self.contexts) >= self.limits.max_open_contexts:
            raise ProtocolError("too_many_contexts", f"this socket holds {self.limits.max_open_contexts} "
                                "open contexts; flush or cancel one first", context_id=context_id)
        key = f"{self.session_id}/{context_id}"
        try:
            self._admit(key)
        except EngineBusyError as exc:
            raise ProtocolError("busy", str(exc), context_id=context_id) from None
        config = SegmenterConfig(max_buffer_delay_ms=self.options.max_buffer_delay_ms)
        encoder = make_encoder(self.options.codec, self.options.sample_rate, self.options.frame_ms,
                               self.options.bitrate, self.engine_sample_rate)
        context = Context(context_id, key, Segmenter(config), encoder, self.options, now)
        self.contexts[context_id] = context
        return context

    def _closed_answer(self, context_id: str) -> list[Action]:
        if self._closed.get(context_id):
            return []  # answered once already: late tokens are dropped silently
        self._closed[context_id] = True
        return [Send(error_message(ProtocolError(
            "context_closed", f"context {context_id!r} is done or cancelled; its text is dropped",
            context_id=context_id))), Observe("error:context_closed", 1)]

    def _flush_context(self, context: Context, now: float) -> list[Action]:
        if context.state is not ContextState.OPEN:
            return []
        actions = self._submit_segments(context, context.segmenter.flush(now), now)
        context.state = ContextState.FLUSHED
        return actions

    def _submit_segments(self, context: Context, texts: list[str], now: float) -> list[Action]:
        """Queue released segments, then submit as many as the look-ahead window allows."""
        for text in texts:
            request_id = RequestId(f"{self.session_id}:{next(self._request_ids)}")
            context.segments.append(Segment(len(context.segments), text, request_id, now))
        return self._submit_ready(now)

    def _submit_ready(self, now: float) -> list[Action]:
        # At most MAX_SEGMENTS_AHEAD segments per socket are with the engine or
        # waiting to be framed: audio a client cannot play yet is not made yet,
        # so a client that stops reading cannot make the server hold hours of PCM.
        in_flight = sum(1 for c in self.contexts.values() for s in c.segments
                        if s.is_submitted and not s.is_sent)
        actions: list[Action] = []
        for context in self.contexts.values():
            options = context.options
            for segment in context.segments:
                if segment.is_submitted:
                    continue
                if in_flight >= MAX_SEGMENTS_AHEAD:
                    return actions
                segment.is_submitted = True
                in_flight += 1
                self._by_request[segment.request_id] = context
                deadline = self._deadline(context, segment.segment_id, now)
                actions.append(Submit(SynthesisRequest(
                    segment.request_id, segment.text, options.voice, deadline, context_key=context.key,
                    language=options.language, instructions=options.instructions,
                    params=SamplingParams(speed=options.speed))))
        return actions

    def _deadline(self, context: Context, index: int, now: float) -> float:
        """When segment `index` of `context` must have audio (DESIGN.md, Engine).

        The first segment of a turn that nothing plays before is due now (its
        TTFA); any other is due when the audio before it runs out: the
        context's playback start (actual, or predicted after the contexts
        queued before it) plus the durations of its earlier segments (actual
        once synthesized, estimated from their text before).
        """
        start = context.play_started_at
        if start is None:
            start = now
            for other in self.contexts.values():
                if other is context:
                    break
                start = max(start, self._predicted_end(other, now))
        return start + self._audio_s(context.segments[:index], context.options.speed)

    def _predicted_end(self, context: Context, now: float) -> float:
        start = context.play_started_at if context.play_started_at is not None else now
        return start + self._audio_s(context.segments, context.options.speed)

    @staticmethod
    def _audio_s(segments: list[Segment], speed: float) -> float:
        total = 0.0
        for s in segments:
            if s.is_synthesized:  # framed audio plus chunks still waiting to be framed
                total += (s.audio_ms + sum(c.duration_ms for c in s.chunks)) / 1000.0
            else:
                total += EST_S_PER_CHAR * len(s.text) / speed
        return total

    def _end_context(self, context: Context, state: ContextState) -> list[Action]:
        actions: list[Action] = [Cancel(r) for r in context.pending_requests()]
        for request_id in context.pending_requests():
            self._by_request.pop(request_id, None)
        for segment in context.segments:
            segment.chunks.clear()
        context.outbox.clear()
        context.segmenter.clear()
        context.state = state
        if state is ContextState.DONE:
            if context.play_started_at is not None:
                self._playback_end = context.play_started_at + context.audio_ms_sent / 1000.0
            self._recent_done[context.context_id] = context
            while len(self._recent_done) > MAX_RECENT_DONE:
                self._recent_done.popitem(last=False)
        self.contexts.pop(context.context_id, None)
        self._closed[context.context_id] = False
        while len(self._closed) > MAX_REMEMBERED_CLOSED:
            self._closed.popitem(last=False)
        self._release(context.key)
        return actions

    # -- audio -------------------------------------------------------------------
    def _active_context(self) -> Context | None:
        return next(iter(self.contexts.values()), None)

    def _pump(self, now: float) -> list[Action]:
        """Frame ready audio of the active context, send what pacing allows, finish contexts."""
        actions: list[Action] = []
        while (context := self._active_context()) is not None:
            self._frame_ready_audio(context, now, actions)
            actions += self._submit_ready(now)
            self._release_outbox(context, now, actions)
            if not context.is_drained():
                break
            actions.append(Send({"type": "context.done", "context_id": context.context_id,
                                 "audio_ms": round(context.audio_ms_sent, 1),
                                 "segments": len(context.segments)}))
            actions += self._end_context(context, ContextState.DONE)
        if not self.contexts and self.is_closing:
            actions.append(Close(1000, "session closed by client"))
        return actions

    def _frame_ready_audio(self, context: Context, now: float, actions: list[Action]) -> None:
        encoder = context.encoder
        for segment in context.segments:
            if segment.is_sent:
                continue
            while segment.chunks:
                chunk = segment.chunks.popleft()
                if not segment.is_started:
                    segment.is_started = True
                    segment.pts_ms = context.pcm_ms_framed
                    duration = chunk.duration_ms if chunk.is_last else None
                    actions.append(Send({"type": "segment", "context_id": context.context_id,
                                         "segment_id": segment.segment_id, "text": segment.text,
                                         "pts_ms": round(segment.pts_ms, 1),
                                         "duration_ms": None if duration is None else round(duration, 1),
                                         "words": _words_wire(chunk)}))
                    if segment.segment_id == 0:
                        actions.append(Observe("ttfa", now - segment.released_at))
                segment.audio_ms += chunk.duration_ms
                context.pcm_ms_framed += chunk.duration_ms
                self._queue_frames(context, encoder.encode(chunk.pcm))
            if not segment.is_synthesized:
                return  # later segments wait: audio stays in playback order
            segment.is_sent = True
        if (context.state is ContextState.FLUSHED and not context.segmenter.pending_text.strip()
                and all(s.is_sent for s in context.segments) and not context.is_audio_flushed):
            context.is_audio_flushed = True
            self._queue_frames(context, encoder.flush())

    def _queue_frames(self, context: Context, frames: list[Any]) -> None:
        options = context.options
        for start in range(0, len(frames), FRAMES_PER_MESSAGE):
            group = frames[start:start + FRAMES_PER_MESSAGE]
            duration = sum(f.duration_ms for f in group)
            message: dict[str, Any] = {"type": "audio", "context_id": context.context_id,
                                       "seq": context.seq, "pts_ms": round(context.audio_ms_queued, 3),
                                       "duration_ms": duration, "codec": options.codec}
            if options.codec == "opus":
                message["packets"] = [f.data for f in group]
            else:
                message["data"] = b"".join(f.data for f in group)
            context.seq += 1
            context.outbox.append((context.audio_ms_queued, message))
            context.audio_ms_queued += duration

    def _release_time(self, context: Context, pts_ms: float) -> float:
        start = context.play_started_at
        if start is None:
            return 0.0
        return start + (pts_ms - REALTIME_LEAD_MS) / 1000.0

    def _release_outbox(self, context: Context, now: float, actions: list[Action]) -> None:
        options = context.options
        while context.outbox:
            pts_ms, message = context.outbox[0]
            if options.pacing == "realtime" and self._release_time(context, pts_ms) > now:
                break
            context.outbox.popleft()
            if context.play_started_at is None:
                # Contexts play one after another: this one starts when the last ends.
                context.play_started_at = max(now, self._playback_end)
                context.first_audio_at = now
            duration_ms = float(message["duration_ms"])  # type: ignore[arg-type]
            context.audio_ms_sent += duration_ms
            actions.append(Send(message, is_audio=True))
            actions.append(Observe("audio_ms", duration_ms))


def _words_wire(chunk: AudioChunk) -> list[dict[str, Any]] | None:
    if chunk.words is None:
        return None
    return [{"word": w.word, "start_ms": round(w.start_ms, 1), "end_ms": round(w.end_ms, 1)}
            for w in chunk.words]
