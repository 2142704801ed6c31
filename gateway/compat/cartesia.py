"""Cartesia-compatible socket: `/tts/websocket`.

Translation only (gateway/compat/core.py); docs/compat.md lists what differs
from the vendor. Each Cartesia context is a vendor context: its first message
fixes its voice and output format (`container: raw`; `pcm_s16le`,
`pcm_f32le`, `pcm_mulaw` or `pcm_alaw` at 8-48 kHz), `continue: false` ends its
input, `{context_id, cancel: true}` is a barge-in (engine work cancelled at
once, nothing more of it is sent). `max_buffer_delay_ms` maps onto voxgate's
time-based text release: 0 (release each input at once) becomes
`IMMEDIATE_DELAY_MS`, absent is the vendor's default, 3000.

Flushes, as Cartesia's "Context Flushing and Flush IDs" guide has them: a
context's inputs are numbered in groups from `flush_id` 1; `flush: true`
speaks the group's buffered text at once and starts the next group, the
context going on. Each chunk carries the `flush_id` of the input it speaks,
and once a group's audio is all out a `flush_done` names it (`done: false`:
the context is not over; groups end in order). `step_time` is the engine time
behind the chunk's audio, in ms (gateway/compat/steps.py), and an idle socket
is closed as Cartesia does, with a plain close (`idle_close`).
"""

from __future__ import annotations

import base64
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.websockets import WebSocket

from gateway.compat.alignment import Tracked, segment_words
from gateway.compat.contexts import VendorContext
from gateway.compat.core import VendorSession, vendor_json
from gateway.compat.endpoint import serve
from gateway.compat.formats import OutputFormat
from gateway.compat.messages import CartesiaMessage, decode_cartesia
from gateway.errors import CLOSE_NORMAL, ProtocolError
from gateway.state import AppState
from gateway.stream.actions import Action, Close
from gateway.stream.options import SessionOptions
from gateway.voices.catalog import unknown_voice_message

IMMEDIATE_DELAY_MS = 50
DEFAULT_BUFFER_DELAY_MS = 3000
MAX_BUFFER_DELAY_MS = 60000
_STATUS = {"bad_message": 400, "unsupported_option": 400, "unknown_voice": 404,
           "unauthorized": 401, "rate_limited": 429, "busy": 503, "text_too_long": 400,
           "message_too_large": 413, "too_many_contexts": 429, "context_closed": 400}


@dataclass(slots=True)
class CartesiaContext(VendorContext):
    voice: str = ""
    max_buffer_delay_ms: int = DEFAULT_BUFFER_DELAY_MS
    has_timestamps: bool = False
    flush_id: int = 1  # the group the next input joins
    flush_of: dict[str, int] = field(default_factory=dict)  # native context -> its group, until
    #                                                         its audio is out
    flushed: deque[int] = field(default_factory=deque)  # groups flushed, flush_done to come
    last_flush_id: int = 1  # the group of the last chunk sent


def _buffer_delay(value: int | None) -> int:
    if value is None:
        return DEFAULT_BUFFER_DELAY_MS
    return IMMEDIATE_DELAY_MS if value == 0 else min(value, MAX_BUFFER_DELAY_MS)


