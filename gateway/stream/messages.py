"""Wire messages: parsing and validating client frames, building and encoding server frames.

PROTOCOL.md, "Client -> server" and "Server -> client". Client frames are JSON
text or msgpack binary carrying the same objects; every failure here raises a
ProtocolError whose message says what was expected and what came. Every
server event is built by one constructor below (`session_ready`, `segment`,
`audio`, `cancelled`...), so its fields are spelled in one place; `error`
events come from `gateway.errors.error_message`, the one exception mapping.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import msgpack

from engine.types import WordTiming
from gateway.audio.formats import (
    CODECS,
    FRAME_MS,
    MAX_OPUS_BITRATE,
    MAX_SPEED,
    MIN_OPUS_BITRATE,
    MIN_SPEED,
    SAMPLE_RATES,
)
from gateway.errors import ProtocolError

PROTOCOL_VERSION = 1
CONTEXT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

ENCODINGS = ("json", "msgpack")
AUDIO_AS = ("binary", "base64")
PACINGS = ("asap", "realtime")


@dataclass(slots=True)
class Limits:
    """Per-session limits, announced in `session.ready`."""

    max_message_bytes: int = 65536
    max_text_per_context: int = 50000
    max_open_contexts: int = 16
    idle_timeout_s: float = 300.0
    #: an open context that gets no text for this long is flushed (docs/protocol.md, "A turn")
    context_idle_timeout_s: float = 20.0
    max_send_buffer_bytes: int = 4 * 1024 * 1024
    slow_consumer_timeout_s: float = 10.0
    #: token buckets per socket: sustained rate, with bursts of `burst_s` seconds' worth
    max_text_chars_per_s: float = 4000.0
    max_messages_per_s: float = 400.0
    burst_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_text_per_context", "max_open_contexts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if self.context_idle_timeout_s <= 0:
            raise ValueError(f"context_idle_timeout_s must be > 0, got {self.context_idle_timeout_s}")
        if self.max_text_chars_per_s <= 0 or self.max_messages_per_s <= 0 or self.burst_s <= 0:
            raise ValueError("rate limits must be > 0")

    def to_wire(self) -> dict[str, Any]:
        return {"max_message_bytes": self.max_message_bytes,
                "max_text_per_context": self.max_text_per_context,
                "max_open_contexts": self.max_open_contexts,
                "idle_timeout_s": self.idle_timeout_s,
                "context_idle_timeout_s": self.context_idle_timeout_s,
                "max_text_chars_per_s": self.max_text_chars_per_s,
                "max_messages_per_s": self.max_messages_per_s}


@dataclass(slots=True)
class SessionOptions:
    """The effective options of a session (PROTOCOL.md `session.update`)."""

    voice: str = "joe"
    language: str | None = None
    instructions: str | None = None
    speed: float = 1.0
    codec: str = "opus"
    sample_rate: int = 48000
    bitrate: int | None = None
    frame_ms: int = 20
    encoding: str = "json"
    audio_as: str = "binary"
    pacing: str = "asap"
    max_buffer_delay_ms: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("extra")
        return out


def _expect(value: Any, kind: type | tuple[type, ...], name: str) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python, never on the wire.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError("bad_message",
                            f"{name} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _number(value: Any, name: str) -> float:
    """A finite number as a float: JSON's 1e400 (inf), msgpack's NaN and a 400-digit
    integer (too large for a float) are refused like any other wrong type."""
    _expect(value, (int, float), name)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ProtocolError("bad_message", f"{name} must be a finite number, got {str(value)[:40]}")
    return number


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
             "NoneType": "null", "dict": "an object"}
    return " or ".join(names.get(k.__name__, k.__name__) for k in kinds)


def _choice(value: Any, choices: tuple[Any, ...], name: str) -> Any:
    if value not in choices:
        raise ProtocolError("unsupported_option",
                            f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


def apply_update(options: SessionOptions, fields: dict[str, Any],
                 voice_ids: Collection[str]) -> SessionOptions:
    """Validate a `session.update` (or query parameters) against the current options.

    `voice_ids` are the voices a session may choose now (the voice catalog's listing).
    """
    changes: dict[str, Any] = {}
    for key, value in fields.items():
        if key == "type":
            continue
        if key == "voice":
            _expect(value, str, "voice")
            if value not in voice_ids:
                known = ", ".join(sorted(voice_ids)[:20])
                raise ProtocolError("unknown_voice", f"unknown voice {value!r}; expected one of: {known}")
        elif key in ("language", "instructions"):
            _expect(value, (str, type(None)), key)
        elif key == "speed":
            value = _number(value, "speed")
            if not MIN_SPEED <= value <= MAX_SPEED:
                raise ProtocolError("unsupported_option",
                                    f"speed must be within {MIN_SPEED}-{MAX_SPEED}, got {value:g}")
        elif key == "codec":
            _choice(_expect(value, str, "codec"), CODECS, "codec")
        elif key == "sample_rate":
            _choice(_expect(value, int, "sample_rate"), SAMPLE_RATES, "sample_rate")
        elif key == "bitrate":
            _expect(value, (int, type(None)), "bitrate")
            if value is not None and not MIN_OPUS_BITRATE <= value <= MAX_OPUS_BITRATE:
                raise ProtocolError("unsupported_option", "bitrate must be within "
                                    f"{MIN_OPUS_BITRATE}-{MAX_OPUS_BITRATE}, got {str(value)[:40]}")
        elif key == "frame_ms":
            _choice(_expect(value, int, "frame_ms"), FRAME_MS, "frame_ms")
        elif key == "encoding":
            _choice(_expect(value, str, "encoding"), ENCODINGS, "encoding")
        elif key == "audio_as":
            _choice(_expect(value, str, "audio_as"), AUDIO_AS, "audio_as")
        elif key == "pacing":
            _choice(_expect(value, str, "pacing"), PACINGS, "pacing")
        elif key == "max_buffer_delay_ms":
            _expect(value, int, "max_buffer_delay_ms")
            if not 0 <= value <= 60000:
                raise ProtocolError("unsupported_option",
                                    f"max_buffer_delay_ms must be within 0-60000, got {str(value)[:40]}")
        else:
            raise ProtocolError("unsupported_option", f"unknown option {key!r}")
        changes[key] = value
    updated = replace(options, **changes)
    if updated.codec == "mulaw":
        updated.sample_rate = 8000
    return updated


@dataclass(slots=True)
class TokenBucket:
    """A rate limit with bursts; time is passed in."""

    rate: float
    capacity: float
    tokens: float = -1.0
    updated: float = 0.0

    def take(self, amount: float, now: float) -> bool:
        if self.tokens < 0:
            self.tokens, self.updated = self.capacity, now
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if amount > self.tokens:
            return False
        self.tokens -= amount
        return True


# -- client messages --------------------------------------------------------

def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of range for a number")
    return value


def decode_json(raw: str | bytes) -> Any:
    """Strict JSON: no NaN or Infinity (Python's json takes them; JSON has none), and
    numbers that overflow a float (1e400) refused. Raises ValueError, RecursionError
    (deep nesting) or UnicodeDecodeError."""
    return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)


def decode_frame(raw: str | bytes, max_bytes: int) -> dict[str, Any]:
    """Parse one client frame into a message object with a string `type`."""
    size = len(raw.encode("utf-8")) if isinstance(raw, str) else len(raw)
    if size > max_bytes:
        raise ProtocolError("message_too_large", f"message is {size} bytes; the limit is {max_bytes}")
    kind = "JSON" if isinstance(raw, str) else "msgpack"
    try:
        if isinstance(raw, str):
            # A frame nested thousands deep makes the parser raise RecursionError
            # (msgpack: StackError); both are bad frames, not server faults.
            message = decode_json(raw)
        else:
            message = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, RecursionError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            TypeError) as exc:
        raise ProtocolError("bad_message", f"frame is not valid {kind}: {str(exc)[:200]}") from None
    if not isinstance(message, dict):
        raise ProtocolError("bad_message", f"a message must be an object, got {type(message).__name__}")
    if not isinstance(message.get("type"), str):
        raise ProtocolError("bad_message", "a message needs a string field 'type'")
    return message


def context_id_of(message: dict[str, Any], *, required: bool) -> str | None:
    value = message.get("context_id")
    if value is None:
        if required:
            raise ProtocolError("bad_message", f"'{message['type']}' needs a string field 'context_id'")
        return None
    if not isinstance(value, str):
        raise ProtocolError("bad_message", f"context_id must be a string, got {type(value).__name__}")
    if not CONTEXT_ID.fullmatch(value):
        raise ProtocolError("bad_context_id",
                            "context_id must be 1-64 characters of [A-Za-z0-9._:-], got "
                            f"{value[:80]!r}")
    return value


def text_fields(message: dict[str, Any]) -> tuple[str, str, bool]:
    """A `text` message's (context_id, text, flush), each checked."""
    context_id = context_id_of(message, required=True)
    assert context_id is not None
    text = message.get("text")
    if not isinstance(text, str):
        raise ProtocolError("bad_message", f"text must be a string, got {type(text).__name__}",
                            context_id=context_id)
    flush = message.get("flush", False)
    if not isinstance(flush, bool):
        raise ProtocolError("bad_message", f"flush must be a boolean, got {type(flush).__name__}")
    return context_id, text, flush


def optional_ms(message: dict[str, Any], name: str) -> float | None:
    value = message.get(name)
    if value is None:
        return None
    number = _number(value, name)
    if number < 0:
        raise ProtocolError("bad_message", f"{name} must be >= 0, got {number:g}")
    return number


# -- server messages: one constructor per event ------------------------------

def session_ready(session_id: str, options: SessionOptions, limits: Limits) -> dict[str, Any]:
    return {"type": "session.ready", "session_id": session_id, "protocol": PROTOCOL_VERSION,
            "options": options.to_wire(), "limits": limits.to_wire()}


def session_updated(options: SessionOptions) -> dict[str, Any]:
    return {"type": "session.updated", "options": options.to_wire()}


def segment(context_id: str, segment_id: int, text: str, pts_ms: float, duration_ms: float | None,
            words: list[WordTiming] | None) -> dict[str, Any]:
    """Sent just before a segment's first audio; `duration_ms` when known (one-chunk segments)."""
    return {"type": "segment", "context_id": context_id, "segment_id": segment_id, "text": text,
            "pts_ms": round(pts_ms, 1),
            "duration_ms": None if duration_ms is None else round(duration_ms, 1),
            "words": None if words is None else [
                {"word": w.word, "start_ms": round(w.start_ms, 1), "end_ms": round(w.end_ms, 1)}
                for w in words]}


def audio(context_id: str, seq: int, pts_ms: float, duration_ms: float, codec: str,
          payloads: list[bytes]) -> dict[str, Any]:
    """Opus packets travel as a list (`packets`); PCM16 and mu-law frames joined (`data`)."""
    message: dict[str, Any] = {"type": "audio", "context_id": context_id, "seq": seq,
                               "pts_ms": round(pts_ms, 3), "duration_ms": duration_ms, "codec": codec}
    if codec == "opus":
        message["packets"] = payloads
    else:
        message["data"] = b"".join(payloads)
    return message


def context_done(context_id: str, audio_ms: float, num_segments: int) -> dict[str, Any]:
    return {"type": "context.done", "context_id": context_id, "audio_ms": round(audio_ms, 1),
            "segments": num_segments}


def cancelled(context_id: str | None, *, audio_ms_sent: float | None, played_ms: float | None,
              spoken_text: str | None, unspoken_text: str | None) -> dict[str, Any]:
    """`audio_ms_sent` and the texts are None when a context was already closed (nothing stopped)."""
    return {"type": "cancelled", "context_id": context_id,
            "audio_ms_sent": None if audio_ms_sent is None else round(audio_ms_sent, 1),
            "played_ms": played_ms, "spoken_text": spoken_text, "unspoken_text": unspoken_text}


def encode_event(message: dict[str, Any], encoding: str) -> str | bytes:
    """An event frame in the session's encoding."""
    if encoding == "msgpack":
        return bytes(msgpack.packb(message, use_bin_type=True))
    return encode_json(message)


def encode_json(message: dict[str, Any]) -> str:
    """A JSON text frame (before a session exists, or for clients that asked for JSON).

    allow_nan=False: NaN and Infinity are not JSON, and a reply must parse
    anywhere; every number a client sends is checked finite (`_number`), so
    this raising is a bug, reported as one (the connection closes with 1011).
    """
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_audio(message: dict[str, Any], options: SessionOptions) -> str | bytes:
    """Audio is binary msgpack in both encodings, or base64 JSON when asked for."""
    if options.encoding == "json" and options.audio_as == "base64":
        out = dict(message)
        if "packets" in out:
            out["packets"] = [base64.b64encode(p).decode("ascii") for p in out["packets"]]
        if "data" in out:
            out["data"] = base64.b64encode(out["data"]).decode("ascii")
        return json.dumps(out, separators=(",", ":"), allow_nan=False)
    return bytes(msgpack.packb(message, use_bin_type=True))
