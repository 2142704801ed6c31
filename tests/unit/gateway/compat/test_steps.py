"""`EngineTime`: the engine's step time spread over a context's audio timeline, chunk by chunk."""

from __future__ import annotations

import numpy as np
import pytest

from engine.types import AudioChunk, RequestId
from gateway.compat.steps import EngineTime

RATE = 1000  # one sample a millisecond: durations read directly


def _chunk(request: str, audio_ms: int, step_ms: float, *, is_last: bool = True) -> AudioChunk:
    return AudioChunk(RequestId(request), np.zeros(audio_ms, dtype=np.float32), RATE,
                      is_last=is_last, step_ms=step_ms)


def test_each_stretch_gets_the_share_of_the_chunks_it_overlaps() -> None:
    ledger = EngineTime()
    for request in ("r1", "r2"):
        ledger.submitted(RequestId(request), "v1")
    ledger.made(_chunk("r1", 200, 20.0, is_last=False))  # 0.1 ms of engine time per ms of audio
    ledger.made(_chunk("r1", 100, 30.0))                  # 0.3
    ledger.started("v1", RequestId("r1"), 0.0)
    assert ledger.spent("v1", 0.0, 100.0) == pytest.approx(10.0)
    # across the chunk boundary
    assert ledger.spent("v1", 150.0, 100.0) == pytest.approx(5.0 + 15.0)
    # the next request's audio follows on the same timeline, and arrived out of order: no matter
    ledger.made(_chunk("r2", 100, 50.0))
    ledger.started("v1", RequestId("r2"), 300.0)
    assert ledger.spent("v1", 250.0, 100.0) == pytest.approx(15.0 + 25.0)
    assert ledger.spent("v1", 400.0, 40.0) == 0.0  # padding past the audio made nothing


def test_the_shares_add_up_to_the_engine_time_however_the_audio_is_framed() -> None:
    ledger = EngineTime()
    steps = [(137, 11.0), (263, 47.5), (90, 3.25)]
    for n, (audio_ms, step_ms) in enumerate(steps):
        ledger.submitted(RequestId(f"r{n}"), "v1")
        ledger.made(_chunk(f"r{n}", audio_ms, step_ms))
    start = 0.0
    for n, (audio_ms, _) in enumerate(steps):
        ledger.started("v1", RequestId(f"r{n}"), start)
        start += audio_ms
    total = sum(ledger.spent("v1", pts, 20.0) for pts in np.arange(0.0, start + 20.0, 20.0))
    assert total == pytest.approx(sum(step for _, step in steps))


def test_an_empty_last_chunk_adds_its_step_to_the_audio_before_it() -> None:
    ledger = EngineTime()
    ledger.submitted(RequestId("r1"), "v1")
    ledger.made(_chunk("r1", 100, 10.0, is_last=False))
    ledger.made(_chunk("r1", 0, 5.0))
    ledger.started("v1", RequestId("r1"), 0.0)
    assert ledger.spent("v1", 0.0, 100.0) == pytest.approx(15.0)


def test_chunks_of_requests_never_submitted_or_already_cancelled_are_not_held() -> None:
    ledger = EngineTime()
    ledger.made(_chunk("stranger", 100, 10.0))
    ledger.submitted(RequestId("r1"), "v1")
    ledger.cancelled(RequestId("r1"))
    ledger.made(_chunk("r1", 100, 10.0))
    assert len(ledger) == 0


def test_a_long_answer_is_not_held_whole_only_what_is_still_being_framed() -> None:
    ledger = EngineTime()
    for n in range(500):
        request = RequestId(f"r{n}")
        ledger.submitted(request, "v1")
        ledger.made(_chunk(f"r{n}", 100, 10.0))
        ledger.started("v1", request, 100.0 * n)
        assert ledger.spent("v1", 100.0 * n, 100.0) == pytest.approx(10.0)
        assert len(ledger) <= 2
    ledger.forget_context("v1")
    assert ledger.spent("v1", 0.0, 100.0) == 0.0


def test_a_context_that_ends_drops_every_request_of_it_made_or_not() -> None:
    ledger = EngineTime()
    for n in range(3):  # made and never started, made and started, not made at all
        ledger.submitted(RequestId(f"r{n}"), "v1")
    ledger.submitted(RequestId("other"), "v2")
    ledger.made(_chunk("r0", 100, 10.0))
    ledger.made(_chunk("r1", 100, 10.0))
    ledger.started("v1", RequestId("r1"), 0.0)
    ledger.forget_context("v1")
    assert len(ledger) == 1  # v2's request only
