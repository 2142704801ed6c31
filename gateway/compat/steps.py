"""The engine's time behind a context's audio, for a wire that reports it (sans-I/O).

Cartesia's chunk frames carry `step_time`, the server's processing time for
that chunk in milliseconds. The engine times its steps: each `AudioChunk`
carries `step_ms`, the wall time of the batch step that made it. A vendor
chunk is not an engine chunk, though: the playout re-frames a context's PCM
into codec frames on the context's own timeline (gateway/stream/playout.py).
So each engine chunk's step time is spread evenly over its own audio, and a
vendor chunk gets the share of every engine chunk it overlaps on that
timeline. The shares of a context's chunks add up to the engine time its
audio took, whatever the framing.

Which context a request speaks for comes with its `Submit`; where its audio
sits on that context's timeline comes from the session's `SegmentStarted`
note (its `pts_ms`); its chunks arrive in order. Audio only moves forward, so
a request whose audio is all behind the last chunk asked about is dropped:
the ledger holds the requests in flight and the few still being framed, not
the whole answer, and a context's end (or a cancel) drops what is left of it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.types import AudioChunk, RequestId


@dataclass(slots=True)
class _Request:
    context_id: str
    spans: list[tuple[float, float]] = field(default_factory=list)  # (audio ms, step ms), in order
    carry_ms: float = 0.0          # step time of chunks with no audio, given to the next span
    start_ms: float | None = None  # where its audio starts on its context's timeline
    is_complete: bool = False      # its last chunk came

    @property
    def audio_ms(self) -> float:
        return sum(audio for audio, _ in self.spans)


class EngineTime:
    """Step time per stretch of each context's audio (see the module doc)."""

    def __init__(self) -> None:
        self._requests: dict[RequestId, _Request] = {}
        # context -> its started requests, in order
        self._timelines: dict[str, deque[RequestId]] = {}

    def submitted(self, request_id: RequestId, context_id: str) -> None:
        """A request for `context_id` went to the engine: its chunks are counted from now on."""
        self._requests.setdefault(request_id, _Request(context_id))

    def made(self, chunk: AudioChunk) -> None:
        request = self._requests.get(chunk.request_id)
        if request is None:  # not submitted here, or already forgotten (cancelled)
            return
        audio_ms = chunk.duration_ms
        if audio_ms > 0:
            request.spans.append((audio_ms, chunk.step_ms + request.carry_ms))
            request.carry_ms = 0.0
        elif request.spans:  # an empty last chunk: its step made no audio of its own
            audio, step = request.spans[-1]
            request.spans[-1] = (audio, step + chunk.step_ms)
        else:
            request.carry_ms += chunk.step_ms
        request.is_complete = request.is_complete or chunk.is_last

    def started(self, context_id: str, request_id: RequestId, pts_ms: float) -> None:
        """The request's audio starts at `pts_ms` on `context_id`'s timeline."""
        request = self._requests.get(request_id)
        if request is None or request.start_ms is not None:
            return
        request.start_ms = pts_ms
        self._timelines.setdefault(context_id, deque()).append(request_id)

    def spent(self, context_id: str, pts_ms: float, duration_ms: float) -> float:
        """The engine time behind `context_id`'s audio from `pts_ms` for `duration_ms`."""
        timeline = self._timelines.get(context_id)
        if not timeline:
            return 0.0
        end_ms = pts_ms + duration_ms
        total = 0.0
        while timeline:  # requests wholly behind this stretch are done with
            first = self._requests.get(timeline[0])
            if first is not None and not (first.is_complete and first.start_ms is not None
                                          and first.start_ms + first.audio_ms <= pts_ms):
                break
            self._requests.pop(timeline.popleft(), None)
        for request_id in timeline:
            request = self._requests.get(request_id)
            if request is None or request.start_ms is None:
                continue
            if request.start_ms >= end_ms:
                break
            offset = request.start_ms
            for audio_ms, step_ms in request.spans:
                overlap = min(offset + audio_ms, end_ms) - max(offset, pts_ms)
                if overlap > 0:
                    total += step_ms * overlap / audio_ms
                offset += audio_ms
                if offset >= end_ms:
                    break
        return total

    def cancelled(self, request_id: RequestId) -> None:
        """A request that will bring no more audio."""
        self._requests.pop(request_id, None)

    def forget_context(self, context_id: str) -> None:
        """`context_id` is over (done or cancelled): every request of it is dropped."""
        self._timelines.pop(context_id, None)
        for request_id in [r for r, q in self._requests.items() if q.context_id == context_id]:
            del self._requests[request_id]

    def __len__(self) -> int:
        """Requests held (for tests: the ledger must not grow with the answer)."""
        return len(self._requests)
