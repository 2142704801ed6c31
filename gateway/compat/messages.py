"""Vendor client frames, decoded once into frozen messages, as the native ones are.

A vendor frame is sized and parsed by the native socket's own reader
(gateway/stream/messages.py, `decode_object`), then built here into its
vendor's message type, every field checked for its type, or refused with a
ProtocolError that says what was expected. The adapters read these types and
nothing else of the frame.

Keys follow each vendor's own API (docs/compat.md, "Keys"):

- **ElevenLabs and Cartesia are lenient.** Their messages carry many optional
  fields (`generation_config`, `model_id`, `language`, pronunciation
  dictionaries...) that their SDKs send and voxgate does not use; a key this
  module does not name is ignored, as those APIs ignore what they do not know.
- **Deepgram is strict.** Its API defines each message whole (`Speak` is
  `{type, text}`; `Flush`, `Clear` and `Close` are `{type}`), so any other key
  is `bad_message` naming it, as on the native socket.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.audio.formats import MAX_SPEED, MIN_SPEED
from gateway.compat.formats import OutputFormat, cartesia_format
from gateway.errors import ProtocolError
from gateway.stream.messages import check_fields
from gateway.stream.options import finite_number

MAX_VENDOR_ID_CHARS = 256


def _flag(obj: Mapping[str, Any], name: str, context_id: str | None = None) -> bool:
    """A boolean field; absent or null is false."""
    value = obj.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ProtocolError("bad_message", f"{name} must be a boolean, got {type(value).__name__}",
                            context_id=context_id)
    return value


def _text(obj: Mapping[str, Any], name: str, context_id: str | None = None) -> str | None:
    """A string field; None when absent."""
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise ProtocolError("bad_message", f"{name} must be a string, got {type(value).__name__}",
                            context_id=context_id)
    return value


def _vendor_id(value: Any) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_VENDOR_ID_CHARS:
        raise ProtocolError("bad_message", "context_id must be a string of 1-256 characters")
    return value


# -- ElevenLabs ----------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class ElevenLabsMessage:
    """One frame of `stream-input` or `multi-stream-input` (see the adapter for what each does).

    `text` None: absent; `speed` is `voice_settings.speed`, clamped to voxgate's range;
    `key` the `xi_api_key` (or `authorization: Bearer`) a first message may carry.
    """

    context_id: str = ""  # multi-stream-input's ("default" when absent); "" on stream-input
    text: str | None = None
    flush: bool = False
    close_context: bool = False
    close_socket: bool = False
    speed: float | None = None
    key: str | None = None


def decode_elevenlabs(obj: Mapping[str, Any], *, is_multi: bool) -> ElevenLabsMessage:
    context_id = _vendor_id(obj.get("context_id", "default")) if is_multi else ""
    named = context_id or None  # what an error names
    speed = None
    settings = obj.get("voice_settings")
    if settings is not None:
        if not isinstance(settings, dict):
            raise ProtocolError("bad_message", "voice_settings must be an object, got "
                                f"{type(settings).__name__}", context_id=named)
        if settings.get("speed") is not None:
            # a 400-digit integer would overflow float(): refused like NaN, as native options are
            speed = finite_number(settings["speed"], "voice_settings.speed")
            speed = min(MAX_SPEED, max(MIN_SPEED, speed))
    key = obj.get("xi_api_key")
    bearer = obj.get("authorization")
    if not isinstance(key, str) and isinstance(bearer, str) \
            and bearer.lower().startswith("bearer "):
        key = bearer[7:].strip()
    return ElevenLabsMessage(
        context_id, _text(obj, "text", named), _flag(obj, "flush", named),
        _flag(obj, "close_context", named), _flag(obj, "close_socket"), speed,
        key if isinstance(key, str) else None)


# -- Cartesia ------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class CartesiaMessage:
    """One generation request (or `cancel`) for context `context_id`.

    `voice` is the id of `voice: {mode: "id", id}`, `output` the parsed `output_format`
    and `max_buffer_delay_ms` the vendor's value (None: absent): a context's first
    message must carry the first two, and later ones may repeat them (they are ignored).
    """

    context_id: str
    is_cancel: bool = False
    transcript: str = ""
    is_continued: bool = False
    flush: bool = False
    voice: str | None = None
    output: OutputFormat | None = None
    max_buffer_delay_ms: int | None = None
    add_timestamps: bool = False


def decode_cartesia(obj: Mapping[str, Any]) -> CartesiaMessage:
    context_id = _vendor_id(obj.get("context_id"))
    try:
        if _flag(obj, "cancel"):
            return CartesiaMessage(context_id, is_cancel=True)
        return CartesiaMessage(
            context_id, transcript=_text(obj, "transcript") or "",
            is_continued=_flag(obj, "continue"), flush=_flag(obj, "flush"),
            voice=_voice(obj.get("voice")), output=_output(obj.get("output_format")),
            max_buffer_delay_ms=_delay(obj.get("max_buffer_delay_ms")),
            add_timestamps=_flag(obj, "add_timestamps"))
    except ProtocolError as exc:
        exc.context_id = context_id
        raise


def _voice(value: Any) -> str | None:
    if value is None:
        return None
    voice_id = value.get("id") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("mode", "id") != "id" \
            or not isinstance(voice_id, str):
        raise ProtocolError("unsupported_option", "voice must be {mode: \"id\", id: <voice>}; "
                            "embeddings are not offered")
    return voice_id


def _output(value: Any) -> OutputFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError("bad_message", "output_format must be an object {container, encoding, "
                            "sample_rate}")
    return cartesia_format(value)


def _delay(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ProtocolError("bad_message", "max_buffer_delay_ms must be an integer >= 0")
    return value


# -- Deepgram ------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class DeepgramSpeak:
    text: str


@dataclass(slots=True, frozen=True)
class DeepgramFlush:
    pass


@dataclass(slots=True, frozen=True)
class DeepgramClear:
    pass


@dataclass(slots=True, frozen=True)
class DeepgramClose:
    pass


DeepgramMessage = DeepgramSpeak | DeepgramFlush | DeepgramClear | DeepgramClose
_DEEPGRAM = {"Speak": ("text",), "Flush": (), "Clear": (), "Close": ()}


def decode_deepgram(obj: Mapping[str, Any]) -> DeepgramMessage:
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in _DEEPGRAM:
        raise ProtocolError("bad_message", f"unknown message type {str(kind)[:40]!r}; expected "
                            "Speak, Flush, Clear or Close")
    check_fields(obj, kind, _DEEPGRAM[kind])
    if kind == "Speak":
        text = obj.get("text")
        if not isinstance(text, str):
            raise ProtocolError("bad_message", "Speak needs a string field 'text'")
        return DeepgramSpeak(text)
    return DeepgramFlush() if kind == "Flush" else DeepgramClear() if kind == "Clear" \
        else DeepgramClose()
