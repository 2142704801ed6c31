"""The GPU-shaped synthetic engine: CosyVoice's chunks, the H200's step times, a flow tick.

Stepped directly with a fake clock (the backend's `clock` and `sleep`), so every time here is
the model's arithmetic, never a wall time.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from bench.gpu_shaped import (
    LM_BATCHES,
    LM_DECODE_MS,
    LM_SAMPLING_MS,
    GpuShape,
    GpuShapedBackend,
    fit_line,
    interpolate,
)
from engine.backend import BackendRequest, StepResult
from engine.errors import UnknownVoiceError
from engine.types import RequestId, SynthesisRequest


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def make_backend(shape: GpuShape | None = None) -> tuple[GpuShapedBackend, FakeClock]:
    clock = FakeClock()
    backend = GpuShapedBackend(shape, clock=clock, sleep=clock.sleep)
    backend.load()
    return backend, clock


def prepare(backend: GpuShapedBackend, text: str, name: str = "r1") -> BackendRequest:
    return backend.prepare(SynthesisRequest(RequestId(name), text, "joe"))


def run_to_end(
    backend: GpuShapedBackend, items: list[BackendRequest]
) -> dict[str, list[StepResult]]:
    out: dict[str, list[StepResult]] = {str(i.request_id): [] for i in items}
    live = list(items)
    for _ in range(10_000):
        if not live:
            return out
        for item, result in zip(live, backend.step(live), strict=True):
            out[str(item.request_id)].append(result)
        live = [i for i in live if not out[str(i.request_id)][-1].is_finished]
    raise AssertionError("expected every request to finish within 10,000 steps")


def test_chunks_are_a_short_first_hop_then_the_25_token_grid_then_the_rest() -> None:
    backend, _ = make_backend()
    item = prepare(backend, "x" * 70)  # 5 s at 14 characters a second: 125 tokens
    chunks = [r.pcm for r in run_to_end(backend, [item])["r1"] if len(r.pcm)]
    tokens = [len(c) // 960 for c in chunks]
    assert tokens == [15, 10, 25, 25, 25, 25]
    assert all(len(c) % 960 == 0 for c in chunks)
    audio = np.concatenate(chunks)
    assert len(audio) == 125 * 960 and item.est_audio_s == pytest.approx(5.0)
    assert 0.02 < float(np.sqrt(np.mean(audio**2))) < 0.5  # speech-like, not silence


def test_a_chinese_answer_is_spoken_at_a_syllable_pace_not_at_fourteen_characters() -> None:
    backend, _ = make_backend()
    chinese = prepare(backend, "没问题，关于存钱，", "zh")  # 7 syllables at 0.18 s, 2 commas
    japanese = prepare(backend, "こんにちは", "ja")  # 5 kana at 0.12 s
    assert chinese.est_audio_s == pytest.approx(7 * 0.18 + 2 / 14)
    assert japanese.est_audio_s == pytest.approx(5 * 0.12)
    made = run_to_end(backend, [chinese])["zh"]
    assert sum(len(r.pcm) for r in made) == math.ceil(chinese.est_audio_s * 25) * 960


def test_a_short_answer_is_one_chunk_and_empty_text_finishes_silent() -> None:
    backend, _ = make_backend()
    short, empty = prepare(backend, "Hi there.", "short"), prepare(backend, "  ", "empty")
    results = run_to_end(backend, [short, empty])
    assert [len(r.pcm) // 960 for r in results["short"] if len(r.pcm)] == [
        17
    ]  # 0.64 s: 16.07 -> 17
    assert [(len(r.pcm), r.is_finished) for r in results["empty"]] == [(0, True)]


def test_each_step_takes_the_lm_time_of_its_batch_and_audio_waits_for_a_flow_tick() -> None:
    shape = GpuShape()
    backend, clock = make_backend(shape)
    items = [prepare(backend, "x" * 42, f"r{i}") for i in range(4)]
    start = clock.now
    backend.step(items)
    assert clock.now - start == pytest.approx(shape.lm_step_ms(4) / 1e3)
    for _ in range(17):  # 18 tokens: the first hop and its lookahead; the tick starts as this ends
        backend.step(items)
    ticked = clock.now
    results = backend.step(items)
    assert not any(len(r.pcm) for r in results)
    while not any(len(r.pcm) for r in results):
        results = backend.step(items)
    # its chunks come with the first step that ends after the tick, the LM stepping meanwhile
    assert ticked + shape.tick_ms(4) / 1e3 <= clock.now < ticked + shape.tick_ms(4) / 1e3 + 0.006
    assert all(len(r.pcm) == 15 * 960 for r in results)
    assert backend.snapshot()["ticks"] == 1 and backend.snapshot()["tick_streams"] == 4


def test_the_lm_step_follows_the_measured_points_and_a_tick_grows_with_its_streams() -> None:
    shape = GpuShape()
    for batch, decode, sampling in zip(LM_BATCHES, LM_DECODE_MS, LM_SAMPLING_MS, strict=True):
        assert shape.lm_step_ms(batch) == pytest.approx(decode + sampling)
    assert shape.lm_step_ms(1) < shape.lm_step_ms(100) < shape.lm_step_ms(256)
    assert shape.tick_ms(1) < shape.tick_ms(64) < shape.tick_ms(128)
    assert 400 < shape.audio_s_per_s(128) < 600  # the estimator's graphs: ~500 audio-s/s
    assert shape.prefill_ms(8) == 0 and GpuShape.pipeline().prefill_ms(8) > 25
    assert GpuShape.pipeline().audio_s_per_s(128) < 300  # eager HiFT halves it


def test_fits_and_interpolation() -> None:
    assert fit_line([(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) == pytest.approx((1.0, 2.0))
    assert interpolate([1, 2, 4], [10.0, 20.0, 30.0], 3) == pytest.approx(25.0)
    assert interpolate([1, 2, 4], [10.0, 20.0, 30.0], 0) == 10.0
    assert interpolate([1, 2, 4], [10.0, 20.0, 30.0], 6) == pytest.approx(40.0)


def test_a_shape_is_set_by_preset_and_key_value_items_and_bad_ones_are_refused() -> None:
    shape = GpuShape.from_spec(["pipeline", "hift_ms_per_stream=0", "max_flow_streams=64"])
    assert (
        shape.prefill_fixed_ms > 0
        and shape.hift_ms_per_stream == 0
        and shape.max_flow_streams == 64
    )
    with pytest.raises(ValueError, match="expected 'pipeline' or KEY=VALUE"):
        GpuShape.from_spec(["no_such_knob=1"])
    with pytest.raises(ValueError, match="expected parallelism >= 1"):
        GpuShape(parallelism=0)


def test_a_request_released_while_its_chunk_is_computed_gets_nothing_and_others_go_on() -> None:
    backend, _ = make_backend()
    gone, kept = prepare(backend, "x" * 42, "gone"), prepare(backend, "x" * 42, "kept")
    for _ in range(19):
        backend.step([gone, kept])
    backend.release(gone)
    results = run_to_end(backend, [kept])["kept"]
    assert sum(len(r.pcm) for r in results) == 75 * 960 and results[-1].is_finished


def test_backend_facts_the_engine_reads() -> None:
    backend, _ = make_backend()
    assert (backend.max_batch_size, backend.parallelism, backend.context_capacity()) == (
        256,
        256,
        300,
    )
    assert [v.voice_id for v in backend.voices()] == ["joe"] and backend.sample_rate == 24000
    with pytest.raises(UnknownVoiceError, match="expected one of: joe"):
        backend.prepare(SynthesisRequest(RequestId("x"), "Hi.", "nobody"))


@pytest.mark.parametrize(("horizon_s", "first_tick"), [(0.5, 2), (0.0, 3)])
def test_a_tick_leaves_streams_needed_beyond_its_horizon_for_later(
    horizon_s: float, first_tick: int
) -> None:
    """The cosyvoice backend's `plan_flow` rule (its dues are the engine's, monotonic)."""
    shape = GpuShape(flow_horizon_s=horizon_s, flow_min_rows=1)
    backend, _ = make_backend(shape)
    items = [prepare(backend, "x" * 42, f"r{i}") for i in range(3)]
    now = time.monotonic()
    items[0].due, items[1].due, items[2].due = now, now + 0.1, now + 10.0
    while not backend.snapshot()["ticks"]:
        backend.step(items)
    assert backend.snapshot()["tick_streams"] == first_tick
    results = run_to_end(backend, items)  # the one left out comes in a later tick
    assert all(sum(len(r.pcm) for r in results[f"r{i}"]) == 3 * 24000 for i in range(3))
