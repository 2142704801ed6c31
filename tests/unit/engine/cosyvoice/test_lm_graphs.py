"""The speech LM's static-shape decode (the CUDA-graph path, run eagerly) and resumption after
preemption."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.buckets import bucket_of
from engine.backends.cosyvoice.lm.graphs import StaticDecoder
from engine.backends.cosyvoice.lm.runner import (
    LMStream,
    NoFreeSlotError,
    PrefillRequest,
    SpeechLMRunner,
)
from engine.backends.cosyvoice.models.speech_lm import SpeechLM
from engine.backends.cosyvoice.models.speech_lm_load import load_speech_lm
from tests.support.cosyvoice_parity import (
    assert_close_report,
    load_fixture,
    one_torch_thread,  # noqa: F401 (autouse)
)


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def loaded(request: pytest.FixtureRequest) -> tuple[SpeechLM, dict[str, Any]]:
    model_dir, reference = load_fixture(request.param)
    return load_speech_lm(model_dir), reference


def prompts(ref: dict[str, Any]) -> list[tuple[list[int], list[int], list[int]]]:
    text, prompt_text = ref["text"][0].tolist(), ref["prompt_text"][0].tolist()
    speech = ref["prompt_speech_token"][0].tolist()
    return [(text, prompt_text, speech), (text[:5], prompt_text, speech[:7]),
            (text[3:], prompt_text, speech[4:]), (text[:8], prompt_text, speech[:12])]


def decode(runner: SpeechLMRunner, ref: dict[str, Any],
           steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Four greedy streams, the second freed at once (a hole in the slots); tokens and last
    log-probs."""
    streams = [runner.add_request(t, p, s, is_greedy=True) for t, p, s in prompts(ref)]
    runner.free(streams[1])
    live = [streams[0], streams[2], streams[3]]
    tokens: list[list[int]] = [[] for _ in live]
    for _ in range(steps):
        for i, token in enumerate(runner.step(live)):
            tokens[i].append(-1 if token is None else token)
    return tokens, runner.logp(live)


def test_static_decode_computes_what_the_dynamic_decode_does(loaded: Any) -> None:
    lm, ref = loaded
    want_tokens, want_logp = decode(SpeechLMRunner(lm, max_batch=5, max_len=320), ref, 24)
    static = SpeechLMRunner(lm, max_batch=5, max_len=320, decode_mode="static", kv_bucket=32)
    got_tokens, got_logp = decode(static, ref, 24)
    assert got_tokens == want_tokens
    assert_close_report("llm.static_logp", got_logp, want_logp, 1e-4)
    assert static.static is not None
    assert static.static.batch_buckets == [1, 2, 4, 5] and static.static.kv_buckets[-1] == 320


def test_a_stream_resumed_with_its_tokens_continues_exactly(loaded: Any) -> None:
    lm, ref = loaded
    text, prompt_text, speech = prompts(ref)[0]
    runner = SpeechLMRunner(lm, max_batch=2, max_len=320)
    whole = runner.add_request(text, prompt_text, speech, is_greedy=True)
    want = [runner.step([whole])[0] for _ in range(20)]
    runner.free(whole)
    first: LMStream = runner.add_request(text, prompt_text, speech, is_greedy=True)
    head = [runner.step([first])[0] for _ in range(8)]
    runner.free(first)  # preempted
    resumed = runner.add_request(text, prompt_text, speech, is_greedy=True,
                                 resume_tokens=first.tokens)
    assert resumed.tokens == first.tokens and resumed.num_cached == first.num_cached
    tail = [runner.step([resumed])[0] for _ in range(12)]
    assert head + tail == want


def test_buckets_and_graph_mode_refuse_what_they_cannot_serve(loaded: Any) -> None:
    lm, _ = loaded
    assert bucket_of(3, [1, 2, 4, 8]) == 4
    with pytest.raises(ValueError, match="at most 8"):
        bucket_of(9, [1, 2, 4, 8])
    with pytest.raises(ValueError, match="CUDA device"):
        SpeechLMRunner(lm, max_batch=2, max_len=64, decode_mode="cuda_graphs")
    with pytest.raises(ValueError, match="decode_mode"):
        SpeechLMRunner(lm, max_batch=2, max_len=64, decode_mode="fast")
    assert isinstance(SpeechLMRunner(lm, 2, 64, decode_mode="static").static, StaticDecoder)


def test_prompts_prefilled_together_give_each_stream_its_single_prefill(loaded: Any) -> None:
    lm, ref = loaded
    requests = [PrefillRequest(t, p, s, is_greedy=True) for t, p, s in prompts(ref)]
    alone = SpeechLMRunner(lm, max_batch=1, max_len=320)
    want = []
    for r in requests:
        (stream,) = alone.add_requests([r])
        assert isinstance(stream, LMStream)
        want.append(alone.logp([stream])[0])
        alone.free(stream)
    together = SpeechLMRunner(lm, max_batch=4, max_len=320)
    streams = together.add_requests(requests)
    assert [s.num_cached for s in streams if isinstance(s, LMStream)] == [
        len(r.prompt_text_ids) + len(r.text_ids) + len(r.prompt_speech_tokens) + 2
        for r in requests]
    got = together.logp([s for s in streams if isinstance(s, LMStream)])
    assert_close_report("llm.batched_prefill_logp", got, torch.stack(want), 1e-4)
    # with one slot free: an empty prompt is refused, one fits, the next finds no slot;
    # each failure is reported in its place, not raised
    first = streams[0]
    assert isinstance(first, LMStream)
    together.free(first)
    extra = together.add_requests([PrefillRequest([]), requests[0], requests[1]])
    assert isinstance(extra[0], ValueError) and isinstance(extra[1], LMStream)
    assert isinstance(extra[2], NoFreeSlotError)


def test_strict_min_length_forbids_every_stop_id_before_the_minimum(loaded: Any) -> None:
    lm, ref = loaded
    runner = SpeechLMRunner(lm, max_batch=4, max_len=320, seed=0)
    runner.strict_min_length = True
    streams = [runner.add_request(t, p, s) for t, p, s in prompts(ref)]
    # push every stop id far above the speech tokens: only the mask can hold them back
    runner._logp[:, lm.spec.speech_token_size:] = 0.0
    runner._logp[:, : lm.spec.speech_token_size] = -50.0
    minimum = min(s.min_len for s in streams)
    for _ in range(minimum):
        assert None not in runner.step(streams)
        runner._logp[:, lm.spec.speech_token_size:] = 0.0
        runner._logp[:, : lm.spec.speech_token_size] = -50.0
