"""`POST /v1/audio/speech`: OpenAI's speech endpoint, streamed as audio is made.

A thin shell over the native session: the request is one turn of the same
sans-I/O `Session` the sockets drive (gateway/http/turn.py), so the input is
cut by the same segmenter, routed by language the same way (docs/voices.md,
"Languages": a segment its voice cannot speak goes to the server's
`--voice-for` voice, text no voice can say is skipped, logged once without
the text and counted), admitted the same way (the caller's fair share,
gateway/access/fair_share.py, then the engine), and its segments go to the
engine within the same look-ahead window, each due when the audio before it
would run out (gateway/stream/synthesis.py). The body streams each segment's
audio in order as soon as it exists, encoded once in the response format
(`RESPONSE_FORMATS`, gateway/audio/encoders.py). `stream_format: sse` sends
`speech.audio.delta` events with base64 audio, then `speech.audio.done`, as
OpenAI does. The voice is resolved in the caller's tenant (the voice
catalog's view for the request's principal: another tenant's id is
`unknown_voice`) and held until the body ends, as a socket holds its voice;
refusals use the one HTTP error shape (`gateway.errors.http_error`).

Work is checked before it is done: the key and the Origin first (the access
guard, before the route), then the body: `application/json` (415), no larger
than MAX_BODY_BYTES by its Content-Length or as it streams (413, before it is
read whole), whole within `slow_consumer_timeout_s` however it trickles in
(408, gateway/bodies.py), and every field of the right type (400). Once
streaming, a client that reads nothing for `slow_consumer_timeout_s` (the
write timeout) or goes away ends its synthesis at once: every engine request
of the body is cancelled, not only the one being read.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import uuid
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.access.fair_share import owner_of
from gateway.access.guard import principal
from gateway.access.keys import presented_key
from gateway.audio.containers import is_available
from gateway.audio.encoders import AudioEncoder
from gateway.audio.formats import (
    MAX_SPEED,
    MIN_SPEED,
    OPENAI_MAX_SPEED,
    OPENAI_MIN_SPEED,
    AudioFormat,
)
from gateway.bodies import BodyTimeoutError, within
from gateway.errors import http_error
from gateway.http.turn import SpeechTurn
from gateway.state import AppState
from gateway.stream.messages import decode_json
from gateway.stream.options import Limits, SessionOptions
from gateway.stream.session import Session
from gateway.voices.catalog import unknown_voice_message
from gateway.voices.policy import OPENAI_VOICE_NAMES

log = logging.getLogger("voxgate.gateway")

MAX_INPUT_CHARS = 4096
#: the largest body taken: a 4,096-character input written entirely as \\uXXXX
#: escapes is 24 KiB; the rest is room for instructions and the other fields
MAX_BODY_BYTES = 64 * 1024


@dataclass(slots=True, frozen=True)
class ResponseFormat:
    """One of OpenAI's `response_format`s: what the body is, and its Content-Type."""

    audio: AudioFormat
    content_type: str


#: OpenAI's names, in its order; raw PCM comes as it is made (unframed: nothing padded)
RESPONSE_FORMATS = {
    "opus": ResponseFormat(AudioFormat("ogg_opus", 48000, 100, 32000), "audio/ogg"),
    "wav": ResponseFormat(AudioFormat("wav", 24000), "audio/wav"),
    "pcm": ResponseFormat(AudioFormat("pcm16", 24000, 0), "audio/pcm"),
    "mp3": ResponseFormat(AudioFormat("mp3", 24000, bitrate=64000), "audio/mpeg"),
    "flac": ResponseFormat(AudioFormat("flac", 24000), "audio/flac"),
    "aac": ResponseFormat(AudioFormat("aac", 24000, bitrate=64000), "audio/aac"),
}
#: the HTTP status of each refusal a turn may meet before its first audio
_STATUS = {"rate_limited": 429, "busy": 503}


def available_formats() -> tuple[str, ...]:
    """The `response_format` values this build can produce, in OpenAI's order."""
    return tuple(name for name, fmt in RESPONSE_FORMATS.items()
                 if fmt.audio.is_framed or is_available(fmt.audio.kind))


