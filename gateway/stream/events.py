"""Server events: one frozen type per event, and the encoders that put them on the wire.

docs/protocol.md, "A turn", "Barge-in" and "Errors". Each event spells its
wire fields in one place, its `to_wire()`; code that reads an event back (the
vendor adapters translate `segment`, `audio`, `context.done` and `error`)
reads its attributes. The `error` event, `ErrorEvent`, comes from
`gateway.errors.error_message`, the one exception mapping.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from engine.types import WordTiming
from gateway.errors import ErrorEvent
from gateway.stream.options import Limits, SessionOptions

PROTOCOL_VERSION = 1


@dataclass(slots=True, frozen=True)
class SessionReady:
    """The first event after the handshake: the effective options and the limits."""

    type: ClassVar[str] = "session.ready"
    session_id: str
    options: SessionOptions
    limits: Limits

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "session_id": self.session_id, "protocol": PROTOCOL_VERSION,
                "options": self.options.to_wire(), "limits": self.limits.to_wire()}


@dataclass(slots=True, frozen=True)
class SessionUpdated:
    """The answer to `session.update`: the options now in force."""

    type: ClassVar[str] = "session.updated"
    options: SessionOptions

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "options": self.options.to_wire()}


@dataclass(slots=True, frozen=True)
class SegmentEvent:
    """Sent just before a segment's first audio; `duration_ms` when known (one-chunk segments)."""

    type: ClassVar[str] = "segment"
    context_id: str
    segment_id: int
    text: str
    pts_ms: float
    duration_ms: float | None
    words: list[WordTiming] | None

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "context_id": self.context_id, "segment_id": self.segment_id,
                "text": self.text, "pts_ms": round(self.pts_ms, 1),
                "duration_ms": None if self.duration_ms is None else round(self.duration_ms, 1),
                "words": None if self.words is None else [
                    {"word": w.word, "start_ms": round(w.start_ms, 1), "end_ms": round(w.end_ms, 1)}
                    for w in self.words]}


@dataclass(slots=True, frozen=True)
class AudioEvent:
    """Whole codec frames of a context: Opus packets travel as a list (`packets`), PCM16 and
    mu-law frames joined (`data`)."""

    type: ClassVar[str] = "audio"
    context_id: str
    seq: int
    pts_ms: float
    duration_ms: float
    codec: str
    payloads: tuple[bytes, ...]

    @property
    def data(self) -> bytes:
        """The frames joined (PCM16 or mu-law bytes)."""
        return b"".join(self.payloads)

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {"type": self.type, "context_id": self.context_id,
                                   "seq": self.seq,
                                   "pts_ms": round(self.pts_ms, 3), "duration_ms": self.duration_ms,
                                   "codec": self.codec}
        if self.codec == "opus":
            message["packets"] = list(self.payloads)
        else:
            message["data"] = self.data
        return message


@dataclass(slots=True, frozen=True)
class ContextDone:
    """All audio of the context was sent."""

    type: ClassVar[str] = "context.done"
    context_id: str
    audio_ms: float
    num_segments: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "context_id": self.context_id,
                "audio_ms": round(self.audio_ms, 1), "segments": self.num_segments}


@dataclass(slots=True, frozen=True)
class Cancelled:
    """The answer to `cancel`. `audio_ms_sent` and the texts are None when a context was
    already closed (nothing stopped)."""

    type: ClassVar[str] = "cancelled"
    context_id: str | None
    audio_ms_sent: float | None
    played_ms: float | None
    spoken_text: str | None
    unspoken_text: str | None

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "context_id": self.context_id,
                "audio_ms_sent": None if self.audio_ms_sent is None
                else round(self.audio_ms_sent, 1),
                "played_ms": self.played_ms, "spoken_text": self.spoken_text,
                "unspoken_text": self.unspoken_text}


@dataclass(slots=True, frozen=True)
class TextSkipped:
    """Text no voice of the server can say (docs/voices.md, "Languages"), sent where it falls:
    cut from inside segment `segment_id` at `offset` (characters of that segment's text, just
    after its `segment` event), or the whole of a segment that has no `segment` event (`offset`
    None), in order with the segments around it."""

    type: ClassVar[str] = "text.skipped"
    context_id: str
    segment_id: int
    offset: int | None
    text: str
    language: str
    reason: str = "language_unsupported"

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "context_id": self.context_id, "segment_id": self.segment_id,
                "offset": self.offset, "text": self.text, "reason": self.reason,
                "language": self.language}


Event = (SessionReady | SessionUpdated | SegmentEvent | AudioEvent | TextSkipped | ContextDone
         | Cancelled | ErrorEvent)


def encode_event(event: Event, encoding: str) -> str | bytes:
    """An event frame in the session's encoding."""
    if encoding == "msgpack":
        return bytes(msgpack.packb(event.to_wire(), use_bin_type=True))
    return encode_json(event.to_wire())


def encode_json(message: dict[str, Any]) -> str:
    """A JSON text frame (before a session exists, or for clients that asked for JSON).

    allow_nan=False: NaN and Infinity are not JSON, and a reply must parse
    anywhere; every number a client sends is checked finite
    (`options.finite_number`), so this raising is a bug, reported as one (the
    connection closes with 1011).
    """
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_audio(event: AudioEvent, options: SessionOptions) -> str | bytes:
    """Audio is binary msgpack in both encodings, or base64 JSON when asked for."""
    message = event.to_wire()
    if options.encoding == "json" and options.audio_as == "base64":
        if "packets" in message:
            message["packets"] = [base64.b64encode(p).decode("ascii") for p in message["packets"]]
        if "data" in message:
            message["data"] = base64.b64encode(message["data"]).decode("ascii")
        return json.dumps(message, separators=(",", ":"), allow_nan=False)
    return bytes(msgpack.packb(message, use_bin_type=True))
