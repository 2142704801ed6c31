"""The handle hop's plain data: an engine chunk crosses whole, its step time with it."""

from __future__ import annotations

import numpy as np

from engine.types import AudioChunk, RequestId, WordTiming
from gateway.ray_serve.wire import chunk_from_wire, chunk_to_wire


def test_a_chunk_crosses_with_its_words_and_step_time() -> None:
    chunk = AudioChunk(RequestId("r1"), np.linspace(-0.5, 0.5, 441, dtype=np.float32), 22050, is_last=True,
                       words=[WordTiming("hi", 0.0, 20.0)], step_ms=12.5)
    back = chunk_from_wire(RequestId("r1"), chunk_to_wire(chunk))
    assert np.array_equal(back.pcm, chunk.pcm) and (back.sample_rate, back.is_last) == (22050, True)
    assert back.words == chunk.words and back.step_ms == 12.5


def test_a_chunk_from_a_replica_that_sends_no_step_time_reads_as_zero() -> None:
    wire = chunk_to_wire(AudioChunk(RequestId("r1"), np.zeros(10, dtype=np.float32), 22050, is_last=False))
    del wire["step_ms"]  # a replica of the build before, during a rolling upgrade
    assert chunk_from_wire(RequestId("r1"), wire).step_ms == 0.0
