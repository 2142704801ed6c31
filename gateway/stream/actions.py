"""What the sans-I/O session asks its I/O loop to do: actions as frozen dataclasses.

`Session` returns a list of these from every call; `gateway/stream/endpoint.py` carries
them out in order (`Connection._execute`), and tests read them directly.

Two are notes, not work: `SegmentStarted` and `SegmentFramed` say where a
segment's audio sits in its context, for the shells that speak another wire
(the vendor sockets' alignments and engine time, gateway/compat). The native
loop has nothing to do for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.types import RequestId, SynthesisRequest, WordTiming
from gateway.stream.encoding import EncodeJob
from gateway.stream.events import AudioEvent, Event


@dataclass(slots=True, frozen=True)
class Send:
    """A server event for the socket, encoded in the session's encoding (audio as audio frames)."""

    message: Event

    @property
    def is_audio(self) -> bool:
        return isinstance(self.message, AudioEvent)


@dataclass(slots=True, frozen=True)
class SendFrame:
    """A frame already in its wire shape (the vendor sockets, gateway/compat, shape their own)."""

    frame: str | bytes


@dataclass(slots=True, frozen=True)
class Submit:
    """Start an engine request for context `context_id` and feed its chunks back to
    `Session.receive_audio`."""

    request: SynthesisRequest
    context_id: str


@dataclass(slots=True, frozen=True)
class Cancel:
    """Cancel an engine request; none of its audio reaches the session after this."""

    request_id: RequestId


@dataclass(slots=True, frozen=True)
class Close:
    """Close the socket with this code after what is queued."""

    code: int
    reason: str = ""


@dataclass(slots=True, frozen=True)
class Observe:
    """A measurement for metrics (name, value)."""

    name: str
    value: float


@dataclass(slots=True, frozen=True)
class SegmentStarted:
    """A note: segment `segment_id`'s audio starts at `pts_ms` of its context (its `segment`
    event goes out with it), made by engine request `request_id`."""

    context_id: str
    segment_id: int
    request_id: RequestId
    pts_ms: float


@dataclass(slots=True, frozen=True)
class SegmentFramed:
    """A note: all of a spoken segment's audio went to its context's playout, so its
    timings are final: from `pts_ms`, `audio_ms` long (sample for sample), `words` the
    engine's."""

    context_id: str
    segment_id: int
    text: str
    pts_ms: float
    audio_ms: float
    words: tuple[WordTiming, ...] | None


@dataclass(slots=True, frozen=True)
class Encode:
    """Run `job` off the event loop (gateway/stream/encoding.py), then hand it back to the
    session (`receive_encoded`) with the context it belongs to."""

    context_id: str
    job: EncodeJob


Action = (Send | SendFrame | Submit | Cancel | Close | Observe | SegmentStarted
          | SegmentFramed | Encode)
