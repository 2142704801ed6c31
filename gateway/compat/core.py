"""The shared core of the vendor-compatible sockets: a native `Session` behind another wire.

`VendorSession` holds the native sans-I/O session (gateway/stream/session.py)
and drives it: every rule of the native protocol (segmenting, routing by
language, deadlines, admission, barge-in that cancels engine requests,
limits, backpressure) runs unchanged, and the adapter reads only what the
session exposes: its actions, its options, `has_context`. A vendor adapter
(elevenlabs.py, cartesia.py, deepgram.py) only translates: `decode` builds one
client frame, read once (the native reader sizes and parses it), into the
vendor's typed message (gateway/compat/messages.py); `handle` turns it into
typed native messages (gateway/stream/messages.py) fed to the session, never
re-encoded; and the native events the session returns come back through
`_translate` as the vendor's frames (`SendFrame`, already encoded). A vendor
frame costs one token of the native message rate, however many native
messages it becomes, and the size limit applies to the frame as the client
sent it. The native I/O loop (gateway/stream/endpoint.py) runs it as it runs
the native session.

A vendor context maps onto native contexts one after another. A native
context takes no text once flushed, while the vendors' `flush` only forces
out what is buffered and lets the context go on; so each flush closes the
current native context and the next text opens a new one (ids `v1`, `v2`...,
never the client's string, which may be anything). The native rule that
contexts play in creation order keeps a vendor context's audio in order.
Each adapter keeps its own fields on its own `VendorContext` record
(gateway/compat/contexts.py), which also opens each native context's encoder:
audio is encoded once, in the vendor's format, where the native playout
encodes it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

from engine.types import AudioChunk, RequestId
from gateway.audio.encoders import AudioEncoder, EncoderFactory
from gateway.compat.alignment import Tracked
from gateway.compat.contexts import VendorContext
from gateway.compat.formats import OutputFormat
from gateway.compat.steps import EngineTime
from gateway.errors import CLOSE_POLICY_VIOLATION, ErrorEvent, ProtocolError
from gateway.stream.actions import (
    Action,
    Cancel,
    Close,
    SegmentFramed,
    SegmentStarted,
    Send,
    SendFrame,
    Submit,
)
from gateway.stream.encoding import EncodeJob
from gateway.stream.events import AudioEvent, ContextDone, Event, TextSkipped, encode_json
from gateway.stream.messages import (
    CancelMessage,
    ClientMessage,
    CloseMessage,
    FlushMessage,
    SessionUpdate,
    TextMessage,
    decode_object,
)
from gateway.stream.options import Limits, SessionOptions
from gateway.stream.session import Session
from gateway.text.routing import Languages
from gateway.voices.catalog import VoiceChoices

log = logging.getLogger("voxgate.gateway")

#: checks a key that came after the handshake (`Admission.rekey`); raises `Refused`
Authorize = Callable[[str | None], None]
C = TypeVar("C", bound=VendorContext)  # the adapter's context record
M = TypeVar("M")                       # the adapter's message type


def vendor_json(message: dict[str, Any]) -> SendFrame:
    """A vendor's JSON frame (strict JSON: every number in it was checked finite)."""
    return SendFrame(encode_json(message))


