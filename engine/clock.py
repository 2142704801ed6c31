"""Each engine request's handle and playback clock, and the look-ahead rules built on it.

This module owns what the engine knows about one submitted request between
`submit` and its last chunk (`RequestHandle`: its bounded output queue and its
playback clock) and the look-ahead bookkeeping the loop schedules by: which
new requests to prepare first (`take_incoming`), when each request's next
piece is due (`set_dues`), whether a request is far enough ahead to run only
in idle time (`is_ahead`), and how long the loop may sleep before a clock
makes a request runnable again (`next_wake_s`). A request's clock starts when
its first audio is due: when the audio before it in its context runs out, or,
with nothing before it, at `request.deadline`; it never runs past what its
consumer has taken; the lead, audio made but not yet heard, gives the next
piece's deadline (docs/architecture.md, "The backpressure story").
Everything here runs on the event loop; the engine (engine.engine) owns the
thread contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from engine.backend import BackendRequest
from engine.types import AudioChunk, RequestId, SynthesisRequest, estimate_audio_s

#: chunks a request's output queue holds; a request whose queue is full is not stepped
QUEUE_DEPTH = 16


class RequestHandle:
    """One submitted request: its output queue and its playback clock.

    The clock: audio `made_s` (routed), `taken_s` (read by the consumer), and
    the start of playback (`start`). Before the consumer has taken anything,
    the start is the predicted end of the request before it in its context
    (its audio made once finished, else the backend's estimate `est_s`, else a
    guess from its text), or the request's deadline when nothing is before it;
    once audio is taken it is frozen no earlier than that moment. The engine's
    own prediction wins over the deadline the gateway guessed from the text: a
    guess too early makes a segment due seconds before its listener can hear
    it, and the earliest-deadline order then serves it before listeners about
    to run dry (docs/benchmarks.md, "The burst"). Heard audio is the time
    since the start, never more than what was taken (a reader that stops
    reading stops its clock).

    A listener that ran out of audio (everything made was taken and played)
    waits: its lead is negative, how long ago it ran dry, so the earliest
    deadline goes to whoever has waited longest (a new turn's first piece is
    due at its deadline). When audio comes again the listener resumes there:
    the start moves on by the wait, as a player does after a gap.
    """

    __slots__ = ("est_s", "is_cancelled", "is_done", "is_finished", "made_s", "prev", "queue",
                 "request", "started_at", "taken_s")

    def __init__(self, request: SynthesisRequest, prev: RequestHandle | None) -> None:
        self.request = request
        self.queue: asyncio.Queue[AudioChunk | BaseException | None] = asyncio.Queue(QUEUE_DEPTH)
        self.is_cancelled = False
        self.is_done = False
        self.is_finished = False  # its last audio was made
        self.prev = prev  # the request before it in its context, until its clock is frozen
        self.est_s = 0.0  # the backend's estimate of its audio, once prepared
        self.made_s = 0.0
        self.taken_s = 0.0
        self.started_at: float | None = None  # frozen start, once audio was taken

    def start(self) -> float:
        if self.started_at is not None:
            return self.started_at
        prev = self.prev
        if prev is None or prev.is_cancelled:
            return self.request.deadline
        if prev.is_finished:
            length = prev.made_s
        elif prev.est_s > 0.0:  # the backend's estimate: exact once it knows the segment's frames
            length = max(prev.made_s, prev.est_s)
        else:  # not prepared yet: the gateway's guess from the text
            length = max(prev.made_s, estimate_audio_s(prev.request.text, prev.request.params.speed))
        return prev.start() + length

    def took(self, chunk: AudioChunk, now: float) -> None:
        if self.started_at is None:
            self.started_at = max(self.start(), now)
            self.prev = None  # the chain is no longer needed: let finished requests go
        elif now - self.started_at > self.taken_s:
            self.started_at = now - self.taken_s  # the listener ran dry and resumes now
        self.taken_s += chunk.duration_ms / 1000.0

    def lead(self, now: float) -> float:
        """Seconds until this request's listener runs out of audio (negative: ran out that long ago)."""
        start = self.start()
        elapsed = now - start
        if elapsed > self.taken_s and self.made_s <= self.taken_s + 1e-9:
            return self.taken_s - elapsed  # dry: everything made was taken and played
        heard = min(max(elapsed, 0.0), self.taken_s)
        return max(-elapsed, 0.0) + self.made_s - heard


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
    for item in items:
        handle = handles.get(item.request_id)
        if handle is not None:
            item.due = now + handle.lead(now)  # in the past for a listener already waiting


def is_ahead(handle: RequestHandle | None, now: float, horizon: float) -> bool:
    """Whether a request's lead reached the look-ahead (it then runs only in idle time)."""
    return handle is not None and handle.lead(now) >= horizon


def next_wake_s(items: Iterable[BackendRequest], handles: Mapping[RequestId, RequestHandle],
                now: float, horizon: float) -> float | None:
    """Seconds until some request's lead falls under the look-ahead (None: only events wake)."""
    waits = []
    for item in items:
        handle = handles.get(item.request_id)
        if handle is None or handle.queue.full():
            continue
        unread = handle.made_s - handle.taken_s
        if unread >= horizon:
            continue  # its reader must take audio first: the read wakes the loop
        waits.append(handle.lead(now) - horizon)
    return max(min(waits), 0.005) if waits else None
