"""Frames on the wire: server events decoded once into typed objects, client messages encoded.

docs/protocol.md, "Messages". Events come as JSON text frames or msgpack
binary frames (audio is msgpack in both encodings, or base64 JSON when asked
for with `audio_as: base64`, the way for a client without msgpack). Every
event carries `received_at`, the event loop's clock when its frame was read,
so that playback clocks and latencies are measured at arrival, not when a
consumer got round to it.

Events are plain slotted objects, not frozen ones: an `Audio` is built for
every frame (tens per second per turn, hundreds of turns in the load tool),
and a frozen dataclass's constructor costs several times more. Treat them as
read-only.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

try:
    import msgpack
except ImportError:  # the client works without it: events in JSON, audio as base64
    msgpack = None

HAS_MSGPACK = msgpack is not None
_unpackb = None if msgpack is None else msgpack.unpackb


@dataclass(slots=True)
class Word:
    """A word's timing, in ms from the start of its turn's audio."""

    word: str
    start_ms: float
    end_ms: float


@dataclass(slots=True)
class Ready:
    """`session.ready`: the session's id, its effective options and its limits."""

    session_id: str
    options: dict[str, Any]
    limits: dict[str, Any]
    received_at: float


@dataclass(slots=True)
class Updated:
    """`session.updated`: the options now in force."""

    options: dict[str, Any]
    received_at: float


@dataclass(slots=True)
class Segment:
    """`segment`: text about to be spoken, where its audio starts, its words' timings
    (relative to the turn, unlike the wire's, which are relative to the segment)."""

    context_id: str
    segment_id: int
    text: str
    pts_ms: float
    duration_ms: float | None
    words: list[Word] | None
    received_at: float


@dataclass(slots=True)
class Audio:
    """`audio` as it came: Opus `packets`, or PCM16 / mu-law `data`."""

    context_id: str
    seq: int
    pts_ms: float
    duration_ms: float
    codec: str
    packets: list[bytes] | None
    data: bytes | None
    received_at: float


@dataclass(slots=True)
class TextSkipped:
    """`text.skipped`: text no voice could say (docs/protocol.md, "Languages")."""

    context_id: str
    segment_id: int
    offset: int | None
    text: str
    reason: str
    language: str
    received_at: float


@dataclass(slots=True)
class Done:
    """`context.done`: all of the turn's audio was sent."""

    context_id: str
    audio_ms: float
    num_segments: int
    received_at: float


@dataclass(slots=True)
class Cancelled:
    """`cancelled`: the answer to a `cancel`; what the listener heard and what it did not."""

    context_id: str | None
    audio_ms_sent: float | None
    played_ms: float | None
    spoken_text: str | None
    unspoken_text: str | None
    received_at: float


@dataclass(slots=True)
class Error:
    """`error`: a protocol error code and its message (errors.server_error raises it)."""

    code: str
    message: str
    context_id: str | None
    fatal: bool
    received_at: float


Event = Ready | Updated | Segment | Audio | TextSkipped | Done | Cancelled | Error


class BadFrame(ValueError):
    """A server frame this client cannot read (logged and dropped, never fatal)."""


def decode(frame: str | bytes, received_at: float) -> Event | None:
    """One server frame as its event; None for an event type this client does not know
    (a newer server's), so that it is skipped, not fatal. Raises BadFrame."""
    try:
        if isinstance(frame, bytes):
            if _unpackb is None:
                raise BadFrame("a binary (msgpack) frame came, and msgpack is not installed: "
                               "pip install msgpack, or ask for encoding json, audio_as base64")
            m = _unpackb(frame)
            if m["type"] == "audio":  # the hot path: nearly every frame is binary audio
                return Audio(m["context_id"], m["seq"], m["pts_ms"], m["duration_ms"],
                             m["codec"], m.get("packets"), m.get("data"), received_at)
        else:
            m = json.loads(frame)
            if m["type"] == "audio":  # audio_as base64
                packets, data = m.get("packets"), m.get("data")
                return Audio(m["context_id"], m["seq"], m["pts_ms"], m["duration_ms"],
                             m["codec"],
                             None if packets is None else [base64.b64decode(p) for p in packets],
                             None if data is None else base64.b64decode(data), received_at)
        return _decode_event(m["type"], m, received_at)
    except BadFrame:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise BadFrame(f"unreadable server frame: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001  (msgpack's own: ExtraData, FormatError...)
        raise BadFrame(f"unreadable server frame: {type(exc).__name__}: {exc}") from None


def _decode_event(kind: str, m: dict[str, Any], at: float) -> Event | None:
    if kind == "segment":
        pts = m["pts_ms"]
        words = m.get("words")
        return Segment(m["context_id"], m["segment_id"], m["text"], pts, m.get("duration_ms"),
                       None if words is None else [
                           Word(w["word"], pts + w["start_ms"], pts + w["end_ms"]) for w in words],
                       at)
    if kind == "context.done":
        return Done(m["context_id"], m["audio_ms"], m.get("segments", 0), at)
    if kind == "cancelled":
        return Cancelled(m.get("context_id"), m.get("audio_ms_sent"), m.get("played_ms"),
                         m.get("spoken_text"), m.get("unspoken_text"), at)
    if kind == "text.skipped":
        return TextSkipped(m["context_id"], m["segment_id"], m.get("offset"), m["text"],
                           m.get("reason", ""), m.get("language", ""), at)
    if kind == "error":
        context_id = m.get("context_id")
        return Error(str(m.get("code", "internal")), str(m.get("message", "")),
                     context_id if isinstance(context_id, str) else None,
                     bool(m.get("fatal", False)), at)
    if kind == "session.ready":
        return Ready(m["session_id"], m.get("options", {}), m.get("limits", {}), at)
    if kind == "session.updated":
        return Updated(m.get("options", {}), at)
    return None


def encode(message: dict[str, Any], binary: bool) -> str | bytes:
    """A client message as a frame: msgpack (binary) or JSON text."""
    if binary:
        assert msgpack is not None, "binary frames need msgpack"
        return bytes(msgpack.packb(message))
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))
