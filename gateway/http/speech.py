"""`POST /v1/audio/speech`: OpenAI's speech endpoint, streamed as audio is made.

The input is cut by the same segmenter as the socket and routed by language
the same way (docs/voices.md, "Languages": a segment its voice cannot speak
goes to the server's `--voice-for` voice, text no voice can say is skipped,
logged without the text and counted); segments go to the engine a few at a time (the first due now, the rest when the audio before them
would run out) and the body streams each segment's audio in order as soon as
it exists. `stream_format: sse` sends `speech.audio.delta` events with base64
audio, then `speech.audio.done`, as OpenAI does. The voice is resolved in the
caller's tenant (the voice catalog's view for the request's principal: another
tenant's id is `unknown_voice`) and held until the body ends, as a socket holds
its voice; refusals use the one HTTP error shape (`gateway.errors.http_error`).

Work is checked before it is done: the key and the Origin first (the access
guard, before the route), then the body: `application/json` (415), no larger
than MAX_BODY_BYTES by its Content-Length or as it streams (413, before it is
read whole), whole within `slow_consumer_timeout_s` however it trickles in
(408, gateway/bodies.py), and every field of the right type (400). Engine
capacity counts against the caller's fair share (gateway/access/fair_share.py). Once
streaming, a client that reads nothing for `slow_consumer_timeout_s` (the
write timeout) or goes away ends its synthesis at once: every engine request
of the body is cancelled, not only the one being read.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.client import EngineClient
from engine.errors import VoxgateError
from engine.types import AudioChunk, RequestId, SamplingParams, SynthesisRequest, estimate_audio_s
from gateway.access.fair_share import FairShare, owner_of
from gateway.access.guard import principal
from gateway.access.keys import presented_key
from gateway.audio.containers import ContainerStreamEncoder, available_formats
from gateway.audio.formats import MAX_SPEED, MIN_SPEED, OPENAI_MAX_SPEED, OPENAI_MIN_SPEED
from gateway.bodies import BodyTimeoutError, within
from gateway.errors import http_error
from gateway.stream.messages import decode_json
from gateway.text.routing import Languages, VoiceScripts, route
from gateway.text.segmenter import Segmenter
from gateway.voices.catalog import VoiceCatalog, VoiceChoices, unknown_voice_message

log = logging.getLogger("voxgate.gateway")

#: OpenAI's voice names, served by the configured default voice so that
#: existing OpenAI client code works unchanged.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx",
                           "sage", "shimmer", "verse", "marin", "cedar"})
MAX_INPUT_CHARS = 4096
#: the largest body taken: a 4,096-character input written entirely as \\uXXXX
#: escapes is 24 KiB; the rest is room for instructions and the other fields
MAX_BODY_BYTES = 64 * 1024
#: segments with the engine (or read and waiting) per request, as on the socket
MAX_SEGMENTS_AHEAD = 4


async def speech_endpoint(request: Request) -> Response:
    state = request.app.state.voxgate
    engine: EngineClient = state.engine
    if state.is_shutting_down:
        return http_error(503, "busy", "the server is shutting down")
    timeout_s = state.config.limits.slow_consumer_timeout_s
    body = await _read_body(request, timeout_s)
    if isinstance(body, Response):
        return body
    shared: VoiceCatalog = state.catalog
    catalog = shared.view(principal(request))  # the voices of this request's tenant
    job = _parse(body, catalog.listed, state.config.voice)
    if isinstance(job, Response):
        return job
    if job.instructions and not any(v.supports_instructions for v in engine.voices if v.voice_id == job.voice):
        return http_error(400, "unsupported_option", f"voice {job.voice!r} does not take instructions")
    segmenter = Segmenter()
    segments = segmenter.push(job.text, 0.0) + segmenter.flush(0.0)
    if not segments:
        return http_error(400, "bad_request", "'input' has nothing speakable after cleanup")
    routed = _route(segments, job.voice, state.languages, state.metrics)
    if not routed:
        return http_error(400, "bad_request", f"'input' has nothing voice {job.voice!r} can say, "
                          "and the server maps no voice for its language (docs/voices.md)")

    auth = state.config.auth
    owner = owner_of(presented_key(request.headers, dict(request.query_params)),
                     request.client.host if request.client else None, is_auth_enabled=auth.is_enabled)
    fair_share: FairShare = state.fair_share
    key = "http/" + uuid.uuid4().hex[:12]
    try:
        fair_share.admit(owner, key)
    except VoxgateError as exc:
        return http_error(getattr(exc, "status", 503), exc.code, str(exc))
    state.metrics.http_speech.inc()
    synthesis = _Synthesis(engine, fair_share, catalog, key, routed, job)  # holds its voices
    encoder = ContainerStreamEncoder(job.fmt, engine.sample_rate)
    if job.stream_format == "sse":
        return _AudioResponse(_sse(synthesis.chunks(), encoder), synthesis, timeout_s,
                              media_type="text/event-stream")
    return _AudioResponse(_raw(synthesis.chunks(), encoder), synthesis, timeout_s,
                          media_type=encoder.content_type)


async def _read_body(request: Request, timeout_s: float) -> bytes | Response:
    """The body, refused before it is read when it is not JSON or too large."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        return http_error(415, "not_json", "the body must be JSON, sent as Content-Type: application/json; "
                          f"got {media_type or 'none'!r}")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        return http_error(413, "body_too_large", f"the body may be at most {MAX_BODY_BYTES} bytes; "
                          f"Content-Length says {declared[:20]}")
    chunks: list[bytes] = []
    size = 0
    try:  # a body that trickles in holds a connection: the whole of it within the write timeout
        async for chunk in within(request, timeout_s):
            size += len(chunk)
            if size > MAX_BODY_BYTES:  # chunked, or longer than it said: stop reading here
                return http_error(413, "body_too_large", f"the body may be at most {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
    except BodyTimeoutError as exc:
        return http_error(408, "body_timeout", str(exc))
    except ClientDisconnect:
        return http_error(400, "bad_request", "the client went away while sending the body")
    return b"".join(chunks)


@dataclass(slots=True, frozen=True)
class _Job:
    text: str
    voice: str
    fmt: str
    params: SamplingParams
    stream_format: str
    instructions: str | None


def _parse(raw: bytes, voices: Collection[str], default_voice: str) -> _Job | Response:
    """Every field checked for its type before its value (a list where a string goes is a 400)."""
    try:
        body = decode_json(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return http_error(400, "bad_request", "the body must be a JSON object (no NaN or Infinity)")
    if not isinstance(body, dict):
        return http_error(400, "bad_request", f"the body must be a JSON object, got {type(body).__name__}")
    for name in ("model", "input", "response_format", "stream_format", "instructions"):
        if body.get(name) is not None and not isinstance(body[name], str):
            return http_error(400, "bad_request", f"'{name}' must be a string, got {_type(body[name])}")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        return http_error(400, "bad_request", "'input' must be a non-empty string")
    if len(text) > MAX_INPUT_CHARS:
        return http_error(400, "text_too_long", f"'input' has {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
    voice = body.get("voice") or default_voice
    if isinstance(voice, dict):  # newer OpenAI clients may send {"id": ...}
        voice = voice.get("id")
    if not isinstance(voice, str):
        return http_error(400, "bad_request", f"'voice' must be a string or {{\"id\": string}}, got {_type(voice)}")
    if voice in OPENAI_VOICES and voice not in voices:
        voice = default_voice
    if voice not in voices:
        return http_error(400, "unknown_voice", unknown_voice_message(voice))
    fmt = body.get("response_format") or "mp3"
    if fmt not in available_formats():
        return http_error(400, "unsupported_option",
                          f"response_format must be one of {', '.join(available_formats())}; got {fmt[:40]!r}")
    speed = body.get("speed", 1.0)
    if (isinstance(speed, bool) or not isinstance(speed, (int, float))
            or not OPENAI_MIN_SPEED <= speed <= OPENAI_MAX_SPEED):
        shown = _type(speed) if not isinstance(speed, (int, float)) else str(speed)[:40]
        return http_error(400, "unsupported_option", "speed must be a number within "
                          f"{OPENAI_MIN_SPEED}-{OPENAI_MAX_SPEED}, got {shown}")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        return http_error(400, "unsupported_option", f"stream_format must be audio or sse, got {stream_format[:40]!r}")
    params = SamplingParams(speed=min(max(float(speed), MIN_SPEED), MAX_SPEED))
    return _Job(text, voice, fmt, params, stream_format, body.get("instructions") or None)


def _type(value: Any) -> str:
    return "null" if value is None else {"list": "an array", "dict": "an object", "str": "a string",
                                         "bool": "a boolean"}.get(type(value).__name__, "a number")


def _route(segments: list[str], voice: str, languages: Languages,
           metrics: Any) -> list[tuple[str, str]]:
    """(text, voice) of each segment with something to say; what no voice can say is
    skipped (OpenAI's endpoint has no word for it): logged without the text, and counted."""
    scripts = VoiceScripts(languages.languages_of)
    out: list[tuple[str, str]] = []
    for segment in segments:
        result = route(segment, voice, languages.voice_for, scripts)
        for piece in result.skipped:
            language = piece.language or "und"
            metrics.observe("skipped:" + language, len(piece.text))
            log.info("speech: skipped %d characters of %s: no voice for it", len(piece.text), language)
        if result.text:
            out.append((result.text, result.voice))
    return out


class _Synthesis:
    """One request's engine work: segments submitted a few ahead, all freed by `close`."""

    def __init__(self, engine: EngineClient, fair_share: FairShare, catalog: VoiceChoices, key: str,
                 segments: list[tuple[str, str]], job: _Job) -> None:
        """`segments`: (text, voice) each; every voice is held until `close`."""
        self.engine, self.fair_share, self.catalog = engine, fair_share, catalog
        self.key, self.segments, self.job = key, segments, job
        self.voices = sorted({job.voice, *(voice for _, voice in segments)})
        for voice in self.voices:
            catalog.hold(voice)
        self._request_ids: list[RequestId] = []
        self._due = time.monotonic()
        self.is_closed = False

    def _submit_next(self, streams: deque[AsyncIterator[AudioChunk]]) -> None:
        index = len(self._request_ids)
        text, voice = self.segments[index]
        request_id = RequestId(f"{self.key}:{index}")
        self._request_ids.append(request_id)
        streams.append(self.engine.submit(SynthesisRequest(
            request_id, text, voice, self._due, context_key=self.key,
            instructions=self.job.instructions, params=self.job.params)))
        self._due += estimate_audio_s(text, self.job.params.speed)

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        streams: deque[AsyncIterator[AudioChunk]] = deque()
        try:
            while streams or len(self._request_ids) < len(self.segments):
                while len(streams) < MAX_SEGMENTS_AHEAD and len(self._request_ids) < len(self.segments):
                    self._submit_next(streams)
                async for chunk in streams.popleft():
                    yield chunk
        finally:
            self.close()

    def close(self) -> None:
        """Cancel every request of the body and let go of capacity and voice (idempotent).

        Synchronous on purpose: it runs while the task is being cancelled (the
        client went away), where an await could be interrupted before the end.
        """
        if self.is_closed:
            return
        self.is_closed = True
        for request_id in self._request_ids:
            self.engine.cancel(request_id)  # a no-op for requests already finished
        self.fair_share.release(self.key)
        for voice in self.voices:
            self.catalog.release(voice)


class _AudioResponse(StreamingResponse):
    """A streamed body with a write timeout, whose synthesis ends with the response."""

    def __init__(self, content: AsyncIterator[bytes], synthesis: _Synthesis, write_timeout_s: float,
                 *, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.synthesis = synthesis
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)  # cancelled when the client disconnects
        finally:
            self.synthesis.close()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            message = {"type": "http.response.body", "body": chunk, "more_body": True}
            try:
                # uvicorn's send waits while the socket's buffer is full: a client
                # that stops reading would hold its engine capacity for ever.
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except asyncio.TimeoutError:
                log.warning("speech %s: the client read nothing for %g s; synthesis stopped, "
                            "connection closed", self.synthesis.key, self.write_timeout_s)
                self.synthesis.close()
                return  # incomplete: uvicorn closes the connection
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _raw(audio: AsyncIterator[AudioChunk], encoder: ContainerStreamEncoder) -> AsyncIterator[bytes]:
    async for chunk in audio:
        data = encoder.encode(chunk.pcm)
        if data:
            yield data
    yield encoder.finish()


async def _sse(audio: AsyncIterator[AudioChunk], encoder: ContainerStreamEncoder) -> AsyncIterator[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    async for chunk in audio:
        data = encoder.encode(chunk.pcm)
        if data:
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    tail = encoder.finish()
    if tail:
        yield event({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
    yield event({"type": "speech.audio.done", "usage": None})
    await asyncio.sleep(0)