class CartesiaSession(VendorSession[CartesiaContext, CartesiaMessage]):
    protocol = "cartesia"
    reports_engine_time = True

    def error_frame(self, code: str, message: str, vendor_id: str | None, fatal: bool) -> Action:
        return vendor_json({"type": "error", "context_id": vendor_id,
                            "status_code": _STATUS.get(code, 500),
                            "done": True, "error": message, "title": code})

    def idle_close(self, idle_s: float) -> list[Action]:
        """Cartesia closes an idle socket (after 5 minutes, its "Concurrency and WebSocket
        Limits" page) with no message; the code is not documented: a normal close, which
        Pipecat's Cartesia service reads as that timeout and reconnects."""
        return [Close(CLOSE_NORMAL, f"idle for {idle_s:g} s")]

    def decode(self, obj: Mapping[str, Any]) -> CartesiaMessage:
        return decode_cartesia(obj)

    def handle(self, message: CartesiaMessage, now: float) -> list[Action]:
        context_id = message.context_id
        vctx = self.vendor_contexts.get(context_id)
        if message.is_cancel:
            return self.cancel_vendor(vctx, now) if vctx is not None else []
        if vctx is None:
            vctx = self._open(message)
        actions: list[Action] = []
        if message.transcript:
            options = {"voice": vctx.voice, "max_buffer_delay_ms": vctx.max_buffer_delay_ms}
            actions += self.push_text(vctx, message.transcript, now, options=options)
            for native_id in vctx.live:  # the native contexts this input opened join its group
                vctx.flush_of.setdefault(native_id, vctx.flush_id)
        if message.flush:
            actions += self._flush(vctx, now)
        if not message.is_continued:
            actions += self.end_vendor(vctx, now)
        return actions

    def _flush(self, vctx: CartesiaContext, now: float) -> list[Action]:
        """Speak the current group's text now; the next input starts group `flush_id` + 1."""
        actions = self.flush_vendor(vctx, now)
        vctx.flushed.append(vctx.flush_id)
        vctx.flush_id += 1
        return actions + self._flushes_done(vctx)

    def native_done(self, vctx: CartesiaContext, native_id: str) -> list[Action]:
        vctx.flush_of.pop(native_id, None)
        return self._flushes_done(vctx)

    def _flushes_done(self, vctx: CartesiaContext) -> list[Action]:
        """`flush_done` for each flushed group, in order, whose audio is all out."""
        speaking = set(vctx.flush_of.values())
        actions: list[Action] = []
        while vctx.flushed and vctx.flushed[0] not in speaking:
            actions.append(vendor_json({"type": "flush_done", "context_id": vctx.vendor_id,
                                        "status_code": 206, "done": False, "flush_done": True,
                                        "flush_id": vctx.flushed.popleft()}))
        return actions

    def _open(self, message: CartesiaMessage) -> CartesiaContext:
        """A context's first message fixes its output format and voice."""
        context_id = message.context_id
        if message.output is None:
            raise ProtocolError("bad_message", "output_format must be an object {container, "
                                "encoding, sample_rate}", context_id=context_id)
        if message.voice is None:
            raise ProtocolError("unsupported_option", "voice must be {mode: \"id\", id: <voice>}; "
                                "embeddings are not offered", context_id=context_id)
        if message.voice not in self.catalog.listed:  # the answer lists no voice: they may be a
            raise ProtocolError("unknown_voice", unknown_voice_message(message.voice),  # tenant's
                                context_id=context_id)
        return self.open_vendor(CartesiaContext(
            context_id, message.output, voice=message.voice,
            max_buffer_delay_ms=_buffer_delay(message.max_buffer_delay_ms),
            has_timestamps=message.add_timestamps))

    def audio_frames(self, vctx: CartesiaContext, data: bytes,
                     aligned: list[Tracked]) -> list[Action]:
        actions: list[Action] = []
        if vctx.has_timestamps:
            for tracked in aligned:
                words, starts, ends = segment_words(tracked)
                if words:
                    actions.append(vendor_json({
                        "type": "timestamps", "context_id": vctx.vendor_id, "status_code": 206,
                        "done": False,
                        "word_timestamps": {"words": words, "start": starts, "end": ends}}))
        if data:
            # audio after its native context ended (a stream's tail) is the last group's
            flush_id = vctx.flush_of.get(vctx.speaking or "", vctx.last_flush_id)
            vctx.last_flush_id = flush_id
            actions.append(vendor_json({"type": "chunk", "context_id": vctx.vendor_id,
                                        "status_code": 206,
                                        "done": False, "step_time": round(vctx.step_ms, 3),
                                        "flush_id": flush_id,
                                        "data": base64.b64encode(data).decode("ascii")}))
        return actions

    def done_frames(self, vctx: CartesiaContext) -> list[Action]:
        return [vendor_json({"type": "done", "context_id": vctx.vendor_id, "status_code": 200,
                             "done": True})]


def _key(websocket: WebSocket) -> str | None:
    value = websocket.headers.get("x-api-key") or websocket.query_params.get("api_key")
    if value:
        return value.strip()
    bearer = websocket.headers.get("authorization", "")
    return bearer[7:].strip() if bearer.lower().startswith("bearer ") else None


def _error_json(code: str, message: str) -> str:
    frame = vendor_json({"type": "error", "context_id": None, "status_code": _STATUS.get(code, 500),
                         "done": True, "error": message, "title": code}).frame
    assert isinstance(frame, str)
    return frame


async def websocket_endpoint(websocket: WebSocket) -> None:
    """`Cartesia-Version` / `cartesia_version` is accepted in any version: the wire is the same."""
    state: AppState = websocket.app.state.voxgate
    default = OutputFormat("pcm_s16le", 24000)  # replaced by each context's own output_format

    def make(**kwargs: Any) -> CartesiaSession:
        return CartesiaSession(output=default, options=SessionOptions(voice=state.config.voice),
                               **kwargs)

    await serve(websocket, make, protocol="cartesia", key=_key(websocket),
                key_hint="the X-API-Key header, or ?api_key=", error_json=_error_json)
