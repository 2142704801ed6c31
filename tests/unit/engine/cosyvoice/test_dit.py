"""The CosyVoice 3 DiT's pass: fewer launches, the same numbers.

Upstream parity of the whole flow is tests/unit/engine/cosyvoice/test_flow.py (v3 runs
this DiT on upstream's fixture); these tests pin what the leaner pass changed:
the rotary identity it uses, the in-place write beside the export's cat, and
how many operators one pass dispatches (each is at least one kernel launch
on a GPU, where an eager pass at serving sizes is bound by its launches).
"""

from __future__ import annotations

import pytest
import torch

from bench.gpu_flow_estimator import random_dit
from bench.gpu_flow_profile import ops_per_pass
from engine.backends.cosyvoice.flow_runtime.estimator_onnx import example_inputs
from engine.backends.cosyvoice.models.flow_dit import RotaryEmbedding, apply_rotary

SIZE = {"dim": 64, "depth": 3, "heads": 4, "dim_head": 16}


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): the rotation as upstream writes it."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def test_the_swapped_signed_sine_is_rotate_pairs_times_sine() -> None:
    rotary = RotaryEmbedding(16)
    rope, sin = rotary.tables(37), rotary(37).sin()
    head = torch.randn(2, 37, 16)
    assert torch.equal(head.index_select(-1, rope.swap) * rope.signed_sin, rotate_pairs(head) * sin)
    assert rope.cos.dtype == rope.signed_sin.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_equals_the_cat_an_export_traces(monkeypatch: pytest.MonkeyPatch,
                                                         dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(16).tables(20)
    x = torch.randn(3, 20, 64).to(dtype)
    rest = x[..., 16:].clone()
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    exported = apply_rotary(x.clone(), rope)
    monkeypatch.undo()
    in_place = apply_rotary(x, rope)
    assert in_place.data_ptr() == x.data_ptr()  # written into the projection, no copy of it
    assert torch.equal(in_place, exported)
    assert torch.equal(in_place[..., 16:], rest)  # past the rotary channels nothing moves


def test_rotary_rotates_the_head_as_upstream_does() -> None:
    rope = RotaryEmbedding(16).tables(20)
    freqs = RotaryEmbedding(16)(20)
    x = torch.randn(3, 20, 64)
    head = x[..., :16].clone()
    want = head * freqs.cos() + rotate_pairs(head) * freqs.sin()
    got = apply_rotary(x.clone(), rope)[..., :16]
    assert (got - want).abs().max() < 1e-6


def test_one_pass_dispatches_at_most_26_operators_a_block() -> None:
    # the pass before this change dispatched 40 a block (916 at 22 blocks, 615 now): a cat and a
    # stack per rotary, mul + add per modulation and gate, silu and the mask's inverse per block
    def ops(depth: int) -> int:
        dit = random_dit({**SIZE, "depth": depth}, torch.device("cpu"), torch.float32)
        inputs = example_inputs(4, 70, num_padded=1)
        with torch.inference_mode():
            return int(ops_per_pass(lambda: dit(*inputs, True))["total"])

    counts = {depth: ops(depth) for depth in (2, 4)}
    per_block = (counts[4] - counts[2]) / 2
    assert per_block <= 26, counts
