"""The handle hop's plain data: an engine chunk crosses whole, its step time with it; a request
crosses with where it plays and no time; the replicas' counters are summed."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from engine.stats import EngineStats
from engine.types import AudioChunk, RequestId, SamplingParams, SynthesisRequest, WordTiming
from gateway.ray_serve.replicas import sum_reports
from gateway.ray_serve.wire import (
    chunk_from_wire,
    chunk_to_wire,
    request_from_wire,
    request_to_wire,
)


def test_a_chunk_crosses_with_its_words_and_step_time() -> None:
    chunk = AudioChunk(RequestId("r1"), np.linspace(-0.5, 0.5, 441, dtype=np.float32), 22050,
                       is_last=True, words=[WordTiming("hi", 0.0, 20.0)], step_ms=12.5)
    back = chunk_from_wire(chunk_to_wire(chunk), RequestId("r1"))
    assert np.array_equal(back.pcm, chunk.pcm) and (back.sample_rate, back.is_last) == (22050, True)
    assert back.words == chunk.words and back.step_ms == 12.5


def test_a_chunk_from_a_replica_that_sends_no_step_time_reads_as_zero() -> None:
    wire = chunk_to_wire(AudioChunk(RequestId("r1"), np.zeros(10, dtype=np.float32), 22050,
                                    is_last=False))
    del wire["step_ms"]  # a replica of the build before, during a rolling upgrade
    assert chunk_from_wire(wire, RequestId("r1")).step_ms == 0.0


def test_a_request_crosses_with_where_it_plays_and_no_time() -> None:
    request = SynthesisRequest(RequestId("s:3"), "Hello.", "joe", context_key="s/c2",
                               plays_after="s/c1",
                               params=SamplingParams(speed=1.25))
    wire = request_to_wire(request, "gateway-1")
    assert wire["deadline_in_s"] == 0.0  # for a replica of the build before only: due on arrival
    assert request_from_wire(wire) == request
    del wire["plays_after"]  # a gateway of the build before, during a rolling upgrade
    assert request_from_wire(wire).plays_after == ""


def test_the_replicas_waits_are_summed_by_reason() -> None:
    def report(waits: dict[str, int]) -> dict[str, Any]:
        return {"num_queued": 0, "num_contexts": 0, "max_contexts": 1, "scheduler": {},
                "stats": asdict(EngineStats(waits=waits))}

    _, stats = sum_reports([report({"flow_cache": 2}), report({"flow_cache": 1, "lm_slot": 4})])
    assert stats.waits == {"flow_cache": 3, "lm_slot": 4}


def test_the_replicas_histograms_are_summed_bucket_by_bucket() -> None:
    def report(first_audio_s: list[float]) -> dict[str, Any]:
        stats = EngineStats()
        for seconds in first_audio_s:
            stats.observe_first_audio(seconds)
            stats.observe_step(seconds / 10)
        return {"num_queued": 0, "num_contexts": 0, "max_contexts": 1, "scheduler": {},
                "stats": asdict(stats)}

    one, two = report([0.12, 0.9]), report([0.14])
    del two["stats"]["first_audio_bucket_counts"]  # a replica of the build before: none
    _, stats = sum_reports([one, report([0.3]), two])
    expected = EngineStats()
    for seconds in (0.12, 0.9, 0.3):
        expected.observe_first_audio(seconds)
    assert stats.first_audio_bucket_counts == expected.first_audio_bucket_counts
    assert sum(stats.step_bucket_counts) == 4
