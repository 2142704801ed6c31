"""Each engine request's handle and playback clock, each context's playback record, and the
look-ahead rules built on them.

This module owns every due time (docs/architecture.md, "The backpressure
story"). The gateway says only the order: which context a request belongs
to (`SynthesisRequest.context_key`: its segments play one after another, in
the order they are submitted) and which context's audio this context plays
after (`plays_after`); a request with nothing before it plays at once ("first
audio now": due at its submission). From that the engine knows when each
request's first audio is due: when the audio before it runs out, as the
engine itself counts it (`RequestHandle`, `PlaybackRecord`).

`RequestHandle` holds what the engine knows about one submitted request
between `submit` and its last chunk: its bounded output queue and its
playback clock. `PlaybackRecord` is a context's playback: its newest request
and the context it plays after, kept for the life of the admitted context
(until `release_context`), so a segment submitted after the ones before it
finished is still due when their audio runs out. The look-ahead bookkeeping
the loop schedules by: which new requests to prepare first
(`take_incoming`), when each request's next piece is due (`set_dues`),
whether a request is far enough ahead to run only in idle time
(`is_ahead`), and how long the loop may sleep before a clock makes a
request runnable again (`next_wake_s`). A clock never runs past what its
consumer has taken; the lead, audio made but not yet heard, gives the next
piece's due time. Everything here is read and changed under the request
table's lock (engine/requests.py), by the engine's loop thread and by the
consumer on the gateway's event loop; the engine (engine.engine) owns the
thread contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from engine.backend import BackendRequest
from engine.types import AudioChunk, RequestId, SynthesisRequest, estimate_audio_s

#: chunks a request's output queue holds; a request with this many unread is not stepped
QUEUE_DEPTH = 16


class RequestHandle:
    """One submitted request: its output queue and its playback clock.

    The clock: audio `made_s` (routed), `taken_s` (read by the consumer), and
    the start of playback (`start`). Before the consumer has taken anything,
    the start is where the audio before it ends: the end of the request before
    it in its context (`prev`; its audio made once it is done, else the
    backend's estimate `est_s`, else a guess from its text), or, for a
    context's first request, the end of the context it plays after (`after`),
    never before its own submission; with nothing before it, its submission
    (`submitted_at`). Once audio is taken the start is frozen, no earlier than
    that moment. The engine's own count is the only one: a guess of a
    segment's length from its text (the gateway's, when it timed requests) was
    a tenth of the audio for text the voice spells out, so a later segment came
    due seconds before anyone could hear it and took the lanes from listeners
    about to run dry (docs/benchmarks.md, "The burst"). Heard audio is the time since the
    start, never more than what was taken (a reader that stops reading stops
    its clock).

    A listener that ran out of audio (everything made was taken and played)
    waits: its lead is negative, how long ago it ran dry, so the earliest
    deadline goes to whoever has waited longest (a new turn's first piece is
    due at its submission). When audio comes again the listener resumes there:
    the start moves on by the wait, as a player does after a gap.

    The queue lives on the gateway's event loop and the engine routes from its own
    thread: chunks reach the queue a step at a time, after the step (engine/loop.py), so
    the engine bounds it by its own count, `num_unread` (routed, not yet taken), never by
    the queue's length. `is_closed`: the queue holds its terminal item (the end of a
    cancelled request, or an error); nothing is put after it.
    """

    __slots__ = ("after", "est_s", "is_cancelled", "is_closed", "is_done", "is_finished",
                 "made_s", "num_unread", "prev", "queue", "request", "started_at",
                 "submitted_at", "taken_s")

    def __init__(self, request: SynthesisRequest, submitted_at: float,
                 prev: RequestHandle | None = None, after: PlaybackRecord | None = None) -> None:
        self.request = request
        self.queue: asyncio.Queue[AudioChunk | BaseException | None] = asyncio.Queue(QUEUE_DEPTH)
        self.is_cancelled = False
        self.is_closed = False
        self.num_unread = 0  # chunks routed to the queue and not yet taken
        self.is_done = False  # no more audio will be made (finished, cancelled or failed)
        self.is_finished = False  # its last audio was made
        self.submitted_at = submitted_at
        self.prev = prev  # the request before it in its context, until its clock is frozen
        self.after = after  # a context's first request: the context it plays after, until frozen
        self.est_s = 0.0  # the backend's estimate of its audio, once prepared
        self.made_s = 0.0
        self.taken_s = 0.0
        self.started_at: float | None = None  # frozen start, once audio was taken

    def start(self) -> float:
        if self.started_at is not None:
            return self.started_at
        if self.prev is not None:
            return self.prev.end()
        before = self.after.end() if self.after is not None else None
        return self.submitted_at if before is None else max(self.submitted_at, before)

    def end(self) -> float:
        """When this request's audio will have played out, as the engine predicts it now."""
        if self.is_done:  # nothing more will be made: its length is what it made
            length = self.made_s
        elif self.est_s > 0.0:  # the backend's estimate: exact once it knows the segment's frames
            length = max(self.made_s, self.est_s)
        else:  # not prepared yet: a guess from the text
            guess = estimate_audio_s(self.request.text, self.request.params.speed)
            length = max(self.made_s, guess)
        return self.start() + length

    def took(self, chunk: AudioChunk, now: float) -> None:
        self.num_unread -= 1
        if self.started_at is None:
            self.started_at = max(self.start(), now)
            self.prev = self.after = None  # the chain is no longer needed: let finished requests go
        elif now - self.started_at > self.taken_s:
            self.started_at = now - self.taken_s  # the listener ran dry and resumes now
        self.taken_s += chunk.duration_ms / 1000.0

    def lead(self, now: float) -> float:
        """Seconds until this request's listener runs out of audio (negative: ran out that
        long ago)."""
        start = self.start()
        elapsed = now - start
        if elapsed > self.taken_s and self.made_s <= self.taken_s + 1e-9:
            return self.taken_s - elapsed  # dry: everything made was taken and played
        heard = min(max(elapsed, 0.0), self.taken_s)
        return max(-elapsed, 0.0) + self.made_s - heard


