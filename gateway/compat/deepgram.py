"""Deepgram-compatible socket: `/v1/speak`.

Translation only (gateway/compat/core.py); docs/compat.md lists what differs
from the vendor. The text between two `Flush` messages is one vendor context:
`Speak` adds text to it, `Flush` ends its input (`Flushed` follows its last
audio), `Clear` is a barge-in (every context's engine work is cancelled at
once, then `Cleared`), `Close` cancels what is left and closes with 1000. The
audio is binary frames in `encoding` (linear16, mulaw, alaw) at `sample_rate`.
`model` names the voice, resolved in the key's tenant; one the key may not
use speaks with the server's default voice, with a `Warning`. The key comes
as `Authorization: Token KEY` (or `Bearer`), `?token=`, or, from a browser,
which cannot set headers on a socket, as the subprotocol pair
`Sec-WebSocket-Protocol: token, KEY`: the answer then names `token`, as
Deepgram's does.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from starlette.websockets import WebSocket

from gateway.compat.alignment import Tracked
from gateway.compat.contexts import VendorContext
from gateway.compat.core import VendorSession, vendor_json
from gateway.compat.endpoint import serve
from gateway.compat.formats import deepgram_format
from gateway.compat.messages import (
    DeepgramClear,
    DeepgramFlush,
    DeepgramMessage,
    DeepgramSpeak,
    decode_deepgram,
)
from gateway.errors import CLOSE_INTERNAL_ERROR, CLOSE_NORMAL
from gateway.state import AppState
from gateway.stream.actions import Action, Close, SendFrame
from gateway.stream.options import SessionOptions
from gateway.voices.catalog import VoiceChoices

#: Deepgram's code for a socket closed for sending nothing, in its close frame's reason
NET_0001 = "NET-0001"


class DeepgramSession(VendorSession[VendorContext, DeepgramMessage]):
    protocol = "deepgram"
    warning: str | None = None  # said once at the start (an unknown model)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turns = 0            # vendor contexts opened: the text between two Flush messages
        self._num_flushed = 0
        self._current: VendorContext | None = None

    def start_frames(self) -> list[Action]:
        frames: list[Action] = [vendor_json({
            "type": "Metadata", "request_id": str(uuid.uuid4()), "model_name": self.options.voice,
            "model_version": "voxgate", "model_uuid": self.session_id})]
        if self.warning:
            frames.append(vendor_json({"type": "Warning", "warn_code": "unknown_model",
                                       "warn_msg": self.warning}))
        return frames

    def error_frame(self, code: str, message: str, vendor_id: str | None, fatal: bool) -> Action:
        if fatal:
            return vendor_json({"type": "Error", "err_code": code, "err_msg": message,
                                "description": message})
        return vendor_json({"type": "Warning", "warn_code": code, "warn_msg": message,
                            "description": message})

    def idle_close(self, idle_s: float) -> list[Action]:
        """Deepgram's close for a socket that sent nothing in time: no message, the reason in
        the close frame, 1011 with its `NET-0001` code (its TTS troubleshooting guide)."""
        return [Close(CLOSE_INTERNAL_ERROR, f"{NET_0001}: no message came within the timeout "
                      f"window ({idle_s:g} s)")]

    def decode(self, obj: Mapping[str, Any]) -> DeepgramMessage:
        return decode_deepgram(obj)

    def handle(self, message: DeepgramMessage, now: float) -> list[Action]:
        if isinstance(message, DeepgramSpeak):
            if self._current is None:
                self._turns += 1
                self._current = self.open_vendor(VendorContext(f"t{self._turns}", self.output))
            return self.push_text(self._current, message.text, now)
        if isinstance(message, DeepgramFlush):
            vctx, self._current = self._current, None
            if vctx is None:
                self._num_flushed += 1
                return [self._flushed()]
            return self.end_vendor(vctx, now)
        actions: list[Action] = []  # Clear or Close: every turn's engine work cancelled
        for vctx in list(self.vendor_contexts.values()):
            actions += self.cancel_vendor(vctx, now)
        self._current = None
        if isinstance(message, DeepgramClear):
            return actions + [vendor_json({"type": "Cleared", "sequence_id": self._num_flushed})]
        return actions + [Close(CLOSE_NORMAL, "closed by client")]

    def _flushed(self) -> Action:
        return vendor_json({"type": "Flushed", "sequence_id": self._num_flushed - 1})

    def audio_frames(self, vctx: VendorContext, data: bytes,
                     aligned: list[Tracked]) -> list[Action]:
        return [SendFrame(data)] if data else []

    def done_frames(self, vctx: VendorContext) -> list[Action]:
        self._num_flushed += 1
        return [self._flushed()]


_SCHEMES = ("token", "bearer")


def _key(websocket: WebSocket) -> tuple[str | None, str | None]:
    """(the key, the subprotocol to answer: the scheme, when the key came as a subprotocol)."""
    value = websocket.headers.get("authorization", "")
    for scheme in _SCHEMES:
        if value.lower().startswith(scheme + " "):
            return value[len(scheme) + 1:].strip(), None
    offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",")]
    if len(offered) == 2 and offered[0].lower() in _SCHEMES and offered[1]:
        return offered[1], offered[0]
    return websocket.query_params.get("token"), None


def _error_json(code: str, message: str) -> str:
    frame = vendor_json({"type": "Error", "err_code": code, "err_msg": message,
                         "description": message}).frame
    assert isinstance(frame, str)
    return frame


async def speak_endpoint(websocket: WebSocket) -> None:
    state: AppState = websocket.app.state.voxgate

    def make(**kwargs: Any) -> DeepgramSession:
        query = dict(websocket.query_params)
        output = deepgram_format(query)
        model = query.get("model")
        voices: VoiceChoices = kwargs["catalog"]  # the socket's tenant's, and the shared ones
        voice: str = model if model is not None and model in voices.listed else state.config.voice
        session = DeepgramSession(output=output, options=SessionOptions(voice=voice), **kwargs)
        if model and model != voice:
            session.warning = (f"model {model[:64]!r} is not a voice of this server; "
                               f"speaking with {voice!r}")
        return session

    key, subprotocol = _key(websocket)
    await serve(websocket, make, protocol="deepgram", key=key, subprotocol=subprotocol,
                key_hint="Authorization: Token <key>, Sec-WebSocket-Protocol: token, <key>, or "
                         "?token=",
                error_json=_error_json)
