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
from typing import Any

from starlette.websockets import WebSocket

from gateway.compat.alignment import Tracked, segment_words
from gateway.compat.core import CompatSession, VendorContext, vendor_json
from gateway.compat.endpoint import serve
from gateway.compat.formats import OutputFormat, native_format
from gateway.errors import CLOSE_NORMAL, ProtocolError
from gateway.stream.actions import Action, Close
from gateway.stream.options import SessionOptions
from gateway.voices.catalog import unknown_voice_message

ENCODINGS = {"pcm_s16le": "pcm_s16le", "pcm_f32le": "pcm_f32le", "pcm_mulaw": "mulaw",
             "pcm_alaw": "alaw"}
IMMEDIATE_DELAY_MS = 50
DEFAULT_BUFFER_DELAY_MS = 3000
MAX_BUFFER_DELAY_MS = 60000
_STATUS = {"bad_message": 400, "unsupported_option": 400, "unknown_voice": 404,
           "unauthorized": 401, "rate_limited": 429, "busy": 503, "text_too_long": 400,
           "message_too_large": 413, "too_many_contexts": 429, "context_closed": 400}


def parse_output_format(value: Any) -> OutputFormat:
    if not isinstance(value, dict):
        raise ProtocolError("bad_message", "output_format must be an object {container, encoding, "
                            "sample_rate}")
    if value.get("container", "raw") != "raw":
        raise ProtocolError("unsupported_option", f"output_format.container {value.get('container')!r} "
                            "is not offered; expected raw")
    encoding, rate = value.get("encoding"), value.get("sample_rate")
    if encoding not in ENCODINGS or isinstance(rate, bool) or not isinstance(rate, int):
        raise ProtocolError("unsupported_option", "output_format needs encoding in "
                            f"{', '.join(ENCODINGS)} and an integer sample_rate")
    try:
        return OutputFormat(ENCODINGS[encoding], rate)
    except ValueError as exc:
        raise ProtocolError("unsupported_option", f"output_format: {exc}") from None


def _buffer_delay(message: dict[str, Any]) -> int:
    value = message.get("max_buffer_delay_ms")
    if value is None:
        return DEFAULT_BUFFER_DELAY_MS
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError("bad_message", "max_buffer_delay_ms must be an integer >= 0")
    return IMMEDIATE_DELAY_MS if value == 0 else min(value, MAX_BUFFER_DELAY_MS)


