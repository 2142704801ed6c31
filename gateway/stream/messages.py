"""Client messages: a frame decoded once, with strict keys, into a frozen message.

docs/protocol.md, "Client -> server". A frame is JSON text or msgpack binary
carrying the same object; `decode_message` checks its size, parses it, and
builds one of the message types below, or raises a ProtocolError whose
message says what was expected and what came. Keys are strict: a field a
message does not have (`"flsh": true`) is refused as `bad_message` naming it,
never ignored, so a misspelt flag cannot silently do nothing. In
`session.update` the fields are options; an unknown one is
`unsupported_option` (gateway/stream/options.py checks them).

The vendor adapters (gateway/compat) build these messages directly: one
vendor frame is decoded once, by its adapter, and never re-encoded.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from gateway.errors import ProtocolError
from gateway.stream.options import check_options, finite_number

CONTEXT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


@dataclass(slots=True, frozen=True)
class TextMessage:
    """A delta of a context's text (joined exactly as sent); `flush`: no more text comes."""

    context_id: str
    text: str
    flush: bool = False


@dataclass(slots=True, frozen=True)
class FlushMessage:
    """No more text comes for this context: speak what is buffered, then `context.done`."""

    context_id: str


@dataclass(slots=True, frozen=True)
class CancelMessage:
    """Barge-in: stop the context (every context when `context_id` is None) now."""

    context_id: str | None = None
    played_ms: float | None = None


@dataclass(slots=True, frozen=True)
class PlaybackMessage:
    """A player's progress report: how much of the context's audio was heard."""

    context_id: str
    played_ms: float


@dataclass(slots=True, frozen=True)
class SessionUpdate:
    """Options to change, by name (`options.check_options` checked each value)."""

    changes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class CloseMessage:
    """Finish every open context, then close the socket with 1000."""


ClientMessage = (TextMessage | FlushMessage | CancelMessage | PlaybackMessage | SessionUpdate
                 | CloseMessage)

#: each message type's fields besides `type` (session.update's are the options)
FIELDS: dict[str, tuple[str, ...]] = {
    "text": ("context_id", "text", "flush"),
    "flush": ("context_id",),
    "cancel": ("context_id", "played_ms"),
    "playback": ("context_id", "played_ms"),
    "close": (),
}
MESSAGE_TYPES = ("session.update", "text", "flush", "cancel", "playback", "close")


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


def decode_object(raw: str | bytes, max_bytes: int, *,
                  is_binary_json: bool = False) -> dict[str, Any]:
    """Parse one frame into an object, its size checked first: JSON text, msgpack binary
    (or JSON binary, `is_binary_json`: the vendor sockets, gateway/compat)."""
    size = len(raw.encode("utf-8")) if isinstance(raw, str) else len(raw)
    if size > max_bytes:
        raise ProtocolError("message_too_large",
                            f"message is {size} bytes; the limit is {max_bytes}")
    is_json = isinstance(raw, str) or is_binary_json
    try:
        if is_json:
            # A frame nested thousands deep makes the parser raise RecursionError
            # (msgpack: StackError); both are bad frames, not server faults.
            message = decode_json(raw)
        else:
            message = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, RecursionError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            TypeError) as exc:  # UnicodeDecodeError is a ValueError
        kind = "JSON" if is_json else "msgpack"
        raise ProtocolError("bad_message", f"frame is not valid {kind}: {str(exc)[:200]}") from None
    if not isinstance(message, dict):
        raise ProtocolError("bad_message",
                            f"a message must be an object, got {type(message).__name__}")
    return message


def decode_frame(raw: str | bytes, max_bytes: int) -> dict[str, Any]:
    """Parse one client frame into an object with a string `type` (not yet a message)."""
    message = decode_object(raw, max_bytes)
    if not isinstance(message.get("type"), str):
        raise ProtocolError("bad_message", "a message needs a string field 'type'")
    return message


def decode_message(raw: str | bytes, max_bytes: int) -> ClientMessage:
    """One client frame as its message (see the module doc)."""
    return parse_message(decode_frame(raw, max_bytes))


def parse_message(obj: dict[str, Any]) -> ClientMessage:
    """A decoded frame's object as its message; errors name the frame's context when it has one."""
    try:
        return _build(obj)
    except ProtocolError as exc:
        raw_id = obj.get("context_id")
        if exc.context_id is None and isinstance(raw_id, str):
            exc.context_id = raw_id
        raise


def _build(obj: dict[str, Any]) -> ClientMessage:
    kind: str = obj["type"]
    if kind == "session.update":
        return SessionUpdate(check_options({k: v for k, v in obj.items() if k != "type"}))
    if kind not in FIELDS:
        raise ProtocolError("bad_message", f"unknown message type {kind[:40]!r}; expected one of "
                            f"{', '.join(MESSAGE_TYPES)}")
    check_fields(obj, kind, FIELDS[kind])
    if kind == "text":
        context_id = context_id_of(obj, required=True)
        assert context_id is not None
        text = obj.get("text")
        if not isinstance(text, str):
            raise ProtocolError("bad_message", f"text must be a string, got {type(text).__name__}",
                                context_id=context_id)
        flush = obj.get("flush", False)
        if not isinstance(flush, bool):
            raise ProtocolError("bad_message",
                                f"flush must be a boolean, got {type(flush).__name__}")
        return TextMessage(context_id, text, flush)
    if kind == "flush":
        context_id = context_id_of(obj, required=True)
        assert context_id is not None
        return FlushMessage(context_id)
    if kind == "cancel":
        return CancelMessage(context_id_of(obj, required=False), optional_ms(obj, "played_ms"))
    if kind == "playback":
        context_id = context_id_of(obj, required=True)
        assert context_id is not None
        played_ms = optional_ms(obj, "played_ms")
        if played_ms is None:
            raise ProtocolError("bad_message", "'playback' needs a number field 'played_ms'")
        return PlaybackMessage(context_id, played_ms)
    return CloseMessage()


def check_fields(obj: Mapping[str, Any], kind: str, expected: Collection[str]) -> None:
    """A strict message: every key but `type` is one of `expected`, else `bad_message`
    naming the first that is not (the native socket's and Deepgram's rule)."""
    for key in obj:
        if key != "type" and key not in expected:
            wanted = ", ".join(expected) if expected else "no field besides 'type'"
            raise ProtocolError("bad_message", f"unknown field {str(key)[:40]!r} in {kind!r}; "
                                f"expected {wanted}")


def context_id_of(obj: dict[str, Any], *, required: bool) -> str | None:
    value = obj.get("context_id")
    if value is None:
        if required:
            raise ProtocolError("bad_message", f"'{obj['type']}' needs a string field 'context_id'")
        return None
    if not isinstance(value, str):
        raise ProtocolError("bad_message",
                            f"context_id must be a string, got {type(value).__name__}")
    if not CONTEXT_ID.fullmatch(value):
        raise ProtocolError("bad_context_id",
                            "context_id must be 1-64 characters of [A-Za-z0-9._:-], got "
                            f"{value[:80]!r}")
    return value


def optional_ms(obj: dict[str, Any], name: str) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    number = finite_number(value, name)
    if number < 0:
        raise ProtocolError("bad_message", f"{name} must be >= 0, got {number:g}")
    return number
