"""The shared core of the vendor-compatible sockets: a `Session` that speaks another wire.

`CompatSession` *is* the native sans-I/O session (gateway/stream/session.py): every
rule of the native protocol (segmenting, deadlines, admission, barge-in that
cancels engine requests, limits, backpressure) runs unchanged. A vendor
adapter (elevenlabs.py, cartesia.py, deepgram.py) only translates: its
`handle` turns one client frame, decoded once, into typed native messages
(gateway/stream/messages.py) fed to the session's `receive_message`, never
re-encoded; and the native events the session returns come back through
`_translate` as the vendor's frames (`SendFrame`, already encoded). A vendor
frame costs one token of the native message rate, however many native
messages it becomes, and the size limit applies to the frame as the client
sent it. The native I/O loop (gateway/stream/endpoint.py) runs it as it runs
the native session; `encode` puts the events the loop makes itself in the
vendor's shape.

A vendor context maps onto native contexts one after another. A native
context takes no text once flushed, while the vendors' `flush` only forces
out what is buffered and lets the context go on; so each flush closes the
current native context and the next text opens a new one (ids `v1`, `v2`...,
never the client's string, which may be anything). The native rule that
contexts play in creation order keeps a vendor context's audio in order.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.types import AudioChunk, RequestId
from gateway.compat.alignment import Tracked
from gateway.compat.formats import OutputFormat, Transcoder, native_format
from gateway.compat.steps import EngineTime
from gateway.errors import CLOSE_POLICY_VIOLATION, ErrorEvent, ProtocolError
from gateway.stream.actions import Action, Cancel, Close, Send, SendFrame, Submit
from gateway.stream.context import Context
from gateway.stream.events import AudioEvent, ContextDone, SegmentEvent, TextSkipped, encode_json
from gateway.stream.messages import (
    CancelMessage,
    ClientMessage,
    CloseMessage,
    FlushMessage,
    SessionUpdate,
    TextMessage,
    decode_json,
)
from gateway.stream.options import Limits, SessionOptions
from gateway.stream.session import Session
from gateway.text.routing import Languages
from gateway.voices.catalog import VoiceChoices

log = logging.getLogger("voxgate.gateway")

#: checks a key that came after the handshake (`Admission.rekey`); raises `Refused`
Authorize = Callable[[str | None], None]


def vendor_json(message: dict[str, Any]) -> SendFrame:
    """A vendor's JSON frame (strict JSON: every number in it was checked finite)."""
    return SendFrame(encode_json(message))


@dataclass(slots=True)
class VendorContext:
    """One client context and the native contexts that speak it."""

    vendor_id: str
    output: OutputFormat
    transcoder: Transcoder | None
    current: str | None = None                     # the native context taking text
    live: list[str] = field(default_factory=list)  # native contexts not done, in order
    is_input_closed: bool = False                  # done once `live` is
    audio_ms: float = 0.0                          # native audio passed on so far
    num_segments: int = 0
    tracked: deque[Tracked] = field(default_factory=deque)
    sub_start_ms: dict[str, float] = field(default_factory=dict)
    speaking: str | None = None                    # the native context of the audio being passed on
    step_ms: float = 0.0                           # the engine time behind that audio (`EngineTime`)
    state: dict[str, Any] = field(default_factory=dict)  # the adapter's own fields


