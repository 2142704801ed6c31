"""A session's options and limits: what `session.update` and the query string may set.

docs/protocol.md, "Options". `SessionOptions` holds the effective options of a
session; `check_option` validates one option against the values the protocol
offers, `apply_update` applies a set of checked changes (and the voice list,
which only the session knows); `options_from_query` reads the handshake's query
string the same way. `Limits` are the per-session limits announced in
`session.ready`, and `TokenBucket` enforces the rate ones with the time passed
in. Every refusal is a ProtocolError saying what was expected and what came.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

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
from gateway.text.routing import normalize_voice_for
from gateway.voices.catalog import VoiceChoices, unknown_voice_message

ENCODINGS = ("json", "msgpack")
AUDIO_AS = ("binary", "base64")
PACINGS = ("asap", "realtime")
#: whole codec frames an `audio` message carries at most (`frames_per_message`): 5 by default
#: (100 ms of 20 ms Opus), up to a second of them for a client that reads fewer, larger messages
DEFAULT_FRAMES_PER_MESSAGE = 5
MAX_FRAMES_PER_MESSAGE = 50


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
    #: a vendor socket that may send its key in its first message (ElevenLabs) is closed when
    #: none came within this: it holds a place in the session cap meanwhile (not announced)
    auth_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_text_per_context", "max_open_contexts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if self.context_idle_timeout_s <= 0:
            raise ValueError("context_idle_timeout_s must be > 0, got "
                             f"{self.context_idle_timeout_s}")
        if self.max_text_chars_per_s <= 0 or self.max_messages_per_s <= 0 or self.burst_s <= 0:
            raise ValueError("rate limits must be > 0")
        if self.auth_timeout_s <= 0:
            raise ValueError(f"auth_timeout_s must be > 0, got {self.auth_timeout_s}")

    def to_wire(self) -> dict[str, Any]:
        return {"max_message_bytes": self.max_message_bytes,
                "max_text_per_context": self.max_text_per_context,
                "max_open_contexts": self.max_open_contexts,
                "idle_timeout_s": self.idle_timeout_s,
                "context_idle_timeout_s": self.context_idle_timeout_s,
                "max_text_chars_per_s": self.max_text_chars_per_s,
                "max_messages_per_s": self.max_messages_per_s}


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


class InputRates:
    """A session's two rate limits on what comes in: messages, and characters of text, per
    second, each with its burst (`Limits`; docs/protocol.md, "Limits")."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._messages = TokenBucket(limits.max_messages_per_s,
                                     limits.max_messages_per_s * limits.burst_s)
        self._text = TokenBucket(limits.max_text_chars_per_s,
                                 limits.max_text_chars_per_s * limits.burst_s)

    def take_message(self, now: float) -> None:
        """A message's place in the rate; raises `rate_limited` when none is left."""
        if not self._messages.take(1, now):
            raise ProtocolError("rate_limited", f"more than {self.limits.max_messages_per_s:g} "
                                "messages per second; the message was dropped")

    def take_text(self, text: str, now: float, context_id: str) -> None:
        """A delta's characters in the rate; raises `rate_limited` (the delta is dropped)."""
        if not self._text.take(len(text), now):
            raise ProtocolError("rate_limited",
                                f"more than {self.limits.max_text_chars_per_s:g} characters "
                                "of text per second; the delta was dropped", context_id=context_id)


@dataclass(slots=True)
class SessionOptions:
    """The effective options of a session (docs/protocol.md, "Options")."""

    voice: str = "joe"
    language: str | None = None
    instructions: str | None = None
    speed: float = 1.0
    codec: str = "opus"
    sample_rate: int = 48000
    bitrate: int | None = None
    frame_ms: int = 20
    frames_per_message: int = DEFAULT_FRAMES_PER_MESSAGE
    encoding: str = "json"
    audio_as: str = "binary"
    pacing: str = "asap"
    max_buffer_delay_ms: int = 0
    #: language -> the voice for segments the context's voice cannot speak, over the server's
    #: `--voice-for`; None: no voice (skipped). docs/voices.md, "Languages"
    voice_for: dict[str, str | None] = field(default_factory=dict)

    @property
    def voices(self) -> list[str]:
        """The voices a session holds for these options: its own, and those it maps to."""
        return [self.voice, *(v for v in self.voice_for.values() if v is not None)]

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


#: every option a `session.update` may carry, in the order the protocol lists them
OPTION_NAMES = tuple(f.name for f in fields(SessionOptions))


