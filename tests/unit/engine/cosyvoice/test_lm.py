"""The CosyVoice speech LM against upstream's outputs, and its batched slot decoding."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.frontend.tokens import END_OF_PROMPT, added_token_id
from engine.backends.cosyvoice.lm.runner import LMStream, NoFreeSlotError, SpeechLMRunner
from engine.backends.cosyvoice.lm.sampling import (
    RasConfig,
    _categorical,
    draw_uniforms,
    mask_min_length,
    nucleus,
    nucleus_candidates,
    ras,
)
from engine.backends.cosyvoice.models.speech_lm import END_OF_PROMPT_ID, SpeechLM
from engine.backends.cosyvoice.models.speech_lm_load import load_speech_lm
from tests.support.cosyvoice_parity import (
    ATOL,
    assert_close_report,
    assert_equal_report,
    load_fixture,
    one_torch_thread,  # noqa: F401 (autouse)
)


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def loaded(request: pytest.FixtureRequest) -> tuple[SpeechLM, dict[str, Any], RasConfig]:
    model_dir, reference = load_fixture(request.param)
    ras_config = RasConfig.from_hparams(model_dir.hparams["llm"]["sampling"])
    return load_speech_lm(model_dir), reference, ras_config


def add_reference(runner: SpeechLMRunner, ref: dict[str, Any], is_greedy: bool = False) -> LMStream:
    return runner.add_request(
        ref["text"][0].tolist(),
        ref["prompt_text"][0].tolist(),
        ref["prompt_speech_token"][0].tolist(),
        is_greedy=is_greedy,
    )


def test_first_step_log_probs_match_upstream(loaded: Any) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(lm, max_batch=1, max_len=64)
    stream = add_reference(runner, ref)
    assert stream.prompt_len == 1 + 6 + 12 + 1 + 20
    assert_close_report(
        f"llm.v{lm.spec.version}.first_logp", runner.logp([stream]), ref["lm_first_logp"], ATOL
    )


def test_teacher_forced_log_probs_through_the_kv_cache_match_upstream(loaded: Any) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(lm, max_batch=1, max_len=64)
    stream = add_reference(runner, ref)
    rows = [runner.logp([stream])]
    for token in ref["lm_forced_tokens"].tolist():
        rows.append(runner.feed([stream], [token]))
    assert_close_report(
        f"llm.v{lm.spec.version}.forced_logp", torch.cat(rows), ref["lm_forced_logp"], ATOL
    )


def test_greedy_decoding_reproduces_upstream_tokens_and_stops_at_max_length(loaded: Any) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(lm, max_batch=2, max_len=320)
    stream = add_reference(runner, ref, is_greedy=True)
    assert (stream.min_len, stream.max_len) == (24, 240)  # 2x and 20x the 12 text tokens
    emitted = []
    while not stream.is_finished:
        token = runner.step([stream])[0]
        assert token is not None
        emitted.append(token)
    assert_equal_report(f"llm.v{lm.spec.version}.greedy_tokens", emitted, ref["lm_greedy_tokens"])
    assert stream.tokens == emitted


def _other_prompt(
    ref: dict[str, Any], shift: int, text_len: int
) -> tuple[list[int], list[int], list[int]]:
    text = [(t + shift) % 5000 for t in ref["text"][0].tolist()][:text_len]
    speech = [(t * 7 + shift) % 6561 for t in ref["prompt_speech_token"][0].tolist()][: 5 + shift]
    return text, ref["prompt_text"][0].tolist(), speech


@pytest.mark.parametrize("free_middle", [False, True], ids=["contiguous-slots", "scattered-slots"])
def test_a_stream_decodes_the_same_in_a_batch_of_different_prompts(
    loaded: Any, free_middle: bool
) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(lm, max_batch=4, max_len=96)
    before = runner.add_request(*_other_prompt(ref, 3, 9))
    if free_middle:  # leaves slot 1 empty: the batch reads slots 0, 2, 3 by gather
        runner.free(runner.add_request(*_other_prompt(ref, 1, 4)))
        runner.add_request(*_other_prompt(ref, 2, 5))
    target = add_reference(runner, ref)
    after = runner.add_request(*_other_prompt(ref, 5, 11))
    batch = [before, target, after]
    assert [s.slot for s in batch] == ([0, 1, 2] if not free_middle else [0, 2, 3])
    rows = [runner.logp(batch)[1:2]]
    for i, token in enumerate(ref["lm_forced_tokens"].tolist()):
        logp = runner.feed(batch, [(token + 11) % 6561, token, (token * 3 + i) % 6561])
        rows.append(logp[1:2])
    assert_close_report(
        f"llm.v{lm.spec.version}.batched_forced_logp", torch.cat(rows), ref["lm_forced_logp"], ATOL
    )


def test_batched_greedy_streams_each_match_their_single_stream_run(loaded: Any) -> None:
    lm, ref, _ = loaded
    prompts = [_other_prompt(ref, 2, 3), _other_prompt(ref, 4, 2)]
    singles = []
    for prompt in prompts:
        runner = SpeechLMRunner(lm, max_batch=1, max_len=128)
        stream = runner.add_request(*prompt, is_greedy=True)
        while not stream.is_finished:
            runner.step([stream])
        singles.append(stream.tokens)
    runner = SpeechLMRunner(lm, max_batch=3, max_len=128)
    streams = [runner.add_request(*prompt, is_greedy=True) for prompt in prompts]
    while not all(s.is_finished for s in streams):
        runner.step([s for s in streams if not s.is_finished])
    assert [s.tokens for s in streams] == singles
    assert all(0 < len(s.tokens) <= s.max_len for s in streams)


def test_sampled_decoding_is_reproducible_with_a_seed_and_emits_only_speech_tokens(
    loaded: Any,
) -> None:
    lm, ref, ras_config = loaded
    runs, outputs = [], []
    for _ in range(2):
        runner = SpeechLMRunner(lm, max_batch=2, max_len=320, ras=ras_config, seed=7)
        stream = add_reference(runner, ref)
        while not stream.is_finished:
            outputs.extend(runner.step([stream]))
        runs.append(stream.tokens)
    assert runs[0] == runs[1]
    assert all(0 <= t < 6561 for t in runs[0])
    # It ends at 240 tokens or on a stop id (random weights: v3 has 200 of them).
    assert len(runs[0]) == 240 or outputs[len(runs[0])] is None


def _decode(runner: SpeechLMRunner, streams: list[LMStream]) -> list[list[int]]:
    while not all(s.is_finished for s in streams):
        runner.step([s for s in streams if not s.is_finished])
    return [s.tokens for s in streams]


def test_a_seeded_sampled_stream_is_the_same_alone_or_in_any_batch(loaded: Any) -> None:
    lm, ref, ras_config = loaded
    prompts = [_other_prompt(ref, 2, 3), _other_prompt(ref, 4, 2), _other_prompt(ref, 1, 4)]
    singles = []
    for seed, prompt in enumerate(prompts):
        runner = SpeechLMRunner(lm, max_batch=1, max_len=128, ras=ras_config)
        singles.extend(_decode(runner, [runner.add_request(*prompt, seed=100 + seed)]))
    runner = SpeechLMRunner(lm, max_batch=4, max_len=128, ras=ras_config)
    runner.free(runner.add_request(*prompts[0]))  # the batch's slots differ from the single runs'
    streams = [runner.add_request(*p, seed=100 + i) for i, p in reversed(list(enumerate(prompts)))]
    assert _decode(runner, streams)[::-1] == singles
    assert len(set(map(tuple, singles))) == 3


def test_another_seed_samples_other_tokens_and_a_resumed_stream_goes_on_the_same(
    loaded: Any,
) -> None:
    lm, ref, ras_config = loaded
    prompt = _other_prompt(ref, 2, 6)
    runner = SpeechLMRunner(lm, max_batch=2, max_len=160, ras=ras_config)
    whole, other = _decode(runner, [runner.add_request(*prompt, seed=s) for s in (5, 6)])
    assert whole != other
    runner = SpeechLMRunner(lm, max_batch=1, max_len=160, ras=ras_config)
    first = runner.add_request(*prompt, seed=5)
    for _ in range(len(whole) // 2):
        runner.step([first])
    runner.free(first)  # preempted: its tokens are prefilled again on resumption
    resumed = runner.add_request(*prompt, resume_tokens=first.tokens, seed=5)
    assert _decode(runner, [resumed]) == [whole]


def test_uniforms_are_a_pure_function_of_seed_and_counter_and_look_uniform() -> None:
    u = draw_uniforms([9] * 50000, range(50000))  # [N, 2]
    assert torch.equal(u, draw_uniforms([9] * 50000, range(50000)))
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.allclose(u.mean(0), torch.full((2,), 0.5), atol=0.01)
    counts = torch.histc(u[:, 0], bins=10, min=0, max=1)
    assert bool((counts - 5000).abs().max() < 300)  # about 4 sigma
    assert abs(float(torch.corrcoef(u.T)[0, 1])) < 0.02  # the two draws are independent
    by_seed = draw_uniforms(range(1000), [0] * 1000)[:, 0]
    assert len(set(by_seed.tolist())) > 990  # neighbouring seeds do not repeat each other
    assert torch.equal(draw_uniforms([-1], [3]), draw_uniforms([2**64 - 1], [3]))  # mod 2**64


def _with_decoder_bias(lm: SpeechLM, index: int) -> SpeechLM:
    """A copy whose head strongly prefers one id (v3 has no bias: shift the weight row instead)."""
    biased = copy.deepcopy(lm)
    hidden = biased.speech_embedding.weight.shape[1]
    biased.llm_decoder = torch.nn.Linear(hidden, biased.spec.num_rows, bias=True)
    with torch.no_grad():
        biased.llm_decoder.weight.copy_(lm.llm_decoder.weight)
        biased.llm_decoder.bias.zero_()
        if lm.llm_decoder.bias is not None:
            biased.llm_decoder.bias.copy_(lm.llm_decoder.bias)
        biased.llm_decoder.bias[index] += 1000.0
    return biased


def test_index_6561_is_forbidden_until_the_minimum_length_then_stops(loaded: Any) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(_with_decoder_bias(lm, 6561), max_batch=1, max_len=320)
    stream = add_reference(runner, ref, is_greedy=True)
    outputs = []
    while not stream.is_finished:
        outputs.extend(runner.step([stream]))
    assert outputs[-1] is None
    assert len(stream.tokens) == stream.min_len == 24


def test_other_stop_ids_end_decoding_even_before_the_minimum_length(loaded: Any) -> None:
    lm, ref, _ = loaded
    stop = 6562 if lm.spec.version == 2 else 6700  # v2: a stop id; v3: any id from 6561 up
    runner = SpeechLMRunner(_with_decoder_bias(lm, stop), max_batch=1, max_len=320)
    stream = add_reference(runner, ref, is_greedy=True)
    assert runner.step([stream]) == [None]
    assert stream.is_finished and stream.tokens == []


def test_slots_are_handed_out_lowest_first_and_refused_when_full(loaded: Any) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(lm, max_batch=2, max_len=64)
    first, second = add_reference(runner, ref), add_reference(runner, ref)
    assert (first.slot, second.slot, runner.num_free_slots) == (0, 1, 0)
    with pytest.raises(NoFreeSlotError):
        add_reference(runner, ref)
    runner.free(first)
    assert add_reference(runner, ref).slot == 0
    with pytest.raises(ValueError, match="already free"):
        runner.free(first)  # slot 0 now belongs to the new stream
    runner.free(second)
    with pytest.raises(ValueError, match="already free"):
        runner.free(second)


def test_prompt_longer_than_the_cache_is_refused_and_keeps_its_slot_free(loaded: Any) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(lm, max_batch=1, max_len=16)
    with pytest.raises(ValueError, match="prompt shorter than 16"):
        add_reference(runner, ref)
    assert runner.num_free_slots == 1


def test_max_length_is_cut_to_what_the_slot_can_hold(loaded: Any) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(lm, max_batch=1, max_len=100)
    assert add_reference(runner, ref).max_len == 100 - 40


def test_cosyvoice3_refuses_text_without_end_of_prompt(loaded: Any) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(lm, max_batch=1, max_len=64)
    text = ref["text"][0].tolist()
    if lm.spec.version == 3:
        with pytest.raises(ValueError, match="endofprompt"):
            runner.add_request(text, [5, 6, 7])
    else:
        assert runner.add_request(text, [5, 6, 7]).prompt_len == 1 + 15 + 1


def _upstream_nucleus_set(probs: list[float], top_p: float, top_k: int) -> set[int]:
    """Upstream's loop, written out: walk by descending probability (stable)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept: list[int] = []
    mass = 0.0
    for i in order:
        if mass < top_p and len(kept) < top_k:
            mass += probs[i]
            kept.append(i)
        else:
            break
    return set(kept)


