"""What crosses the handle hop between the tiers: requests, chunks and errors as plain data.

Ray pickles whatever a call carries; plain dicts of str, float and bytes keep
that cheap and keep the engine's dataclasses free to change on one side of a
rolling upgrade. No time crosses: a request says only where its audio plays
(its context, and the context it plays after), and the engine replica times
it on its own clock (engine/clock.py), since a monotonic clock means nothing
on another machine.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from engine.errors import (
    BackendFailure,
    EngineBusyError,
    EngineError,
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

_ERRORS: dict[str, type[EngineError]] = {
    "busy": EngineBusyError,
    "unknown_voice": UnknownVoiceError,
    "unsupported_option": UnsupportedOptionError,
}


def request_to_wire(request: SynthesisRequest, gateway_id: str) -> dict[str, Any]:
    return {"request_id": request.request_id, "text": request.text, "voice": request.voice,
            "context_key": request.context_key, "plays_after": request.plays_after,
            "language": request.language, "instructions": request.instructions,
            "params": asdict(request.params), "gateway": gateway_id,
            "deadline_in_s": 0.0}  # read by a replica of the build before only: due on arrival


def request_from_wire(wire: dict[str, Any]) -> SynthesisRequest:
    # an older gateway sends `deadline_in_s` and no `plays_after`: its request plays at once
    return SynthesisRequest(RequestId(wire["request_id"]), wire["text"], wire["voice"],
                            context_key=wire["context_key"],
                            plays_after=wire.get("plays_after", ""),
                            language=wire["language"], instructions=wire["instructions"],
                            params=SamplingParams(**wire["params"]))


def chunk_to_wire(chunk: AudioChunk) -> dict[str, Any]:
    pcm = np.ascontiguousarray(chunk.pcm, dtype=np.float32)
    words = None if chunk.words is None else [(w.word, w.start_ms, w.end_ms) for w in chunk.words]
    return {"pcm": pcm.tobytes(), "sample_rate": chunk.sample_rate, "is_last": chunk.is_last,
            "words": words, "step_ms": chunk.step_ms}


def chunk_from_wire(request_id: RequestId, wire: dict[str, Any]) -> AudioChunk:
    words = None if wire["words"] is None else [WordTiming(*w) for w in wire["words"]]
    pcm = np.frombuffer(wire["pcm"], dtype=np.float32)
    # step_ms absent: an older replica
    return AudioChunk(request_id, pcm, wire["sample_rate"], wire["is_last"], words,
                      step_ms=wire.get("step_ms", 0.0))


def error_to_wire(exc: BaseException) -> dict[str, Any]:
    """An error for the gateway: its wire code and a message safe to show a client."""
    if isinstance(exc, VoxgateError):
        return {"error": exc.code, "message": str(exc)}
    return {"error": "internal", "message": "speech synthesis failed for this segment"}


def error_from_wire(wire: dict[str, Any]) -> EngineError:
    return _ERRORS.get(wire["error"], BackendFailure)(wire["message"])


def voice_to_wire(info: VoiceInfo) -> dict[str, Any]:
    return asdict(info)


def voice_from_wire(wire: dict[str, Any]) -> VoiceInfo:
    return VoiceInfo(**{**wire, "languages": tuple(wire.get("languages", ()))})
