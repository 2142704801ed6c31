"""`POST /v1/audio/speech`: OpenAI's speech endpoint, streamed as audio is made.

The input is cut by the same segmenter as the socket, every segment is
submitted at once (the first due now, the rest when the audio before them
would run out) and the body streams each segment's audio in order as soon as
it exists. `stream_format: sse` sends `speech.audio.delta` events with base64
audio, then `speech.audio.done`, as OpenAI does. The voice is checked against
the shared voice catalog and held there until the body ends, as a socket holds
its voice; refusals use the one HTTP error shape (`gateway.errors.http_error`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.engine import Engine
from engine.errors import VoxgateError
from engine.types import AudioChunk, RequestId, SamplingParams, SynthesisRequest, estimate_audio_s
from gateway.containers import ContainerStreamEncoder, available_formats
from gateway.errors import http_error
from gateway.formats import MAX_SPEED, MIN_SPEED, OPENAI_MAX_SPEED, OPENAI_MIN_SPEED
from gateway.segmenter import Segmenter
from gateway.voice_catalog import VoiceCatalog

#: OpenAI's voice names, served by the configured default voice so that
#: existing OpenAI client code works unchanged.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx",
                           "sage", "shimmer", "verse", "marin", "cedar"})
MAX_INPUT_CHARS = 4096


async def speech_endpoint(request: Request) -> Response:
    state = request.app.state.voxgate
    engine: Engine = state.engine
    if state.is_shutting_down:
        return http_error(503, "busy", "the server is shutting down")
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        return http_error(400, "bad_request", "the body must be a JSON object")
    if not isinstance(body, dict):
        return http_error(400, "bad_request", f"the body must be a JSON object, got {type(body).__name__}")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        return http_error(400, "bad_request", "'input' must be a non-empty string")
    if len(text) > MAX_INPUT_CHARS:
        return http_error(400, "text_too_long", f"'input' has {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
    catalog: VoiceCatalog = state.catalog
    voices = catalog.listed
    voice = body.get("voice") or state.config.voice
    if isinstance(voice, dict):  # newer OpenAI clients may send {"id": ...}
        voice = voice.get("id")
    if voice in OPENAI_VOICES and voice not in voices:
        voice = state.config.voice
    if not isinstance(voice, str) or voice not in voices:
        return http_error(400, "unknown_voice", f"unknown voice {voice!r}; expected one of: {', '.join(sorted(voices))}")
    fmt = body.get("response_format") or "mp3"
    if fmt not in available_formats():
        return http_error(400, "unsupported_option",
                          f"response_format must be one of {', '.join(available_formats())}; got {fmt!r}")
    speed = body.get("speed", 1.0)
    if (isinstance(speed, bool) or not isinstance(speed, (int, float))
            or not OPENAI_MIN_SPEED <= speed <= OPENAI_MAX_SPEED):
        return http_error(400, "unsupported_option", "speed must be a number within "
                          f"{OPENAI_MIN_SPEED}-{OPENAI_MAX_SPEED}, got {speed!r}")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        return http_error(400, "unsupported_option", f"stream_format must be audio or sse, got {stream_format!r}")
    instructions = body.get("instructions") or None
    if instructions is not None and not isinstance(instructions, str):
        return http_error(400, "bad_request", "'instructions' must be a string")
    if instructions and not any(v.supports_instructions for v in engine.voices if v.voice_id == voice):
        return http_error(400, "unsupported_option", f"voice {voice!r} does not take instructions")

    segmenter = Segmenter()
    segments = segmenter.push(text, 0.0) + segmenter.flush(0.0)
    if not segments:
        return http_error(400, "bad_request", "'input' has nothing speakable after cleanup")
    params = SamplingParams(speed=min(max(float(speed), MIN_SPEED), MAX_SPEED))
    key = "http/" + uuid.uuid4().hex[:12]
    try:
        engine.admit(key)
    except VoxgateError as exc:
        return http_error(503, exc.code, str(exc))
    catalog.hold(voice)  # both let go when the body ends (_synthesize)
    state.metrics.http_speech.inc()
    encoder = ContainerStreamEncoder(fmt, engine.sample_rate)
    audio = _synthesize(engine, catalog, key, segments, voice, instructions, params)
    if stream_format == "sse":
        return StreamingResponse(_sse(audio, encoder), media_type="text/event-stream")
    return StreamingResponse(_raw(audio, encoder), media_type=encoder.content_type)


async def _synthesize(engine: Engine, catalog: VoiceCatalog, key: str, segments: list[str], voice: str,
                      instructions: str | None, params: SamplingParams) -> AsyncIterator[AudioChunk]:
    now = time.monotonic()
    streams = []
    due = now
    try:
        for i, text in enumerate(segments):
            request = SynthesisRequest(RequestId(f"{key}:{i}"), text, voice, due, context_key=key,
                                       instructions=instructions, params=params)
            streams.append(engine.submit(request))
            due += estimate_audio_s(text, params.speed)
        for stream in streams:
            async for chunk in stream:
                yield chunk
    finally:
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
        engine.release_context(key)
        catalog.release(voice)


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