def _expect(value: Any, kind: type | tuple[type, ...], name: str) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python, never on the wire.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError("bad_message",
                            f"{name} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def finite_number(value: Any, name: str) -> float:
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


#: the options chosen from a list: their type on the wire, and the values offered
_CHOICES: dict[str, tuple[type, tuple[Any, ...]]] = {
    "codec": (str, CODECS), "sample_rate": (int, SAMPLE_RATES), "frame_ms": (int, FRAME_MS),
    "encoding": (str, ENCODINGS), "audio_as": (str, AUDIO_AS), "pacing": (str, PACINGS),
}


def check_option(key: Any, value: Any) -> Any:
    """One option's value, checked against what the protocol offers (the voice list aside:
    only the session knows it); an unknown option is `unsupported_option`."""
    if key == "voice":
        return _expect(value, str, "voice")
    if key in ("language", "instructions"):
        return _expect(value, (str, type(None)), key)
    if key == "speed":
        speed = finite_number(value, "speed")
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ProtocolError("unsupported_option",
                                f"speed must be within {MIN_SPEED}-{MAX_SPEED}, got {speed:g}")
        return speed
    if key in _CHOICES:
        kind, choices = _CHOICES[key]
        return _choice(_expect(value, kind, key), choices, key)
    if key == "bitrate":
        _expect(value, (int, type(None)), "bitrate")
        if value is not None and not MIN_OPUS_BITRATE <= value <= MAX_OPUS_BITRATE:
            raise ProtocolError("unsupported_option", "bitrate must be within "
                                f"{MIN_OPUS_BITRATE}-{MAX_OPUS_BITRATE}, got {str(value)[:40]}")
        return value
    if key == "voice_for":
        return _voice_for(value)
    if key == "frames_per_message":
        _expect(value, int, "frames_per_message")
        if not 1 <= value <= MAX_FRAMES_PER_MESSAGE:
            raise ProtocolError("unsupported_option", "frames_per_message must be within "
                                f"1-{MAX_FRAMES_PER_MESSAGE}, got {str(value)[:40]}")
        return value
    if key == "max_buffer_delay_ms":
        _expect(value, int, "max_buffer_delay_ms")
        if not 0 <= value <= 60000:
            raise ProtocolError("unsupported_option",
                                "max_buffer_delay_ms must be within 0-60000, got "
                                f"{str(value)[:40]}")
        return value
    raise ProtocolError("unsupported_option", f"unknown option {str(key)[:40]!r}; expected one of "
                        f"{', '.join(OPTION_NAMES)}")


def _voice_for(value: Any) -> dict[str, str | None]:
    """`{"zh": "voice-id", "ru": null}`: language tags to voice ids (null: none, skip it)."""
    _expect(value, dict, "voice_for")
    try:
        return normalize_voice_for(value)
    except ValueError as exc:
        raise ProtocolError("unsupported_option", str(exc)) from None


def check_options(changes: Mapping[Any, Any]) -> dict[str, Any]:
    """Every change checked (`check_option`), in the order given."""
    return {str(key): check_option(key, value) for key, value in changes.items()}


def apply_update(options: SessionOptions, changes: Mapping[str, Any],
                 voice_ids: Collection[str]) -> SessionOptions:
    """New options: `options` with `changes` applied, each checked.

    `voice_ids` are the voices a session may choose now (its view of the voice catalog).
    """
    checked = check_options(changes)
    voice = checked.get("voice")
    # the answer lists no voice: they may be a tenant's
    if voice is not None and voice not in voice_ids:
        raise ProtocolError("unknown_voice", unknown_voice_message(voice))
    for mapped in checked.get("voice_for", {}).values():
        if mapped is not None and mapped not in voice_ids:
            raise ProtocolError("unknown_voice", unknown_voice_message(mapped))
    updated = replace(options, **checked)
    if updated.codec == "mulaw":
        updated.sample_rate = 8000
    return updated


_INT_OPTIONS = ("sample_rate", "bitrate", "frame_ms", "frames_per_message", "max_buffer_delay_ms")
_QUERY_OPTIONS = ("voice", "language", "codec", "sample_rate", "bitrate", "frame_ms",
                  "frames_per_message", "encoding", "audio_as", "pacing", "speed",
                  "max_buffer_delay_ms")


def options_from_query(query: Mapping[str, str], base: SessionOptions,
                       voice_ids: Collection[str]) -> SessionOptions:
    """Initial options from the handshake's query string (all values arrive as text).

    Other query parameters (`api_key`, `token`...) are not options and are left alone.
    """
    changes: dict[str, Any] = {}
    for key in _QUERY_OPTIONS:
        if key not in query:
            continue
        raw = query[key]
        try:
            changes[key] = (int(raw) if key in _INT_OPTIONS
                            else float(raw) if key == "speed" else raw)
        except ValueError:
            raise ProtocolError("bad_message",
                                f"query parameter {key} must be a number, got {raw!r}") from None
    return apply_update(base, changes, voice_ids)


def hold_voices(catalog: VoiceChoices, *, hold: Iterable[str] = (),
                release: Iterable[str] = ()) -> None:
    """Hold the voices of `hold` in the catalog, then let go of those of `release` (a voice in
    both stays held throughout: a deleted one is not removed in between)."""
    for voice in hold:
        catalog.hold(voice)
    for voice in release:
        catalog.release(voice)
