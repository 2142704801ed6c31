"""A context's segments continue one LM sequence (lm_context="continue"): one prompt prefill per
context, the first segment as a lone request speaks it, and whatever ends the context frees it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.backends.cosyvoice.backend import CosyState, CosyVoiceBackend
from engine.backends.cosyvoice.frontend.frontend import LMInput
from engine.backends.cosyvoice.lm.driver import LMStart, TorchLMDriver
from engine.backends.cosyvoice.lm.runner import SpeechLMRunner
from engine.backends.cosyvoice.models.qwen2 import CacheView, SlotKVCache
from engine.backends.cosyvoice.models.speech_lm import SpeechLM
from engine.backends.cosyvoice.models.speech_lm_load import load_speech_lm
from engine.engine import Engine, EngineConfig
from engine.types import RequestId, SynthesisRequest
from tests.support.cosyvoice_parity import (
    assert_close_report,
    load_fixture,
    one_torch_thread,  # noqa: F401 (autouse)
)
from tests.support.cosyvoice_steps import Requests, run
from tests.support.cosyvoice_steps import make_backend as make_tiny_backend
from tests.support.wait import wait_until

# -- the runner: a continuation is the sequence a single prefill of it would be --------------------


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def loaded(request: pytest.FixtureRequest) -> tuple[SpeechLM, dict[str, Any]]:
    model_dir, reference = load_fixture(request.param)
    return load_speech_lm(model_dir), reference


def whole_sequence_greedy(lm: SpeechLM, embeds: torch.Tensor, steps: int, min_len: int
                          ) -> tuple[torch.Tensor, list[int]]:
    """Greedy tokens after `embeds` [T, D], recomputing the whole sequence each step (no cache
    kept between steps): the first log-probs [V] and `steps` tokens."""
    first: torch.Tensor | None = None
    tokens: list[int] = []
    for _ in range(steps):
        seq = torch.cat([embeds, lm.speech_embedding(torch.tensor(tokens, dtype=torch.long))])
        cache = SlotKVCache(lm.body.config, 1, seq.shape[0], dtype=seq.dtype)
        view = CacheView(cache, torch.tensor([0]), torch.arange(seq.shape[0])[None], seq.shape[0], (0, 1))
        logp = lm.head_logp(lm.forward_hidden(seq[None], view)[0, -1])
        first = logp.clone() if first is None else first
        if len(tokens) < min_len:
            logp[lm.spec.min_length_mask_index] = float("-inf")
        tokens.append(int(logp.argmax()))
    assert first is not None
    return first, tokens


def test_a_continued_segment_decodes_what_one_prefill_of_its_whole_sequence_does(loaded: Any) -> None:
    lm, ref = loaded
    text, prompt_text = ref["text"][0].tolist(), ref["prompt_text"][0].tolist()
    speech = ref["prompt_speech_token"][0].tolist()
    runner = SpeechLMRunner(lm, max_batch=2, max_len=400)
    first = runner.add_request(text[:6], prompt_text, speech, is_greedy=True)
    spoken = [runner.step([first])[0] for _ in range(9)]
    assert None not in spoken
    first.is_finished = True  # as if it stopped here: the next segment follows it
    second_text = text[6:]
    second = runner.add_request(second_text, is_greedy=True, follows=first)
    assert second is first and runner.num_prompt_prefills == 1 and runner.num_continued == 1
    assert (second.tokens, second.min_len) == ([], 2 * len(second_text))
    got_first = runner.logp([second])[0]
    got = [runner.step([second])[0] for _ in range(6)]
    with torch.inference_mode():
        embeds = torch.cat([
            lm.prompt_embeds(torch.tensor([*prompt_text, *text[:6]]), torch.tensor(speech)),
            lm.speech_embedding(torch.tensor(spoken)),
            lm.turn_embeds(torch.tensor(second_text))])
        want_first, want = whole_sequence_greedy(lm, embeds, 6, second.min_len)
    assert_close_report(f"llm.v{lm.spec.version}.continued_first_logp", got_first, want_first, 1e-4)
    assert got == want


def test_a_continuation_needs_a_finished_stream_with_room_and_text(loaded: Any) -> None:
    lm, ref = loaded
    text, prompt_text = ref["text"][0].tolist(), ref["prompt_text"][0].tolist()
    runner = SpeechLMRunner(lm, max_batch=1, max_len=60)
    stream = runner.add_request(text, prompt_text, [])
    with pytest.raises(ValueError, match="finished stream"):
        runner.add_request(text, follows=stream)  # still decoding
    stream.is_finished = True
    with pytest.raises(ValueError, match="at least one text token"):
        runner.add_request([], follows=stream)
    with pytest.raises(ValueError, match="room for a turn"):
        runner.add_request(list(range(60)), follows=stream)
    runner.free(stream)
    with pytest.raises(ValueError, match="finished stream"):
        runner.add_request(text, follows=stream)  # its slot went back
    assert runner.num_free_slots == 1


def test_the_driver_parks_a_kept_stream_and_falls_back_to_a_fresh_prefill_without_room(loaded: Any) -> None:
    lm, ref = loaded
    text, prompt_text = ref["text"][0].tolist(), ref["prompt_text"][0].tolist()
    runner = SpeechLMRunner(lm, max_batch=2, max_len=120)
    driver = TorchLMDriver(runner)
    assert driver.start([LMStart("a", LMInput(text[:3], prompt_text, []), True, keep=True)]) == {}
    while "a" not in driver.parked():
        driver.step(["a"])
    assert driver.num_free == 1 and not driver.has("a")
    assert driver.start([LMStart("b", LMInput(text[:2], prompt_text, []), True, follows="a", keep=True)]) == {}
    assert runner.num_prompt_prefills == 1 and driver.parked() == [] and driver.num_free == 1
    while "b" not in driver.parked():
        driver.step(["b"])
    long_text = list(range(100, 100 + 30))  # 4 x 30 speech tokens no longer fit after it
    assert not driver.can_follow("b", LMInput(long_text, [], []))
    assert driver.start([LMStart("c", LMInput(long_text, prompt_text, []), True, follows="b")]) == {}
    assert runner.num_prompt_prefills == 2 and driver.parked() == [] and driver.num_free == 1
    driver.stop("c")
    assert driver.num_free == 2


# -- the backend: contexts through the Backend interface ---------------------------------------------

prepare = Requests("seg")


def make_backend(base: Path, load: bool = True, **options: object) -> CosyVoiceBackend:
    return make_tiny_backend(base, load=load, **{"max_batch_size": 2, **options})


@pytest.fixture(scope="module")
def continuing(tmp_path_factory: pytest.TempPathFactory) -> CosyVoiceBackend:
    return make_backend(tmp_path_factory.getbasetemp(), lm_context="continue")


@pytest.fixture(scope="module")
def per_segment(tmp_path_factory: pytest.TempPathFactory) -> CosyVoiceBackend:
    return make_backend(tmp_path_factory.getbasetemp())


def runner_of(backend: CosyVoiceBackend) -> SpeechLMRunner:
    assert isinstance(backend.lm, TorchLMDriver)
    return backend.lm.runner


def test_a_context_of_two_segments_runs_one_prompt_prefill(continuing: CosyVoiceBackend,
                                                            per_segment: CosyVoiceBackend) -> None:
    counts = []
    for backend in (continuing, per_segment):
        runner = runner_of(backend)
        before = (runner.num_prompt_prefills, runner.num_continued)
        first, second = prepare(backend, "Hello world.", "turn"), prepare(backend, "How are you?", "turn", 1.0)
        spoken = run(backend, [first, second])
        assert all(len(tokens) > 0 for tokens, _ in spoken.values())
        counts.append((runner.num_prompt_prefills - before[0], runner.num_continued - before[1]))
        backend.end_context("turn")
    assert counts == [(1, 1), (2, 0)]  # continuing, then each segment on its own


def test_a_contexts_first_segment_speaks_as_a_lone_request_does(continuing: CosyVoiceBackend,
                                                                per_segment: CosyVoiceBackend) -> None:
    alone = run(per_segment, [lone := prepare(per_segment, "Hello world.")])[lone.request_id]
    first = prepare(continuing, "Hello world.", "first")
    in_context = run(continuing, [first, prepare(continuing, "Bye now.", "first", 1.0)])[first.request_id]
    continuing.end_context("first")
    assert in_context[0] == alone[0]
    np.testing.assert_allclose(in_context[1], alone[1], atol=1e-5)


def test_the_next_segment_waits_for_the_one_before_to_stop_decoding(continuing: CosyVoiceBackend) -> None:
    first, second = prepare(continuing, "Hello world.", "order"), prepare(continuing, "Yes.", "order", 1.0)
    first_state, second_state = first.state, second.state
    assert isinstance(first_state, CosyState) and isinstance(second_state, CosyState)
    continued = runner_of(continuing).num_continued
    while not first_state.is_lm_done:
        first_result, second_result = continuing.step([first, second])
        assert not second_result.is_finished
        assert not second_state.has_slot or first_state.is_lm_done
    assert runner_of(continuing).num_continued == continued  # it starts at the next step
    live = [second] if first_result.is_finished else [first, second]
    if first_result.is_finished:
        continuing.release(first)
    run(continuing, live)
    assert runner_of(continuing).num_continued == continued + 1
    continuing.end_context("order")


def test_cancel_or_the_end_of_a_context_frees_its_lm_slot(continuing: CosyVoiceBackend) -> None:
    runner, lm = runner_of(continuing), continuing.lm
    assert lm is not None
    full = runner.num_free_slots
    running = prepare(continuing, "Hello world, how are you?", "cancelled")
    for _ in range(3):
        continuing.step([running])
    assert runner.num_free_slots == full - 1
    continuing.release(running)  # cancelled mid-way: nothing of its context is kept
    assert runner.num_free_slots == full and lm.parked() == []
    run(continuing, [prepare(continuing, "Hi.", "ended")])
    assert runner.num_free_slots == full - 1 and len(lm.parked()) == 1  # parked for the next segment
    continuing.end_context("ended")
    assert runner.num_free_slots == full and lm.parked() == []


def test_parked_sequences_give_their_slots_to_new_streams_first(tmp_path_factory: pytest.TempPathFactory) -> None:
    backend = make_backend(tmp_path_factory.getbasetemp(), lm_context="continue", max_streams=2)
    lm = backend.lm
    assert lm is not None
    run(backend, [prepare(backend, "Hi.", "one"), prepare(backend, "Hello.", "two")])
    assert len(lm.parked()) == 2 and lm.num_free == 0
    newcomer = prepare(backend, "New.", "three")
    run(backend, [newcomer])
    assert len(lm.parked()) == 2  # "one" made room ("three" parks in its place)
    later = prepare(backend, "Again.", "one")
    run(backend, [later])
    assert runner_of(backend).num_continued == 0  # "one" lost its sequence: it started afresh
    for name in ("one", "two", "three"):
        backend.end_context(name)
    assert lm.num_free == 2


def test_the_engine_tells_the_backend_when_a_context_ends(tmp_path_factory: pytest.TempPathFactory) -> None:
    backend = make_backend(tmp_path_factory.getbasetemp(), load=False, lm_context="continue")

    async def scenario() -> None:
        engine = Engine(backend, EngineConfig(warmup_text=""))
        await engine.start()  # loads the backend
        lm = backend.lm
        assert lm is not None
        try:
            engine.admit("talk")
            for i, text in enumerate(("Hello world.", "Bye.")):
                request = SynthesisRequest(RequestId(f"talk-{i}"), text, "default", 0.0, context_key="talk")
                async for _ in engine.submit(request):
                    pass
            assert len(lm.parked()) == 1 and runner_of(backend).num_continued == 1
            engine.release_context("talk")
            await asyncio.to_thread(wait_until, lambda: not lm.parked(), timeout=10.0, interval=0.01)
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_context_capacity_is_what_both_the_lm_slots_and_the_flow_cache_hold(
        tmp_path_factory: pytest.TempPathFactory, continuing: CosyVoiceBackend) -> None:
    base = tmp_path_factory.getbasetemp()
    assert make_backend(base, load=False).context_capacity() == 0  # nothing is known before load
    flow = int(continuing.flow_cache_info().get("stream_capacity", 0))
    slots = continuing.config.num_streams
    assert continuing.context_capacity() == (min(slots, flow) if flow else slots) > 0
    few_slots = make_backend(base, max_streams=2)
    assert few_slots.context_capacity() == 2