class PlaybackRecord:
    """A context's playback as the engine predicts it: its newest request (`last`) and, for its
    first, the context it plays after (`after`). Kept while the context is admitted, so its
    next segment is due when the audio before it runs out, finished or not."""

    __slots__ = ("after", "last")

    def __init__(self, after: PlaybackRecord | None = None) -> None:
        self.after = after
        self.last: RequestHandle | None = None

    def end(self) -> float | None:
        """When the context's audio submitted so far will have played out (None: nothing
        plays, or is to play, before a request that joins it)."""
        if self.last is not None:
            return self.last.end()
        return self.after.end() if self.after is not None else None

    def next_handle(self, request: SynthesisRequest, now: float) -> RequestHandle:
        """The handle of the context's next request: after its newest, or, the first, after the
        context it plays after."""
        handle = (RequestHandle(request, now, prev=self.last) if self.last is not None
                  else RequestHandle(request, now, after=self.after))
        self.last, self.after = handle, None  # the first request holds the context before now
        return handle


def take_incoming(incoming: list[RequestHandle], now: float, horizon: float,
                  limit: int) -> tuple[list[RequestHandle], list[RequestHandle]]:
    """The new requests to prepare now, and those left waiting.

    Due within the look-ahead (`horizon`), most urgent first, at most `limit`;
    cancelled ones are dropped from both.
    """
    live = [h for h in incoming if not h.is_cancelled]
    live.sort(key=lambda h: h.lead(now))
    urgent = [h for h in live if h.lead(now) < horizon]
    # Work beyond the look-ahead is prepared only when nothing urgent waits.
    fresh = (urgent or live)[:limit]
    taken = set(map(id, fresh))
    return fresh, [h for h in live if id(h) not in taken]


def set_dues(items: Iterable[BackendRequest], handles: Mapping[RequestId, RequestHandle],
             now: float) -> None:
    """Each request's next piece is due when its listener would run out of audio."""
    get = handles.get  # once a step for every request held: kept lean
    for item in items:
        handle = get(item.request.request_id)
        if handle is not None:
            item.due = now + handle.lead(now)  # in the past for a listener already waiting


def is_ahead(item: BackendRequest, now: float, horizon: float) -> bool:
    """Whether a request's lead reached the look-ahead (it then runs only in idle time), read
    from the due `set_dues` gave it at `now` (no lead is computed twice in a step)."""
    return item.due - now >= horizon


def next_wake_s(items: Iterable[BackendRequest], handles: Mapping[RequestId, RequestHandle],
                now: float, horizon: float) -> float | None:
    """Seconds until some request's lead falls under the look-ahead (None: only events wake)."""
    waits = []
    for item in items:
        handle = handles.get(item.request_id)
        if handle is None or handle.num_unread >= QUEUE_DEPTH:
            continue
        unread = handle.made_s - handle.taken_s
        if unread >= horizon:
            continue  # its reader must take audio first: the read wakes the loop
        waits.append(handle.lead(now) - horizon)
    return max(min(waits), 0.005) if waits else None