class CartesiaSession(CompatSession):
    protocol = "cartesia"
    reports_engine_time = True

    def error_frame(self, code: str, message: str, vendor_id: str | None, fatal: bool) -> Action:
        return vendor_json({"type": "error", "context_id": vendor_id, "status_code": _STATUS.get(code, 500),
                            "done": True, "error": message, "title": code})

    def idle_close(self, idle_s: float) -> list[Action]:
        """Cartesia closes an idle socket (after 5 minutes, its "Concurrency and WebSocket
        Limits" page) with no message; the code is not documented: a normal close, which
        Pipecat's Cartesia service reads as that timeout and reconnects."""
        return [Close(CLOSE_NORMAL, f"idle for {idle_s:g} s")]

    def handle(self, message: dict[str, Any], now: float) -> list[Action]:
        context_id = message.get("context_id")
        if not isinstance(context_id, str) or not context_id or len(context_id) > 256:
            raise ProtocolError("bad_message", "context_id must be a string of 1-256 characters")
        if message.get("cancel") is True:
            vctx = self.vendor_contexts.get(context_id)
            return self.cancel_vendor(vctx, now) if vctx is not None else []
        transcript = message.get("transcript", "")
        if not isinstance(transcript, str):
            raise ProtocolError("bad_message", "transcript must be a string", context_id=context_id)
        is_continued = message.get("continue", False) is True
        vctx = self.vendor_contexts.get(context_id)
        if vctx is None:
            vctx = self._open(context_id, message)
        actions: list[Action] = []
        if transcript:
            actions += self.push_text(vctx, transcript, now, options=vctx.state["options"])
            flush_of = vctx.state["flush_of"]
            for native_id in vctx.live:  # the native contexts this input opened join its group
                flush_of.setdefault(native_id, vctx.state["flush_id"])
        if message.get("flush") is True:
            actions += self._flush(vctx, now)
        if not is_continued:
            actions += self.end_vendor(vctx, now)
        return actions

    def _flush(self, vctx: VendorContext, now: float) -> list[Action]:
        """Speak the current group's text now; the next input starts group `flush_id` + 1."""
        actions = self.flush_vendor(vctx, now)
        vctx.state["flushed"].append(vctx.state["flush_id"])
        vctx.state["flush_id"] += 1
        return actions + self._flushes_done(vctx)

    def native_done(self, vctx: VendorContext, native_id: str) -> list[Action]:
        vctx.state["flush_of"].pop(native_id, None)
        return self._flushes_done(vctx)

    def _flushes_done(self, vctx: VendorContext) -> list[Action]:
        """`flush_done` for each flushed group, in order, whose audio is all out."""
        flushed: deque[int] = vctx.state["flushed"]
        speaking = set(vctx.state["flush_of"].values())
        actions: list[Action] = []
        while flushed and flushed[0] not in speaking:
            actions.append(vendor_json({"type": "flush_done", "context_id": vctx.vendor_id,
                                        "status_code": 206, "done": False, "flush_done": True,
                                        "flush_id": flushed.popleft()}))
        return actions

    def _open(self, context_id: str, message: dict[str, Any]) -> VendorContext:
        try:
            output = parse_output_format(message.get("output_format"))
            voice = message.get("voice")
            voice_id = voice.get("id") if isinstance(voice, dict) else None
            if not isinstance(voice, dict) or voice.get("mode", "id") != "id" or not isinstance(voice_id, str):
                raise ProtocolError("unsupported_option", "voice must be {mode: \"id\", id: <voice>}; "
                                    "embeddings are not offered")
            if voice_id not in self.catalog.listed:  # the answer lists no voice: they may be a tenant's
                raise ProtocolError("unknown_voice", unknown_voice_message(voice_id))
            delay = _buffer_delay(message)
        except ProtocolError as exc:
            exc.context_id = context_id
            raise
        vctx = self.open_vendor(context_id, output)
        codec, rate, _ = native_format(output)
        vctx.state["options"] = {"voice": voice_id, "codec": codec, "sample_rate": rate,
                                 "max_buffer_delay_ms": delay}
        vctx.state["timestamps"] = message.get("add_timestamps") is True
        vctx.state["flush_id"] = 1      # the group the next input joins
        vctx.state["flush_of"] = {}     # native context -> its group, until its audio is out
        vctx.state["flushed"] = deque()  # groups flushed whose flush_done is still to come
        return vctx

    def audio_frames(self, vctx: VendorContext, data: bytes, aligned: list[Tracked]) -> list[Action]:
        actions: list[Action] = []
        if vctx.state.get("timestamps"):
            for tracked in aligned:
                words, starts, ends = segment_words(tracked)
                if words:
                    actions.append(vendor_json({
                        "type": "timestamps", "context_id": vctx.vendor_id, "status_code": 206,
                        "done": False, "word_timestamps": {"words": words, "start": starts, "end": ends}}))
        if data:
            # a transcoder's tail comes after its native context ended: it is the last group's
            flush_id = vctx.state["flush_of"].get(vctx.speaking, vctx.state.get("last_flush_id", 1))
            vctx.state["last_flush_id"] = flush_id
            actions.append(vendor_json({"type": "chunk", "context_id": vctx.vendor_id, "status_code": 206,
                                        "done": False, "step_time": round(vctx.step_ms, 3),
                                        "flush_id": flush_id,
                                        "data": base64.b64encode(data).decode("ascii")}))
        return actions

    def done_frames(self, vctx: VendorContext) -> list[Action]:
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
    state = websocket.app.state.voxgate
    default = OutputFormat("pcm_s16le", 24000)  # replaced by each context's own output_format

    def make(**kwargs: Any) -> CartesiaSession:
        return CartesiaSession(output=default, options=SessionOptions(voice=state.config.voice), **kwargs)

    await serve(websocket, make, protocol="cartesia", key=_key(websocket),
                key_hint="the X-API-Key header, or ?api_key=", error_json=_error_json)
