"""A session's synthesis: its contexts' segments out to the engine, their audio back in.

The one synthesis path: the native socket, the vendor sockets and the HTTP
speech route all run it through their `Session` (docs/architecture.md, "The
session"), so a rule fixed here holds on every route.

`Synthesis` turns the segments each context's segmenter releases into engine
requests: it names them, submits them in playback order within the socket's
look-ahead window (`MAX_SEGMENTS_AHEAD`), takes engine capacity for a context
as its first segment goes (admission), and tells the engine where each
request's audio plays: its context, and the context it plays after (the
engine times every request from that, engine/clock.py).
Audio coming back is routed by request id to its segment, and
`frame_ready_audio` hands it to the context's playout in playback order,
announcing each segment as its audio starts. Each segment is routed by
language first (gateway/text/routing.py): it keeps the context's voice or
goes to the voice mapped for its language, and what no voice can say is
skipped, announced with `text.skipped` where it falls and sent to no engine.
The gateway computes no due time. As a segment's audio
starts and when it is all framed, a note (`SegmentStarted`, `SegmentFramed`)
says where it sits, for the routes that speak another wire. Like the
`Session` that holds it, it does no I/O and reads no clock; the
session decides what a refused admission or an engine error ends, and when
audio is released to the socket.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from engine.errors import VoxgateError
from engine.types import AudioChunk, RequestId, SamplingParams, SynthesisRequest
from gateway.errors import error_message
from gateway.stream.actions import (
    Action,
    Cancel,
    Observe,
    SegmentFramed,
    SegmentStarted,
    Send,
    Submit,
)
from gateway.stream.context import Context, Segment
from gateway.stream.events import SegmentEvent, TextSkipped
from gateway.text.routing import Languages, VoiceScripts, route

#: Backpressure (docs/architecture.md, "The backpressure story"): a fixed bound,
#: segments per session (a socket, or a speech request) with the engine or waiting to be
#: framed; the engine's look-ahead on each request's playback clock does the pacing within it.
MAX_SEGMENTS_AHEAD = 4


class Synthesis:
    """One socket's engine requests: named, admitted, submitted and routed back."""

    def __init__(self, session_id: str, *, admit: Callable[[str], None],
                 release: Callable[[str], None], languages: Languages | None = None) -> None:
        """`languages`: None speaks every segment with the context's voice, as it comes."""
        self.session_id = session_id
        self._admit = admit
        self._release = release
        self._by_request: dict[RequestId, Context] = {}
        self._request_ids = itertools.count()
        self._scripts = None if languages is None else VoiceScripts(languages.languages_of)
        self.voice_for = {} if languages is None else languages.voice_for  # the server's map

    def add_segments(self, context: Context, texts: list[str], now: float) -> None:
        """Queue the segments `context`'s segmenter released; `submit_ready` sends them."""
        for text in texts:
            request_id = RequestId(f"{self.session_id}:{next(self._request_ids)}")
            segment = Segment(len(context.segments), text, request_id, now,
                              voice=context.options.voice)
            if self._scripts is not None:
                routed = route(text, context.options.voice, context.voice_for, self._scripts)
                segment.text, segment.voice = routed.text, routed.voice
                segment.pieces = routed.pieces
                # nothing to say: no request; it passes in order, announcing what it skipped
                segment.is_skipped = segment.is_synthesized = not routed.text
            context.segments.append(segment)

    def submit_ready(self, contexts: dict[str, Context], now: float,
                     actions: list[Action]) -> list[Context]:
        """Submit queued segments as the look-ahead window allows; return the contexts refused.

        A context refused admission has its error appended to `actions`; the
        caller ends it.
        """
        # Backpressure (docs/architecture.md, "The backpressure story"): at most
        # MAX_SEGMENTS_AHEAD segments per socket are with the engine or waiting
        # to be framed, so a socket's PCM is bounded however many contexts it
        # opens; how far ahead each is made is the engine's look-ahead.
        in_flight = sum(1 for c in contexts.values() for s in c.segments
                        if s.is_submitted and not s.is_sent)
        refused: list[Context] = []
        for context in contexts.values():
            options = context.options
            for segment in context.segments:
                if segment.is_submitted or segment.is_skipped:
                    continue
                if in_flight >= MAX_SEGMENTS_AHEAD:
                    break
                if not context.is_admitted and not self._admit_context(context, actions):
                    refused.append(context)
                    break
                segment.is_submitted = True
                in_flight += 1
                self._by_request[segment.request_id] = context
                # `language` and `instructions` are for the context's own voice: a voice mapped
                # for another language speaks that one, and may take no instructions
                is_own = segment.voice == options.voice
                actions.append(Submit(SynthesisRequest(
                    segment.request_id, segment.text, segment.voice, context_key=context.key,
                    plays_after=_plays_after(contexts, context),
                    language=options.language if is_own else None,
                    instructions=options.instructions if is_own else None,
                    params=SamplingParams(speed=options.speed)), context.context_id))
        return refused

    def _admit_context(self, context: Context, actions: list[Action]) -> bool:
        """Take engine capacity for a context as its first segment goes to the engine.

        Refused (the engine is full: `busy`; this client holds its fair share:
        `rate_limited`), the context ends with that error; its later text is
        answered `context_closed`.
        """
        try:
            self._admit(context.key)
        except VoxgateError as exc:
            actions += [Send(error_message(exc, context.context_id)),
                        Observe("error:" + exc.code, 1)]
            return False
        context.is_admitted = True
        return True

    def receive_audio(self, chunk: AudioChunk) -> bool:
        """File `chunk` with its segment; False when no open context's segment awaits it."""
        context = self._by_request.get(chunk.request_id)
        if context is None or context.is_closed:
            return False
        segment = context.segment_for(chunk.request_id)
        if segment is None:
            return False
        segment.chunks.append(chunk)
        if chunk.words is not None:
            segment.words = chunk.words
        if chunk.is_last:
            segment.is_synthesized = True
            self._by_request.pop(chunk.request_id, None)
        return True

    def pop_request(self, request_id: RequestId) -> Context | None:
        """The context a failed request belonged to; the request is forgotten."""
        return self._by_request.pop(request_id, None)

    def cancel_pending(self, context: Context) -> list[Action]:
        """Cancel `context`'s requests still with the engine and forget them."""
        actions: list[Action] = [Cancel(r) for r in context.pending_requests()]
        for request_id in context.pending_requests():
            self._by_request.pop(request_id, None)
        return actions

    def release(self, context: Context) -> None:
        """Give back the engine capacity `context` took at admission, if it holds any."""
        if context.is_admitted:
            context.is_admitted = False
            self._release(context.key)