class CompatSession(Session):
    """The native session behind a vendor wire (see the module doc); adapters subclass it."""

    protocol = "compat"
    #: the wire reports the engine time behind each chunk (Cartesia's `step_time`)
    reports_engine_time = False

    def __init__(self, session_id: str, *, catalog: VoiceChoices, sample_rate: int,
                 options: SessionOptions, limits: Limits, output: OutputFormat,
                 admit: Callable[[str], None], release: Callable[[str], None],
                 authorize: Authorize | None = None, languages: Languages | None = None) -> None:
        """`authorize`: None when the key was checked at the handshake; else the session
        is unauthorized until its first message brings a key that `authorize` takes, and
        is closed if none came within `limits.auth_timeout_s` (`tick`)."""
        codec, rate, _ = native_format(output)
        options.codec, options.sample_rate, options.encoding = codec, rate, "json"
        super().__init__(session_id, catalog=catalog, sample_rate=sample_rate, options=options,
                         limits=limits, admit=admit, release=release, languages=languages)
        self.output = output
        self.authorize = authorize
        self.auth_deadline: float | None = None  # set at `start` while unauthorized
        self.vendor_contexts: dict[str, VendorContext] = {}
        self._by_native: dict[str, VendorContext] = {}
        # the session's Context objects, kept past their end: a segment that starts in
        # the same step as its context ends is tracked after the session let go of it
        self._native_contexts: dict[str, Context] = {}
        self._native_ids = itertools.count(1)
        self._engine_time = EngineTime() if self.reports_engine_time else None

    # -- what adapters implement ------------------------------------------------
    def handle(self, message: dict[str, Any], now: float) -> list[Action]:
        raise NotImplementedError

    def audio_frames(self, vctx: VendorContext, data: bytes, aligned: list[Tracked]) -> list[Action]:
        raise NotImplementedError

    def done_frames(self, vctx: VendorContext) -> list[Action]:
        raise NotImplementedError

    def error_frame(self, code: str, message: str, vendor_id: str | None, fatal: bool) -> Action:
        raise NotImplementedError

    def start_frames(self) -> list[Action]:
        return []

    def idle_close(self, idle_s: float) -> list[Action]:
        """How the vendor closes a socket that sent nothing for `idle_s` (the I/O loop asks)."""
        raise NotImplementedError

    def native_done(self, vctx: VendorContext, native_id: str) -> list[Action]:
        """One of `vctx`'s native contexts ended (its audio is all out); before `done_frames`."""
        return []

    # -- the Connection's entry points, in the vendor's shapes ------------------
    def start(self, now: float) -> list[Action]:
        super().start(now)  # session.ready: no vendor has it
        if self.authorize is not None:
            self.auth_deadline = now + self.limits.auth_timeout_s
        return self.start_frames()

    def receive_frame(self, raw: str | bytes, now: float) -> list[Action]:
        """One vendor frame: one rate-limit token, decoded once, handled by the adapter."""
        self.last_activity = now
        try:
            self.take_frame(now)
            return self.handle(self._parse(raw), now)
        except ProtocolError as exc:
            return [self.error_frame(exc.code, exc.message, exc.context_id, exc.fatal)]

    def receive_audio(self, chunk: AudioChunk, now: float) -> list[Action]:
        if self._engine_time is not None:
            self._engine_time.made(chunk)
        return self._translate(super().receive_audio(chunk, now))

    def receive_engine_error(self, request_id: RequestId, exc: BaseException,
                             now: float) -> list[Action]:
        return self._translate(super().receive_engine_error(request_id, exc, now))

    def tick(self, now: float) -> list[Action]:
        if self.authorize is not None and self.auth_deadline is not None and now >= self.auth_deadline:
            # keyless, it holds a place in the session cap and does nothing: not for long
            self.auth_deadline = None
            return [self.error_frame("unauthorized", "a valid API key is required within "
                                     f"{self.limits.auth_timeout_s:g} s of connecting; none came",
                                     None, True),
                    Close(CLOSE_POLICY_VIOLATION, "unauthorized")]
        return self._translate(super().tick(now))

    def next_wakeup(self) -> float | None:
        wakeup = super().next_wakeup()
        if self.authorize is None or self.auth_deadline is None:
            return wakeup
        return self.auth_deadline if wakeup is None else min(wakeup, self.auth_deadline)

    def encode(self, action: Send) -> str:
        """A native event the I/O loop made itself (a slow consumer, an internal error) in
        vendor shape; an idle socket is closed by `idle_close` instead."""
        event = action.message
        if isinstance(event, ErrorEvent):
            frame = self.error_frame(event.code, event.message, None, event.fatal)
            assert isinstance(frame, SendFrame) and isinstance(frame.frame, str)
            return frame.frame
        return encode_json(event.to_wire())

    # -- verbs for adapters -----------------------------------------------------
    def _parse(self, raw: str | bytes) -> dict[str, Any]:
        """The client's frame as it came: its size checked, then parsed as strict JSON."""
        size = len(raw.encode("utf-8")) if isinstance(raw, str) else len(raw)
        if size > self.limits.max_message_bytes:
            raise ProtocolError("message_too_large", f"message is {size} bytes; the limit is "
                                f"{self.limits.max_message_bytes}")
        try:
            message = decode_json(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise ProtocolError("bad_message", f"frame is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(message, dict):
            raise ProtocolError("bad_message", f"a message must be a JSON object, got "
                                f"{type(message).__name__}")
        return message

    def native(self, message: ClientMessage, now: float) -> list[Action]:
        """Feed one native message to the session (no rate token: the vendor frame took
        one); its answers come back translated."""
        return self._translate(self.receive_message(message, now))

    def open_vendor(self, vendor_id: str, output: OutputFormat | None = None) -> VendorContext:
        vctx = self.vendor_contexts.get(vendor_id)
        if vctx is None:
            # the native per-socket limit, counted on the vendor's side too: a context opened
            # (ElevenLabs' init message) holds memory before it holds a native context
            if len(self.vendor_contexts) >= self.limits.max_open_contexts:
                raise ProtocolError("too_many_contexts", f"this socket holds "
                                    f"{self.limits.max_open_contexts} open contexts; close one first",
                                    context_id=vendor_id)
            output = output or self.output
            _, _, needs_transcoder = native_format(output)
            vctx = VendorContext(vendor_id, output, Transcoder(output) if needs_transcoder else None)
            self.vendor_contexts[vendor_id] = vctx
        return vctx

    def push_text(self, vctx: VendorContext, text: str, now: float, *, flush: bool = False,
                  options: dict[str, Any] | None = None) -> list[Action]:
        """Text for a vendor context (`flush`: speak all of it now; more text may follow)."""
        actions: list[Action] = []
        if vctx.current is None:
            if options:
                actions += self.update_options(options, now)
            native_id = f"v{next(self._native_ids)}"
            self._by_native[native_id] = vctx
            actions += self.native(TextMessage(native_id, text, flush), now)
            if native_id in self.contexts:
                self._native_contexts[native_id] = self.contexts[native_id]
                vctx.live.append(native_id)
                vctx.current = None if flush else native_id
            else:  # refused (busy, too many contexts): the error went out above
                self._by_native.pop(native_id, None)
            return actions
        actions += self.native(TextMessage(vctx.current, text, flush), now)
        if flush:
            vctx.current = None
        return actions

    def flush_vendor(self, vctx: VendorContext, now: float) -> list[Action]:
        if vctx.current is None:
            return []
        native_id, vctx.current = vctx.current, None
        return self.native(FlushMessage(native_id), now)

    def end_vendor(self, vctx: VendorContext, now: float) -> list[Action]:
        """No more text: speak what is left, then the adapter's done frames."""
        actions = self.flush_vendor(vctx, now)
        vctx.is_input_closed = True
        if not vctx.live and vctx.vendor_id in self.vendor_contexts:
            actions += self._finish_vendor(vctx)
        return actions

    def cancel_vendor(self, vctx: VendorContext, now: float) -> list[Action]:
        """Barge-in: the native cancel of each of its contexts (engine work freed at once)."""
        actions: list[Action] = []
        for native_id in vctx.live:
            actions += self.native(CancelMessage(native_id), now)
            self._by_native.pop(native_id, None)
            self._forget_native(native_id)
        vctx.live.clear()
        vctx.current = None
        self.vendor_contexts.pop(vctx.vendor_id, None)
        return actions

    def update_options(self, fields: dict[str, Any], now: float) -> list[Action]:
        changes = {k: v for k, v in fields.items() if getattr(self.options, k) != v}
        return self.native(SessionUpdate(changes), now) if changes else []

    def close_session(self, now: float) -> list[Action]:
        """The native close: open contexts finish, then the socket closes with 1000."""
        return self.native(CloseMessage(), now)

    # -- native events -> vendor frames -----------------------------------------
    def _translate(self, actions: list[Action]) -> list[Action]:
        out: list[Action] = []
        for action in actions:
            if not isinstance(action, Send):
                if self._engine_time is not None:
                    self._count_engine_time(action)
                out.append(action)
                continue
            event = action.message
            if isinstance(event, SegmentEvent):
                self._track(event)
            elif isinstance(event, AudioEvent):
                out += self._on_audio(event)
            elif isinstance(event, ContextDone):
                out += self._on_done(event.context_id)
            elif isinstance(event, TextSkipped):
                # no vendor has a message for it: skipped silently, logged without the text
                # (docs/voices.md, "Languages"); the session counted it in the metrics
                log.info("session %s (%s): skipped %d characters of %s: no voice for it",
                         self.session_id, self.protocol, len(event.text), event.language)
            elif isinstance(event, ErrorEvent):
                native_id = event.context_id
                vctx = self._by_native.get(native_id) if native_id is not None else None
                out.append(self.error_frame(event.code, event.message,
                                            vctx.vendor_id if vctx else None, event.fatal))
                if vctx is not None and native_id is not None and native_id not in self.contexts:
                    # the error ended it (refused admission, an engine failure): no context.done comes
                    out += self._on_done(native_id)
            # session.ready / session.updated / cancelled: the adapter answers for itself
        return out

    def _track(self, event: SegmentEvent) -> None:
        native_id = event.context_id
        vctx = self._by_native.get(native_id)
        context = self._native_contexts.get(native_id)
        if vctx is None or context is None:
            return
        start = vctx.sub_start_ms.setdefault(native_id, vctx.audio_ms)
        segment = context.segments[event.segment_id]
        vctx.tracked.append(Tracked(segment, start + event.pts_ms, is_first=vctx.num_segments == 0))
        vctx.num_segments += 1
        if self._engine_time is not None:
            self._engine_time.started(native_id, segment.request_id, event.pts_ms)

    def _count_engine_time(self, action: Action) -> None:
        """Requests enter the engine-time ledger when submitted and leave when cancelled."""
        assert self._engine_time is not None
        if isinstance(action, Submit):
            self._engine_time.submitted(action.request.request_id)
        elif isinstance(action, Cancel):
            self._engine_time.forget([action.request_id])

    def _ready(self, vctx: VendorContext, everything: bool = False) -> list[Tracked]:
        """Segments whose audio is all framed, so their timings are final."""
        ready: list[Tracked] = []
        while vctx.tracked and (everything or vctx.tracked[0].segment.is_sent):
            ready.append(vctx.tracked.popleft())
        return ready

    def _on_audio(self, event: AudioEvent) -> list[Action]:
        vctx = self._by_native.get(event.context_id)
        if vctx is None:
            return []
        vctx.audio_ms += event.duration_ms
        vctx.speaking = event.context_id
        if self._engine_time is not None:
            vctx.step_ms = self._engine_time.spent(event.context_id, event.pts_ms, event.duration_ms)
        data = event.data
        if vctx.transcoder is not None:
            data = vctx.transcoder.encode(data)
        aligned = self._ready(vctx)
        return self.audio_frames(vctx, data, aligned) if data or aligned else []

    def _on_done(self, native_id: str) -> list[Action]:
        vctx = self._by_native.pop(native_id, None)
        self._forget_native(native_id)
        if vctx is None:
            return []
        if native_id in vctx.live:
            vctx.live.remove(native_id)
        if vctx.current == native_id:  # ended by the session itself (an idle turn)
            vctx.current = None
        actions = self.native_done(vctx, native_id)
        if vctx.live or not vctx.is_input_closed:
            return actions
        return actions + self._finish_vendor(vctx)

    def _forget_native(self, native_id: str) -> None:
        context = self._native_contexts.pop(native_id, None)
        if self._engine_time is not None and context is not None:
            self._engine_time.forget([s.request_id for s in context.segments], native_id)

    def _finish_vendor(self, vctx: VendorContext) -> list[Action]:
        self.vendor_contexts.pop(vctx.vendor_id, None)
        tail = vctx.transcoder.finish() if vctx.transcoder is not None else b""
        aligned = self._ready(vctx, everything=True)
        actions = self.audio_frames(vctx, tail, aligned) if tail or aligned else []
        return actions + self.done_frames(vctx)
