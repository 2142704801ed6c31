"""ElevenLabs-compatible sockets: `/v1/text-to-speech/{voice_id}/stream-input` and
`.../multi-stream-input`.

Translation only (gateway/compat/core.py); docs/compat.md lists what differs
from the vendor. The rules that are ours:

- Text goes into voxgate's segmenter, which decides when a sentence is
  complete; `chunk_length_schedule` and `try_trigger_generation` are accepted
  and need nothing. `flush` speaks what is buffered (the context goes on).
  `auto_mode=true` (input arrives as whole sentences) releases buffered text
  after `AUTO_MODE_DELAY_MS` without more input.
- `close_context` right after a bare flush (a flush with no new text, the
  way Pipecat and LiveKit end a turn) lets the flushed text finish, then
  `isFinal`; any other `close_context` is a barge-in: the context's engine
  requests are cancelled at once, no more of its audio is sent, `isFinal`.
- `{"text": ""}` ends the input on `stream-input` (the socket closes with 1000
  after the last audio and `isFinal`); on `multi-stream-input` it is a keepalive.
- Alignment comes once per segment, when its timings are final (see
  gateway/compat/alignment.py); times are relative to the first aligned
  segment's start, and successive alignments tile the audio.
- The voice in the URL is resolved in the tenant of the key, so a socket whose
  key comes in its first message has its voice checked then, not before: a
  caller without a key learns nothing about voices. Until the key comes the
  socket speaks nothing, its frames take the native message rate, and after
  `Limits.auth_timeout_s` it is closed with 1008 and the vendor's error frame.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from starlette.websockets import WebSocket

from gateway.access.admission import Refused
from gateway.compat.alignment import Tracked, segment_chars
from gateway.compat.contexts import VendorContext
from gateway.compat.core import Authorize, VendorSession, vendor_json
from gateway.compat.endpoint import serve
from gateway.compat.formats import OutputFormat
from gateway.compat.formats import elevenlabs_format as parse_output_format
from gateway.compat.messages import ElevenLabsMessage, decode_elevenlabs
from gateway.errors import CLOSE_NORMAL, CLOSE_POLICY_VIOLATION, ProtocolError
from gateway.state import AppState
from gateway.stream.actions import Action, Close
from gateway.stream.options import SessionOptions
from gateway.voices.catalog import unknown_voice_message

AUTO_MODE_DELAY_MS = 50
DEFAULT_INACTIVITY_S, MAX_INACTIVITY_S = 20.0, 180.0
DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"  # the vendor's default
#: the error code of ElevenLabs' idle close, which clients match on (docs/compat.md)
INPUT_TIMEOUT = "input_timeout_exceeded"


@dataclass(slots=True)
class ElevenLabsContext(VendorContext):
    speed: float = 1.0
    is_bare_flush: bool = False  # the last message was a flush with no new text
    is_closing: bool = False     # `close_context` after a bare flush: finishing, takes no text


def _flag(query: Mapping[str, str], name: str, default: bool) -> bool:
    value = query.get(name)
    return default if value is None else value.lower() in ("1", "true", "yes")


class ElevenLabsSession(VendorSession[ElevenLabsContext, ElevenLabsMessage]):
    """One ElevenLabs socket; `is_multi` for multi-stream-input."""

    protocol = "elevenlabs"
    is_multi = False
    #: the URL's voice, while the key that resolves it has not come (first-message keys)
    pending_voice: str | None = None

    def _ids(self, vendor_id: str | None) -> dict[str, Any]:
        return {"contextId": vendor_id, "context_id": vendor_id} if self.is_multi else {}

    def error_frame(self, code: str, message: str, vendor_id: str | None, fatal: bool) -> Action:
        return vendor_json({"message": message, "error": code,
                            "code": CLOSE_POLICY_VIOLATION if fatal else 400,
                            **self._ids(vendor_id)})

    def idle_close(self, idle_s: float) -> list[Action]:
        """ElevenLabs' own close when no text came within `inactivity_timeout`: the
        `input_timeout_exceeded` error (no context id: it is the socket's), then 1008."""
        message = (f"No new text came within the inactivity timeout of {idle_s:g} s, so the input "
                   "was closed. Send text or a keepalive in time, or an empty text to end the "
                   "input.")
        return [vendor_json({"message": message, "error": INPUT_TIMEOUT,
                             "code": CLOSE_POLICY_VIOLATION}),
                Close(CLOSE_POLICY_VIOLATION, f"{INPUT_TIMEOUT}: no text within {idle_s:g} s")]

    def decode(self, obj: Mapping[str, Any]) -> ElevenLabsMessage:
        return decode_elevenlabs(obj, is_multi=self.is_multi)

    def handle(self, message: ElevenLabsMessage, now: float) -> list[Action]:
        if self.authorize is not None:
            return self._authorize(self.authorize, message, now)
        if message.close_socket:
            actions: list[Action] = []
            for vctx in list(self.vendor_contexts.values()):
                actions += self.cancel_vendor(vctx, now) + self.done_frames(vctx)
            return actions + self.close_session(now)
        vendor_id = message.context_id
        text = message.text or ""
        if self.is_multi and message.close_context:
            return self._close_context(vendor_id, now)
        if self.is_multi and text == "" and not message.flush:
            return []  # a keepalive, for the socket or one context: it opens nothing
        known = self.vendor_contexts.get(vendor_id)
        if known is None:
            speed = message.speed if message.speed is not None else self.options.speed
            vctx = self.open_vendor(ElevenLabsContext(vendor_id, self.output, speed=speed))
        else:
            vctx = known
            if message.speed is not None:
                vctx.speed = message.speed
        if vctx.is_closing:
            raise ProtocolError("context_closed", f"context {vendor_id[:64]!r} is closing; its "
                                "text is dropped", context_id=vendor_id)
        if text == "" and not message.flush:  # stream-input: the end of the input
            return self.end_vendor(vctx, now)
        vctx.is_bare_flush = message.flush and not text.strip()
        if not text.strip() and vctx.current is None:
            return self.flush_vendor(vctx, now)  # the init " ", or a flush with nothing open
        return self.push_text(vctx, text, now, flush=message.flush, options={"speed": vctx.speed})

    def _authorize(self, authorize: Authorize, message: ElevenLabsMessage,
                   now: float) -> list[Action]:
        """No key at the handshake: the first message must carry one (`xi_api_key`), which
        the socket's admission checks and counts the socket against from now on."""
        try:
            authorize(message.key)
        except Refused as refusal:
            return [self.error_frame(refusal.code, refusal.message, None, True),
                    Close(refusal.close_code, refusal.code)]
        self.authorize = None
        actions: list[Action] = []
        if self.pending_voice is not None:  # the key's tenant resolves the URL's voice now
            voice, self.pending_voice = self.pending_voice, None
            if voice not in self.catalog.listed:
                return [self.error_frame("unknown_voice", unknown_voice_message(voice), None, True),
                        Close(CLOSE_POLICY_VIOLATION, "unknown_voice")]
            actions += self.update_options({"voice": voice}, now)
        return actions + self.handle(message, now)

    def _close_context(self, vendor_id: str, now: float) -> list[Action]:
        vctx = self.vendor_contexts.get(vendor_id)
        if vctx is None:  # never opened or already over: nothing to stop
            return self.done_frames_for(vendor_id)
        if vctx.is_bare_flush and not vctx.is_closing:
            vctx.is_closing = True
            return self.end_vendor(vctx, now)
        return self.cancel_vendor(vctx, now) + self.done_frames(vctx)

    def audio_frames(self, vctx: ElevenLabsContext, data: bytes,
                     aligned: list[Tracked]) -> list[Action]:
        audio = base64.b64encode(data).decode("ascii") if data else None
        message: dict[str, Any] = {"audio": audio, "isFinal": None, **self._ids(vctx.vendor_id)}
        alignment = _alignment(aligned)
        message["alignment"] = alignment
        message["normalizedAlignment"] = alignment
        return [vendor_json(message)]

    def done_frames_for(self, vendor_id: str) -> list[Action]:
        actions: list[Action] = [vendor_json({"isFinal": True, **self._ids(vendor_id)})]
        if not self.is_multi:
            actions.append(Close(CLOSE_NORMAL, "end of input"))
        return actions

    def done_frames(self, vctx: ElevenLabsContext) -> list[Action]:
        return self.done_frames_for(vctx.vendor_id)


class ElevenLabsMultiSession(ElevenLabsSession):
    is_multi = True


def _alignment(aligned: list[Tracked]) -> dict[str, list[Any]] | None:
    if not aligned:
        return None
    chars: list[str] = []
    starts: list[int] = []
    durations: list[int] = []
    origin = aligned[0].base_ms
    for tracked in aligned:
        timings = segment_chars(tracked)
        offset = tracked.base_ms - origin
        for char, start, duration in zip(timings.chars, timings.start_ms, timings.duration_ms,
                                         strict=True):
            begin, end = round(offset + start), round(offset + start + duration)
            chars.append(char)
            starts.append(begin)
            durations.append(end - begin)
    return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": durations}


def _key(websocket: WebSocket) -> str | None:
    value = websocket.headers.get("xi-api-key")
    if value:
        return value.strip()
    bearer = websocket.headers.get("authorization", "")
    return bearer[7:].strip() if bearer.lower().startswith("bearer ") else None


def _error_json(code: str, message: str) -> str:
    frame = vendor_json({"message": message, "error": code, "code": CLOSE_POLICY_VIOLATION}).frame
    assert isinstance(frame, str)
    return frame


def _query_options(websocket: WebSocket) -> tuple[OutputFormat, SessionOptions, float]:
    """(output format, options, inactivity timeout) from the socket's URL; raises ProtocolError.
    The voice is not checked here: that takes the key's tenant (`_endpoint`)."""
    query = websocket.query_params
    voice_id = str(websocket.path_params.get("voice_id", ""))
    output = parse_output_format(query.get("output_format", DEFAULT_OUTPUT_FORMAT))
    try:
        inactivity = float(query.get("inactivity_timeout", DEFAULT_INACTIVITY_S))
    except ValueError:
        raise ProtocolError("bad_message", "inactivity_timeout must be a number of seconds",
                            fatal=True) from None
    if not 0 < inactivity <= MAX_INACTIVITY_S:
        raise ProtocolError("unsupported_option", f"inactivity_timeout must be within 1-"
                            f"{MAX_INACTIVITY_S:.0f} s, got {inactivity:g}", fatal=True)
    delay = AUTO_MODE_DELAY_MS if _flag(dict(query), "auto_mode", False) else 0
    return output, SessionOptions(voice=voice_id, max_buffer_delay_ms=delay), inactivity


async def _endpoint(websocket: WebSocket, session_class: type[ElevenLabsSession]) -> None:
    def make(**kwargs: Any) -> ElevenLabsSession:
        output, options, inactivity = _query_options(websocket)
        limits = replace(kwargs.pop("limits"), idle_timeout_s=inactivity)
        voice = options.voice
        is_deferred = kwargs["authorize"] is not None
        if is_deferred:  # no key yet: the default voice holds the place, the key's tenant decides
            state: AppState = websocket.app.state.voxgate
            options.voice = state.config.voice
        # the answer lists no voice: they may be a tenant's
        elif voice not in kwargs["catalog"].listed:
            raise ProtocolError("unknown_voice", unknown_voice_message(voice), fatal=True)
        session = session_class(output=output, options=options, limits=limits, **kwargs)
        session.pending_voice = voice if is_deferred else None
        return session

    await serve(websocket, make, protocol="elevenlabs", key=_key(websocket),
                key_hint="the xi-api-key header, or xi_api_key in the first message",
                error_json=_error_json, defer_auth=True)


async def stream_input_endpoint(websocket: WebSocket) -> None:
    await _endpoint(websocket, ElevenLabsSession)


async def multi_stream_input_endpoint(websocket: WebSocket) -> None:
    await _endpoint(websocket, ElevenLabsMultiSession)


__all__ = ["ElevenLabsMultiSession", "ElevenLabsSession", "multi_stream_input_endpoint",
           "parse_output_format", "stream_input_endpoint"]