class VendorSession(Generic[C, M]):
    """The native session behind a vendor wire (see the module doc); adapters subclass it."""

    protocol: ClassVar[str] = "compat"
    #: the wire reports the engine time behind each chunk (Cartesia's `step_time`)
    reports_engine_time: ClassVar[bool] = False

    def __init__(self, session_id: str, *, catalog: VoiceChoices, sample_rate: int,
                 options: SessionOptions, limits: Limits, output: OutputFormat,
                 admit: Callable[[str], None], release: Callable[[str], None],
                 authorize: Authorize | None = None, languages: Languages | None = None,
                 encoders: EncoderFactory | None = None, defer_encode: bool = False) -> None:
        """`output`: the socket's format (a context may name its own); `defer_encode`: encodes
        go out as `Encode` actions, as the native session's (the endpoint runs them most urgent
        first: gateway/stream/encoding.py); `authorize`: None when
        the key was checked at the handshake; else the session is unauthorized until its
        first message brings a key that `authorize` takes, and is closed if none came within
        `limits.auth_timeout_s` (`tick`)."""
        self.encoders = encoders or EncoderFactory()
        self.session = Session(session_id, catalog=catalog, sample_rate=sample_rate,
                               options=options, limits=limits, admit=admit, release=release,
                               languages=languages, encoders=self.encoders,
                               open_encoder=self._open_encoder, defer_encode=defer_encode)
        self.session_id = session_id
        self.limits = limits
        self.catalog = catalog
        self.output = output
        self.sample_rate = sample_rate
        self.authorize = authorize
        self.auth_deadline: float | None = None  # set at `start` while unauthorized
        self.vendor_contexts: dict[str, C] = {}
        self._by_native: dict[str, C] = {}
        self._native_ids = itertools.count(1)
        self._engine_time = EngineTime() if self.reports_engine_time else None

    # -- what adapters implement ------------------------------------------------
    def decode(self, obj: Mapping[str, Any]) -> M:
        """The vendor's message from a parsed frame (gateway/compat/messages.py)."""
        raise NotImplementedError

    def handle(self, message: M, now: float) -> list[Action]:
        raise NotImplementedError

    def audio_frames(self, vctx: C, data: bytes, aligned: list[Tracked]) -> list[Action]:
        raise NotImplementedError

    def done_frames(self, vctx: C) -> list[Action]:
        raise NotImplementedError

    def error_frame(self, code: str, message: str, vendor_id: str | None, fatal: bool) -> Action:
        raise NotImplementedError

    def start_frames(self) -> list[Action]:
        return []

    def idle_close(self, idle_s: float) -> list[Action]:
        """How the vendor closes a socket that sent nothing for `idle_s` (the I/O loop asks)."""
        raise NotImplementedError

    def native_done(self, vctx: C, native_id: str) -> list[Action]:
        """One of `vctx`'s native contexts ended (its audio is all out); before `done_frames`."""
        return []

    # -- the I/O loop's entry points, in the vendor's shapes --------------------
    @property
    def options(self) -> SessionOptions:
        return self.session.options

    @property
    def last_activity(self) -> float:
        return self.session.last_activity

    @property
    def num_open_contexts(self) -> int:
        return self.session.num_open_contexts

    def start(self, now: float) -> list[Action]:
        self.session.start(now)  # session.ready: no vendor has it
        if self.authorize is not None:
            self.auth_deadline = now + self.limits.auth_timeout_s
        return self.start_frames()

    def receive_frame(self, raw: str | bytes, now: float) -> list[Action]:
        """One vendor frame: one rate-limit token, read once, handled by the adapter."""
        try:
            self.session.take_frame(now)
            obj = decode_object(raw, self.limits.max_message_bytes, is_binary_json=True)
            return self.handle(self.decode(obj), now)
        except ProtocolError as exc:
            return [self.error_frame(exc.code, exc.message, exc.context_id, exc.fatal)]

    def receive_audio(self, chunk: AudioChunk, now: float) -> list[Action]:
        if self._engine_time is not None:
            self._engine_time.made(chunk)
        return self._translate(self.session.receive_audio(chunk, now))

    def receive_engine_error(self, request_id: RequestId, exc: BaseException,
                             now: float) -> list[Action]:
        return self._translate(self.session.receive_engine_error(request_id, exc, now))

    def receive_encoded(self, context_id: str, job: EncodeJob, now: float) -> list[Action]:
        return self._translate(self.session.receive_encoded(context_id, job, now))

    def tick(self, now: float) -> list[Action]:
        deadline = self.auth_deadline
        if self.authorize is not None and deadline is not None and now >= deadline:
            # keyless, it holds a place in the session cap and does nothing: not for long
            self.auth_deadline = None
            return [self.error_frame("unauthorized", "a valid API key is required within "
                                     f"{self.limits.auth_timeout_s:g} s of connecting; none came",
                                     None, True),
                    Close(CLOSE_POLICY_VIOLATION, "unauthorized")]
        return self._translate(self.session.tick(now))

    def next_wakeup(self) -> float | None:
        wakeup = self.session.next_wakeup()
        if self.authorize is None or self.auth_deadline is None:
            return wakeup
        return self.auth_deadline if wakeup is None else min(wakeup, self.auth_deadline)

    def is_idle(self, now: float) -> bool:
        return self.session.is_idle(now)

    def disconnect(self) -> list[Action]:
        """The socket is gone: the native session frees everything (idempotent)."""
        for vctx in list(self.vendor_contexts.values()):
            self._forget_vendor(vctx)
        return self.session.disconnect()

    def encode(self, action: Send) -> str | bytes:
        """A native event the I/O loop made itself (a slow consumer, an internal error) in
        vendor shape; an idle socket is closed by `idle_close` instead."""
        event = action.message
        if isinstance(event, ErrorEvent):
            frame = self.error_frame(event.code, event.message, None, event.fatal)
            assert isinstance(frame, SendFrame)
            return frame.frame
        return encode_json(event.to_wire())

    # -- verbs for adapters -----------------------------------------------------
    def native(self, message: ClientMessage, now: float) -> list[Action]:
        """Feed one native message to the session (no rate token: the vendor frame took
        one); its answers come back translated."""
        return self._translate(self.session.receive_message(message, now))

    def open_vendor(self, vctx: C) -> C:
        """Take a new vendor context (the adapter made its record) within the socket's limit."""
        # the native per-socket limit, counted on the vendor's side too: a context opened
        # (ElevenLabs' init message) holds memory before it holds a native context
        if len(self.vendor_contexts) >= self.limits.max_open_contexts:
            raise ProtocolError("too_many_contexts", f"this socket holds "
                                f"{self.limits.max_open_contexts} open contexts; close one first",
                                context_id=vctx.vendor_id)
        self.vendor_contexts[vctx.vendor_id] = vctx
        return vctx

    def push_text(self, vctx: C, text: str, now: float, *, flush: bool = False,
                  options: dict[str, Any] | None = None) -> list[Action]:
        """Text for a vendor context (`flush`: speak all of it now; more text may follow)."""
        actions: list[Action] = []
        if vctx.current is None:
            if options:
                actions += self.update_options(options, now)
            native_id = f"v{next(self._native_ids)}"
            self._by_native[native_id] = vctx
            actions += self.native(TextMessage(native_id, text, flush), now)
            if self.session.has_context(native_id):
                vctx.live.append(native_id)
                vctx.current = None if flush else native_id
            else:  # refused (busy, too many contexts): the error went out above
                self._by_native.pop(native_id, None)
            return actions
        actions += self.native(TextMessage(vctx.current, text, flush), now)
        if flush:
            vctx.current = None
        return actions

    def flush_vendor(self, vctx: C, now: float) -> list[Action]:
        if vctx.current is None:
            return []
        native_id, vctx.current = vctx.current, None
        return self.native(FlushMessage(native_id), now)

    def end_vendor(self, vctx: C, now: float) -> list[Action]:
        """No more text: speak what is left, then the adapter's done frames."""
        actions = self.flush_vendor(vctx, now)
        vctx.is_input_closed = True
        if not vctx.live and vctx.vendor_id in self.vendor_contexts:
            actions += self._finish_vendor(vctx)
        return actions

    def cancel_vendor(self, vctx: C, now: float) -> list[Action]:
        """Barge-in: the native cancel of each of its contexts (engine work freed at once)."""
        actions: list[Action] = []
        for native_id in vctx.live:
            actions += self.native(CancelMessage(native_id), now)
            self._by_native.pop(native_id, None)
            self._forget_native(native_id)
        vctx.live.clear()
        vctx.current = None
        self._forget_vendor(vctx)
        return actions

    def update_options(self, fields: dict[str, Any], now: float) -> list[Action]:
        changes = {k: v for k, v in fields.items() if getattr(self.options, k) != v}
        return self.native(SessionUpdate(changes), now) if changes else []

    def close_session(self, now: float) -> list[Action]:
        """The native close: open contexts finish, then the socket closes with 1000."""
        return self.native(CloseMessage(), now)

    # -- native events -> vendor frames -----------------------------------------
    def _open_encoder(self, native_id: str, options: SessionOptions) -> AudioEncoder:
        """The session's encoder for a new native context: its vendor context's format."""
        return self._by_native[native_id].open_encoder(self.encoders, self.sample_rate)

    def _translate(self, actions: list[Action]) -> list[Action]:
        out: list[Action] = []
        for action in actions:
            if isinstance(action, Send):
                out += self._on_event(action.message)
            elif isinstance(action, SegmentStarted):
                self._on_started(action)
            elif isinstance(action, SegmentFramed):
                vctx = self._by_native.get(action.context_id)
                if vctx is not None:
                    vctx.framed(action)
            else:
                if self._engine_time is not None:
                    self._count_engine_time(action)
                out.append(action)
        return out

    def _on_event(self, event: Event) -> list[Action]:
        if isinstance(event, AudioEvent):
            return self._on_audio(event)
        if isinstance(event, ContextDone):
            return self._on_done(event.context_id)
        if isinstance(event, TextSkipped):
            # no vendor has a message for it: skipped silently, counted in the metrics by the
            # session, logged once per vendor context (docs/voices.md, "Languages")
            vctx = self._by_native.get(event.context_id)
            if vctx is not None:
                vctx.skipped.add(event)
            return []
        if isinstance(event, ErrorEvent):
            native_id = event.context_id
            vctx = self._by_native.get(native_id) if native_id is not None else None
            out = [self.error_frame(event.code, event.message, vctx.vendor_id if vctx else None,
                                    event.fatal)]
            if vctx is not None and native_id is not None \
                    and not self.session.has_context(native_id):
                # the error ended it (refused admission, an engine failure): no context.done comes
                out += self._on_done(native_id)
            return out
        return []  # segment, session.ready/updated, cancelled: the adapter answers for itself

    def _on_started(self, note: SegmentStarted) -> None:
        vctx = self._by_native.get(note.context_id)
        if vctx is None:
            return
        vctx.started(note.context_id)
        if self._engine_time is not None:
            self._engine_time.started(note.context_id, note.request_id, note.pts_ms)

    def _count_engine_time(self, action: Action) -> None:
        """Requests enter the engine-time ledger when submitted and leave when cancelled."""
        assert self._engine_time is not None
        if isinstance(action, Submit):
            self._engine_time.submitted(action.request.request_id, action.context_id)
        elif isinstance(action, Cancel):
            self._engine_time.cancelled(action.request_id)

    def _on_audio(self, event: AudioEvent) -> list[Action]:
        vctx = self._by_native.get(event.context_id)
        if vctx is None:
            return []
        vctx.audio_ms += event.duration_ms
        if self._engine_time is not None:
            vctx.step_ms = self._engine_time.spent(event.context_id, event.pts_ms,
                                                   event.duration_ms)
        data = event.data
        aligned = vctx.take_aligned()
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
        if self._engine_time is not None:
            self._engine_time.forget_context(native_id)

    def _finish_vendor(self, vctx: C) -> list[Action]:
        self._forget_vendor(vctx)
        tail = vctx.end_stream(self.encoders, self.sample_rate)
        aligned = vctx.take_aligned()
        actions = self.audio_frames(vctx, tail, aligned) if tail or aligned else []
        return actions + self.done_frames(vctx)

    def _forget_vendor(self, vctx: C) -> None:
        """The vendor context is over: let it go, and say once what it skipped."""
        self.vendor_contexts.pop(vctx.vendor_id, None)
        if vctx.skipped:
            log.info("session %s (%s): skipped %s: no voice for it", self.session_id,
                     self.protocol, vctx.skipped.summary())
            vctx.skipped.by_language.clear()
