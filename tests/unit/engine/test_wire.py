"""The engine's plain data, as both hops carry it: msgpack (the --workers channel) and pickle
(Ray's handle). What one side sends the other reads back equal; an older side's missing
fields read with defaults; errors come back as their own kinds."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import numpy as np
import pytest

from engine.errors import BackendFailure, EngineBusyError, UnknownVoiceError
from engine.types import (
    AudioChunk,
    RequestId,
    SamplingParams,
    SynthesisRequest,
    VoiceInfo,
    WordTiming,
)
from engine.wire import (
    RemoteFacts,
    chunk_from_wire,
    chunk_to_wire,
    error_from_wire,
    error_to_wire,
    request_from_wire,
    request_to_wire,
    voice_from_wire,
    voice_to_wire,
)

HOPS = {
    "msgpack": lambda m: msgpack.unpackb(msgpack.packb(m)),
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
}


@pytest.mark.parametrize("hop", sorted(HOPS))
def test_a_chunk_request_and_voice_cross_either_hop_equal(hop: str) -> None:
    carry = HOPS[hop]
    chunk = AudioChunk(RequestId("r1"), np.linspace(-0.5, 0.5, 441, dtype=np.float32), 22050,
                       is_last=True, words=[WordTiming("hi", 0.0, 20.0)], step_ms=12.5)
    back = chunk_from_wire(carry(chunk_to_wire(chunk)))
    assert back.request_id == "r1" and np.array_equal(back.pcm, chunk.pcm)
    assert (back.sample_rate, back.is_last, back.step_ms) == (22050, True, 12.5)
    assert back.words == chunk.words
    request = SynthesisRequest(RequestId("s:1"), "Hello.", "joe", context_key="s/c",
                               plays_after="s/b", params=SamplingParams(speed=1.25))
    assert request_from_wire(carry(request_to_wire(request))) == request
    voice = VoiceInfo("v", "V", "en-US", "piper", 22050, languages=("en", "fr"))
    assert voice_from_wire(carry(voice_to_wire(voice))) == voice


def test_an_older_sides_chunk_without_id_or_step_time_reads_with_the_callers_id() -> None:
    wire = chunk_to_wire(AudioChunk(RequestId("r1"), np.zeros(4, dtype=np.float32), 16000,
                                    is_last=False))
    del wire["id"], wire["step_ms"]
    back = chunk_from_wire(wire, RequestId("r9"))
    assert back.request_id == "r9" and back.step_ms == 0.0


def test_errors_cross_as_their_kind_and_anything_else_as_a_safe_message() -> None:
    assert isinstance(error_from_wire(error_to_wire(EngineBusyError("full"), "x")),
                      EngineBusyError)
    assert isinstance(error_from_wire(error_to_wire(UnknownVoiceError("no"), "x")),
                      UnknownVoiceError)
    wire = error_to_wire(RuntimeError("/secret/path failed"), "synthesis failed")
    assert wire == {"error": "internal", "message": "synthesis failed"}
    assert isinstance(error_from_wire(wire), BackendFailure)


def test_remote_facts_answer_what_the_engine_sent() -> None:
    class Facts(RemoteFacts):
        def __init__(self, info: dict[str, Any]) -> None:
            self._info = info
            self._voices = [voice_from_wire(v) for v in info["voices"]]

    voice = VoiceInfo("v", "V", "en-US", "cosyvoice", 24000)
    facts = Facts({"sample_rate": 24000, "backend_name": "cosyvoice",
                   "can_register_voices": True, "needs_transcript": False,
                   "voice_features_version": "3", "voices": [voice_to_wire(voice)]})
    assert (facts.sample_rate, facts.backend_name, facts.voices) == (24000, "cosyvoice", [voice])
    assert facts.can_register_voices and not facts.needs_transcript
    assert facts.voice_features_version == "3"
