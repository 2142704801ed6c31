"""What crosses the channel: engine requests, chunks, voices and errors as msgpack-ready maps.

Both ends are the same build on one machine, so the maps follow the engine's
types field for field; only the PCM changes form (float32 bytes). No time
crosses either: the engine process times each request on its own clock.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from engine.errors import (
    BackendFailure,
    EngineBusyError,
    UnknownVoiceError,
    UnsupportedOptionError,
    VoxgateError,
)
from engine.types import (
    AudioChunk,
    RequestId,
    SamplingParams,
    SynthesisRequest,
    VoiceInfo,
    WordTiming,
)
from gateway.errors import ShareExceededError

_ERRORS: dict[str, type[VoxgateError]] = {
    "busy": EngineBusyError,
    "unknown_voice": UnknownVoiceError,
    "unsupported_option": UnsupportedOptionError,
    "rate_limited": ShareExceededError,
}


def request_to_wire(request: SynthesisRequest) -> dict[str, Any]:
    return {"request_id": request.request_id, "text": request.text, "voice": request.voice,
            "context_key": request.context_key, "plays_after": request.plays_after,
            "language": request.language, "instructions": request.instructions,
            "params": asdict(request.params)}


def request_from_wire(wire: dict[str, Any]) -> SynthesisRequest:
    return SynthesisRequest(RequestId(wire["request_id"]), wire["text"], wire["voice"],
                            context_key=wire["context_key"], plays_after=wire["plays_after"],
                            language=wire["language"], instructions=wire["instructions"],
                            params=SamplingParams(**wire["params"]))


def chunk_to_wire(chunk: AudioChunk) -> dict[str, Any]:
    pcm = np.ascontiguousarray(chunk.pcm, dtype=np.float32)
    words = None if chunk.words is None else [[w.word, w.start_ms, w.end_ms] for w in chunk.words]
    return {"id": chunk.request_id, "pcm": pcm.tobytes(), "rate": chunk.sample_rate,
            "last": chunk.is_last, "words": words, "step_ms": chunk.step_ms}


def chunk_from_wire(wire: dict[str, Any]) -> AudioChunk:
    words = None if wire["words"] is None else [WordTiming(*w) for w in wire["words"]]
    return AudioChunk(RequestId(wire["id"]), np.frombuffer(wire["pcm"], dtype=np.float32),
                      wire["rate"], wire["last"], words, step_ms=wire["step_ms"])


def error_to_wire(exc: BaseException) -> dict[str, Any]:
    """An error as its code and a message safe to show a client; a ValueError keeps its
    kind (the voice verbs raise it for audio or metadata the engine cannot use)."""
    if isinstance(exc, VoxgateError):
        return {"error": exc.code, "message": str(exc)}
    if isinstance(exc, ValueError):
        return {"error": "value", "message": str(exc)}
    return {"error": "internal", "message": "the engine process failed this call; it logged why"}


def error_from_wire(wire: dict[str, Any]) -> Exception:
    if wire["error"] == "value":
        return ValueError(wire["message"])
    return _ERRORS.get(wire["error"], BackendFailure)(wire["message"])


def voice_to_wire(info: VoiceInfo) -> dict[str, Any]:
    return {**asdict(info), "languages": list(info.languages)}


def voice_from_wire(wire: dict[str, Any]) -> VoiceInfo:
    return VoiceInfo(**{**wire, "languages": tuple(wire["languages"])})