@pytest.mark.parametrize("seed", range(5))
def test_nucleus_candidates_follow_upstreams_top_p_within_top_k_rule(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logp = (torch.randn(4, 300, generator=gen) * (1 + seed)).log_softmax(-1)
    config = RasConfig(top_p=0.8, top_k=25)
    weights, ids = nucleus_candidates(logp, config)
    for row in range(4):
        got = {int(i) for w, i in zip(weights[row], ids[row], strict=True) if w > 0}
        assert got == _upstream_nucleus_set(logp[row].exp().tolist(), 0.8, 25)


def test_ras_resamples_a_token_repeated_in_the_window() -> None:
    logp = torch.full((2, 8), -30.0)
    logp[:, 3] = 0.0  # nucleus always picks 3
    logp[:, 5] = -3.0  # outside the nucleus (p(3) > 0.8), the fallback's favourite
    history = torch.tensor([[-1] * 9 + [3], [-1] * 10])
    tokens = ras(logp.log_softmax(-1), history, RasConfig(), draw_uniforms([0, 0], [0, 1]))
    assert tokens.tolist() == [5, 3]


def test_min_length_mask_touches_only_rows_below_their_minimum() -> None:
    logp = torch.zeros(2, 6564)
    masked = mask_min_length(logp, torch.tensor([True, False]), 6561)
    assert masked[0, 6561] == float("-inf") and masked[1, 6561] == 0
    assert torch.isfinite(masked[0, :6561]).all() and masked[0, 6562] == 0


def test_ras_config_reads_the_yaml_sampling_node() -> None:
    node = {
        "_kind": "name",
        "_target": "cosyvoice.utils.common.ras_sampling",
        "top_p": 0.7,
        "top_k": 10,
        "win_size": 5,
        "tau_r": 0.2,
    }
    assert RasConfig.from_hparams(node) == RasConfig(0.7, 10, 5, 0.2)
    with pytest.raises(ValueError, match="ras_sampling"):
        RasConfig.from_hparams({"_target": "x.top_k_sampling"})


def test_draws_follow_the_weights_and_never_pick_a_zero_weight() -> None:
    weights = torch.tensor([[0.0, 1.0, 3.0, 0.0]]).repeat(20000, 1)
    draws = _categorical(weights, draw_uniforms([0] * 20000, range(20000))[:, 0])
    counts = torch.bincount(draws, minlength=4).tolist()
    assert counts[0] == counts[3] == 0
    assert abs(counts[2] / 20000 - 0.75) < 0.02


def test_nucleus_draws_only_from_its_candidates() -> None:
    logp = torch.randn(64, 6761, generator=torch.Generator().manual_seed(1)).mul(4).log_softmax(-1)
    config = RasConfig()
    weights, ids = nucleus_candidates(logp, config)
    draws = nucleus(logp, config, draw_uniforms([2] * 64, range(64))[:, 0])
    for row in range(64):
        assert int(draws[row]) in {
            int(i) for w, i in zip(weights[row], ids[row], strict=True) if w > 0
        }


def test_feeding_past_the_cache_is_refused_without_changing_the_stream(loaded: Any) -> None:
    lm, ref, _ = loaded
    runner = SpeechLMRunner(lm, max_batch=1, max_len=41)
    stream = add_reference(runner, ref)  # 40 positions
    runner.feed([stream], [5])
    with pytest.raises(ValueError, match="at most 41 cached positions"):
        runner.feed([stream], [6])
    assert (stream.tokens, stream.num_cached) == ([5], 41)
    with pytest.raises(ValueError, match="distinct streams"):
        runner.feed([stream, stream], [1, 2])


def test_the_models_end_of_prompt_id_is_the_frontends_token_in_both_versions() -> None:
    # models/ never imports the frontend, so the id is written out there; this keeps them one
    assert END_OF_PROMPT_ID == added_token_id(END_OF_PROMPT, 2) == added_token_id(END_OF_PROMPT, 3)