async def speech_endpoint(request: Request) -> Response:
    state: AppState = request.app.state.voxgate
    engine = state.engine
    if state.is_shutting_down:
        return http_error(503, "busy", "the server is shutting down")
    timeout_s = state.config.limits.slow_consumer_timeout_s
    body = await _read_body(request, timeout_s)
    if isinstance(body, Response):
        return body
    catalog = state.catalog.view(principal(request))  # the voices of this request's tenant
    job = _parse(body, catalog.listed, state.config.voice)
    if isinstance(job, Response):
        return job
    if job.instructions and not any(v.supports_instructions for v in engine.voices
                                    if v.voice_id == job.voice):
        return http_error(400, "unsupported_option",
                          f"voice {job.voice!r} does not take instructions")

    owner = owner_of(presented_key(request.headers, dict(request.query_params)),
                     request.client.host if request.client else None,
                     is_auth_enabled=state.config.auth.is_enabled)
    fair_share = state.fair_share
    output = RESPONSE_FORMATS[job.fmt]

    def open_encoder(context_id: str, options: SessionOptions) -> AudioEncoder:
        return state.encoders.open(output.audio, engine.sample_rate)

    session = Session(  # holds its voice until the turn is closed
        "http-" + uuid.uuid4().hex[:12], catalog=catalog, sample_rate=engine.sample_rate,
        options=SessionOptions(voice=job.voice, instructions=job.instructions, speed=job.speed),
        limits=Limits(max_text_per_context=MAX_INPUT_CHARS),
        admit=lambda key: fair_share.admit(owner, key), release=fair_share.release,
        languages=state.languages, open_encoder=open_encoder)
    turn = SpeechTurn(session, engine, state.metrics,
                      max_buffered_bytes=state.config.limits.max_send_buffer_bytes // 4)
    turn.begin(job.text)
    refused = _refused(turn, job.voice)
    if refused is not None:
        turn.close()
        return refused
    state.metrics.http_speech.inc()
    if job.stream_format == "sse":
        return _AudioResponse(_sse(turn.body()), turn, timeout_s, media_type="text/event-stream")
    return _AudioResponse(turn.body(), turn, timeout_s, media_type=output.content_type)


def _refused(turn: SpeechTurn, voice: str) -> Response | None:
    """The answer when the turn cannot speak at all: refused admission, or nothing to say."""
    if turn.refusal is not None:
        code = turn.refusal.code
        return http_error(_STATUS.get(code, 503), code, turn.refusal.message)
    if turn.num_spoken == 0:  # over before it began
        if turn.skipped:
            return http_error(400, "bad_request", f"'input' has nothing voice {voice!r} can "
                              "say, and the server maps no voice for its language "
                              "(docs/voices.md)")
        return http_error(400, "bad_request", "'input' has nothing speakable after cleanup")
    return None


async def _read_body(request: Request, timeout_s: float) -> bytes | Response:
    """The body, refused before it is read when it is not JSON or too large."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        return http_error(415, "not_json",
                          "the body must be JSON, sent as Content-Type: application/json; "
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
                return http_error(413, "body_too_large",
                                  f"the body may be at most {MAX_BODY_BYTES} bytes")
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
    speed: float  # the engine's range (OpenAI's is clamped onto it)
    stream_format: str
    instructions: str | None


def _parse(raw: bytes, voices: Collection[str], default_voice: str) -> _Job | Response:
    """Every field checked for its type before its value (a list where a string goes is a 400)."""
    try:
        body = decode_json(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return http_error(400, "bad_request", "the body must be a JSON object (no NaN or Infinity)")
    if not isinstance(body, dict):
        return http_error(400, "bad_request",
                          f"the body must be a JSON object, got {type(body).__name__}")
    for name in ("model", "input", "response_format", "stream_format", "instructions"):
        if body.get(name) is not None and not isinstance(body[name], str):
            return http_error(400, "bad_request",
                              f"'{name}' must be a string, got {_type(body[name])}")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        return http_error(400, "bad_request", "'input' must be a non-empty string")
    if len(text) > MAX_INPUT_CHARS:
        return http_error(400, "text_too_long",
                          f"'input' has {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
    voice = body.get("voice") or default_voice
    if isinstance(voice, dict):  # newer OpenAI clients may send {"id": ...}
        voice = voice.get("id")
    if not isinstance(voice, str):
        return http_error(400, "bad_request",
                          f"'voice' must be a string or {{\"id\": string}}, got {_type(voice)}")
    if voice in OPENAI_VOICE_NAMES and voice not in voices:
        voice = default_voice
    if voice not in voices:
        return http_error(400, "unknown_voice", unknown_voice_message(voice))
    fmt = body.get("response_format") or "mp3"
    if fmt not in available_formats():
        return http_error(400, "unsupported_option",
                          f"response_format must be one of {', '.join(available_formats())}; got "
                          f"{fmt[:40]!r}")
    speed = body.get("speed", 1.0)
    if (isinstance(speed, bool) or not isinstance(speed, (int, float))
            or not OPENAI_MIN_SPEED <= speed <= OPENAI_MAX_SPEED):
        shown = _type(speed) if not isinstance(speed, (int, float)) else str(speed)[:40]
        return http_error(400, "unsupported_option", "speed must be a number within "
                          f"{OPENAI_MIN_SPEED}-{OPENAI_MAX_SPEED}, got {shown}")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        return http_error(400, "unsupported_option",
                          f"stream_format must be audio or sse, got {stream_format[:40]!r}")
    speed = min(max(float(speed), MIN_SPEED), MAX_SPEED)
    return _Job(text, voice, fmt, speed, stream_format, body.get("instructions") or None)


def _type(value: Any) -> str:
    return "null" if value is None else {"list": "an array", "dict": "an object", "str": "a string",
                                         "bool": "a boolean"}.get(type(value).__name__, "a number")


class _AudioResponse(StreamingResponse):
    """A streamed body with a write timeout, whose turn ends with the response."""

    def __init__(self, content: AsyncIterator[bytes], turn: SpeechTurn, write_timeout_s: float,
                 *, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.turn = turn
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)  # cancelled when the client disconnects
        finally:
            self.turn.close()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            message = {"type": "http.response.body", "body": chunk, "more_body": True}
            try:
                # uvicorn's send waits while the socket's buffer is full: a client
                # that stops reading would hold its engine capacity for ever.
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except asyncio.TimeoutError:
                log.warning("speech %s: the client read nothing for %g s; synthesis stopped, "
                            "connection closed", self.turn.key, self.write_timeout_s)
                self.turn.close()
                return  # incomplete: uvicorn closes the connection
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _sse(audio: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    async for data in audio:
        yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    yield event({"type": "speech.audio.done", "usage": None})
    await asyncio.sleep(0)
