"""The request table (engine/requests.py) with a fake clock: each request's due time comes from the
order alone, and a context's playback record lives as long as its admission."""

from __future__ import annotations

import numpy as np
import pytest

from engine.clock import RequestHandle
from engine.errors import EngineBusyError, EngineError
from engine.requests import RequestTable
from engine.types import AudioChunk, RequestId, SynthesisRequest

RATE = 1000  # samples per second: a chunk of n samples is n ms


def request(name: str, context: str = "", plays_after: str = "") -> SynthesisRequest:
    return SynthesisRequest(RequestId(name), "text", "v", context_key=context,
                            plays_after=plays_after)


def speak(handle: RequestHandle, seconds: float, now: float, table: RequestTable) -> None:
    """The request made `seconds` of audio, its listener took it at `now`, and it finished."""
    handle.made_s += seconds
    pcm = np.zeros(round(seconds * RATE), np.float32)
    handle.took(AudioChunk(handle.request.request_id, pcm, RATE, True), now)
    handle.is_finished = True
    table.end(handle)


def test_an_admitted_contexts_next_segment_is_due_when_the_audio_before_it_runs_out() -> None:
    table = RequestTable(16, is_admitted=lambda key: key == "turn")
    first = table.add(request("t0", "turn"), now=0.0)
    assert first.start() == 0.0  # nothing before it: first audio now
    speak(first, 2.0, now=0.0, table=table)
    late = table.add(request("t1", "turn"), now=5.0)  # the text came after the audio ran out
    assert late.start() == pytest.approx(2.0) and late.lead(5.0) == pytest.approx(-3.0)  # dry 3 s
    table.release_context("turn")
    again = table.add(request("t2", "turn"), now=9.0)
    assert again.start() == 9.0  # a context admitted anew starts afresh


def test_a_context_never_admitted_forgets_its_record_with_its_last_request() -> None:
    table = RequestTable(16, is_admitted=lambda key: False)
    first = table.add(request("b0", "bench"), now=0.0)
    second = table.add(request("b1", "bench"), now=0.1)
    assert second.prev is first  # both live: the second plays after the first
    speak(first, 1.0, now=0.0, table=table)
    assert "bench" in table.records  # its newest request still runs
    speak(second, 1.0, now=1.0, table=table)
    assert table.records == {}
    assert table.add(request("b2", "bench"), now=7.0).start() == 7.0


def test_a_context_plays_after_the_one_it_names_and_after_nothing_it_does_not_know() -> None:
    table = RequestTable(16, is_admitted=lambda key: True)
    talking = table.add(request("a0", "a"), now=0.0)
    talking.est_s = 3.0
    queued = table.add(request("b0", "b", plays_after="a"), now=0.5)
    assert queued.start() == pytest.approx(3.0) and queued.lead(0.5) == pytest.approx(2.5)
    unknown = table.add(request("c0", "c", plays_after="gone"), now=0.5)  # released, or never here
    assert unknown.start() == 0.5


def test_a_request_id_in_use_and_a_full_table_are_refused() -> None:
    table = RequestTable(1, is_admitted=lambda key: False)
    table.add(request("x"), now=0.0)
    with pytest.raises(EngineError, match="already in use"):
        table.add(request("x"), now=0.0)
    with pytest.raises(EngineBusyError, match="1 requests already"):
        table.add(request("y"), now=0.0)
