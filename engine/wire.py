"""The engine's face as plain data, for a gateway whose engine runs in another process.

Two hops carry it: Ray Serve's handle between the tiers (gateway/ray_serve) and the
Unix socket of `voxgate serve --workers` (gateway/workers). Both send maps of str,
numbers and bytes, which pickle and msgpack carry cheaply, and both read with
defaults what a newer build added, so one side of a rolling upgrade may be older.
No time crosses: a request says only where its audio plays (its context, and the
context it plays after), and the engine on the far side times it on its own clock
(engine/clock.py).

`RemoteFacts` is what an engine client of another process answers from the facts
the engine sent once (`info_to_wire`), and `SchedulerCounters` the scheduler view
/metrics reads from its counters (`counters_to_wire`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import (
    BackendFailure,
    EngineBusyError,
    UnknownVoiceError,
    UnsupportedOptionError,
    VoxgateError,
)
from engine.scheduler import SchedulerStats
from engine.types import (
    AudioChunk,
    RequestId,
    SamplingParams,
    SynthesisRequest,
    VoiceInfo,
    WordTiming,
)

if TYPE_CHECKING:
    from engine.client import EngineClient
    from engine.engine import Engine

#: the engine's own errors by wire code; any other code reads as a backend failure
ERRORS: dict[str, type[VoxgateError]] = {
    "busy": EngineBusyError,
    "unknown_voice": UnknownVoiceError,
    "unsupported_option": UnsupportedOptionError,
}


def request_to_wire(request: SynthesisRequest) -> dict[str, Any]:
    return {"request_id": request.request_id, "text": request.text, "voice": request.voice,
            "context_key": request.context_key, "plays_after": request.plays_after,
            "language": request.language, "instructions": request.instructions,
            "params": asdict(request.params)}


def request_from_wire(wire: dict[str, Any]) -> SynthesisRequest:
    # a gateway of an older build sends no `plays_after`: its request plays at once
    return SynthesisRequest(RequestId(wire["request_id"]), wire["text"], wire["voice"],
                            context_key=wire["context_key"],
                            plays_after=wire.get("plays_after", ""),
                            language=wire["language"], instructions=wire["instructions"],
                            params=SamplingParams(**wire["params"]))


def chunk_to_wire(chunk: AudioChunk) -> dict[str, Any]:
    """A chunk with its request id; the PCM as float32 bytes."""
    pcm = np.ascontiguousarray(chunk.pcm, dtype=np.float32)
    words = None if chunk.words is None else [[w.word, w.start_ms, w.end_ms] for w in chunk.words]
    return {"id": chunk.request_id, "pcm": pcm.tobytes(), "sample_rate": chunk.sample_rate,
            "is_last": chunk.is_last, "words": words, "step_ms": chunk.step_ms}


def chunk_from_wire(wire: dict[str, Any], request_id: RequestId | None = None) -> AudioChunk:
    """The chunk; `request_id` where the caller knows it (an older replica sends none)."""
    words = None if wire["words"] is None else [WordTiming(*w) for w in wire["words"]]
    pcm = np.frombuffer(wire["pcm"], dtype=np.float32)
    return AudioChunk(RequestId(wire["id"]) if request_id is None else request_id, pcm,
                      wire["sample_rate"], wire["is_last"], words,
                      step_ms=wire.get("step_ms", 0.0))  # absent: an older build


def error_to_wire(exc: BaseException, internal: str) -> dict[str, Any]:
    """An error as its wire code and a message safe to show a client: a voxgate error's own,
    `internal` for anything else (the far side logs it)."""
    if isinstance(exc, VoxgateError):
        return {"error": exc.code, "message": str(exc)}
    return {"error": "internal", "message": internal}


def error_from_wire(wire: dict[str, Any]) -> VoxgateError:
    return ERRORS.get(wire["error"], BackendFailure)(wire["message"])


def voice_to_wire(info: VoiceInfo) -> dict[str, Any]:
    return {**asdict(info), "languages": list(info.languages)}


def voice_from_wire(wire: dict[str, Any]) -> VoiceInfo:
    return VoiceInfo(**{**wire, "languages": tuple(wire.get("languages", ()))})


def info_to_wire(engine: EngineClient) -> dict[str, Any]:
    """What an engine says of itself once: `RemoteFacts` reads it on the other side."""
    return {"sample_rate": engine.sample_rate, "backend_name": engine.backend_name,
            "can_register_voices": engine.can_register_voices,
            "needs_transcript": engine.needs_transcript,
            "voice_features_version": engine.voice_features_version,
            "voices": [voice_to_wire(v) for v in engine.voices]}


def counters_to_wire(engine: Engine) -> dict[str, Any]:
    """The engine's and its scheduler's counters, as /metrics reads them."""
    scheduler = engine.scheduler
    return {"stats": asdict(engine.stats), "scheduler": asdict(scheduler.stats),
            "num_queued": scheduler.num_queued, "num_contexts": scheduler.num_contexts,
            "max_contexts": scheduler.max_contexts(), "is_ready": engine.is_ready,
            "is_healthy": engine.is_healthy}


@dataclass(slots=True)
class SchedulerCounters:
    """A scheduler view from counters sent over (summed over replicas on Ray)."""

    num_queued: int = 0
    num_contexts: int = 0
    total_contexts: int = 0
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    def max_contexts(self) -> int:
        return self.total_contexts


class RemoteFacts:
    """The `EngineClient` properties an engine in another process answers from its
    `info_to_wire` map (`_info`) and the voice listing last sent (`_voices`)."""

    _info: dict[str, Any]
    _voices: list[VoiceInfo]

    @property
    def sample_rate(self) -> int:
        return int(self._info["sample_rate"])

    @property
    def voices(self) -> list[VoiceInfo]:
        return self._voices

    @property
    def backend_name(self) -> str:
        return str(self._info["backend_name"])

    @property
    def can_register_voices(self) -> bool:
        return bool(self._info["can_register_voices"])

    @property
    def needs_transcript(self) -> bool:
        return bool(self._info["needs_transcript"])

    @property
    def voice_features_version(self) -> str:
        return str(self._info["voice_features_version"])