def _plays_after(contexts: dict[str, Context], context: Context) -> str:
    """The key of the context whose audio `context` plays after: the open one before it on the
    socket (contexts play one after another), or "" for the first (docs/architecture.md,
    "Deadline scheduling"). The engine reads it at a context's first request."""
    before = ""
    for other in contexts.values():
        if other is context:
            return before
        before = other.key
    return ""


def frame_ready_audio(context: Context, now: float, actions: list[Action]) -> None:
    """Hand the playout the received audio that may play next: segments in order."""
    playout = context.playout
    for segment in context.segments:
        if segment.is_sent:
            continue
        if segment.is_skipped:
            _announce_skipped(context, segment, actions)
        while segment.chunks:
            chunk = segment.chunks.popleft()
            if not segment.is_started:
                segment.is_started = True
                segment.pts_ms = playout.pcm_ms_framed
                # A streamed segment's words tile its audio: the last one ends with it.
                duration = (chunk.duration_ms if chunk.is_last
                            else chunk.words[-1].end_ms if chunk.words else None)
                actions.append(Send(SegmentEvent(context.context_id, segment.segment_id,
                                                 segment.text, segment.pts_ms, duration,
                                                 chunk.words)))
                actions.append(SegmentStarted(context.context_id, segment.segment_id,
                                              segment.request_id, segment.pts_ms))
                _announce_skipped(context, segment, actions)
                if not context.has_started:
                    context.has_started = True
                    actions.append(Observe("ttfa", now - segment.released_at))
            segment.audio_ms += chunk.duration_ms
            playout.push(chunk.pcm)
        if not segment.is_synthesized:
            return  # later segments wait: audio stays in playback order
        segment.is_sent = True
        if segment.is_started:
            words = None if segment.words is None else tuple(segment.words)
            actions.append(SegmentFramed(context.context_id, segment.segment_id, segment.text,
                                         segment.pts_ms, segment.audio_ms, words))
    if context.is_spoken():
        playout.finish()


def _announce_skipped(context: Context, segment: Segment, actions: list[Action]) -> None:
    """`text.skipped` for what `segment` skipped, where it fell (docs/protocol.md).

    Cut from inside a spoken segment: just after its `segment` event, with the
    offset in its text where the cut was; skipped whole: in its place, no offset.
    """
    offset = 0  # characters of `segment.text` before the piece
    for piece in segment.pieces:
        if not piece.is_skipped:
            words = piece.text.split()
            if words:
                offset += len(" ".join(words)) + (1 if offset else 0)
            continue
        actions += [Send(TextSkipped(context.context_id, segment.segment_id,
                                     None if segment.is_skipped else offset, piece.text,
                                     piece.language or "und")),
                    Observe("skipped:" + (piece.language or "und"), len(piece.text))]
