"""Assertion helpers for the CosyVoice parity tests (LM, flow, vocoder).

A parity failure must say where the port departs from upstream: which module,
which tensor, and by how much, so that a broken layer is found from the test
log alone.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.model_dir import ModelDir, load_model_dir

#: What upstream itself meets against the fixture files (fixture README).
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread is many times faster than several on a shared CPU.

    Autouse in every module that imports it (the CosyVoice test modules do).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest elementwise |got - want| in float64 (inf where only one is inf/nan)."""
    diff = (got.detach().double().cpu() - want.detach().double().cpu()).abs()
    diff = torch.nan_to_num(diff, nan=float("inf"))
    return float(diff.max()) if diff.numel() else 0.0


def assert_close_report(name: str, got: Any, want: Any, atol: float) -> None:
    """Assert |got - want| <= atol everywhere, or fail naming the tensor and the gap.

    `name` should read "module.tensor" (e.g. "llm.first_logp", "flow.mel") so the
    message alone locates the mismatch. Shapes must match exactly.
    """
    got_t = torch.as_tensor(got)
    want_t = torch.as_tensor(want)
    if tuple(got_t.shape) != tuple(want_t.shape):
        raise AssertionError(
            f"{name}: expected shape {tuple(want_t.shape)}, got {tuple(got_t.shape)}"
        )
    if got_t.numel() == 0:
        return
    diff = (got_t.detach().double().cpu() - want_t.detach().double().cpu()).abs()
    # Two infinities of the same sign are equal (e.g. masked log-probs).
    same_inf = torch.isinf(got_t.double().cpu()) & (got_t.double().cpu() == want_t.double().cpu())
    diff = torch.where(same_inf, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=float("inf"))
    worst = float(diff.max())
    if worst > atol:
        flat = int(diff.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
        num_bad = int((diff > atol).sum())
        raise AssertionError(
            f"{name}: max |got - want| = {worst:.3e} > atol {atol:.1e} "
            f"at index {index} (got {float(got_t.reshape(-1)[flat]):.6g}, "
            f"want {float(want_t.reshape(-1)[flat]):.6g}); "
            f"{num_bad} of {diff.numel()} elements out of tolerance, shape {tuple(diff.shape)}"
        )


def assert_equal_report(name: str, got: Any, want: Any) -> None:
    """Assert two integer sequences (e.g. token ids) are identical, naming the first divergence."""
    got_l = torch.as_tensor(got).reshape(-1).tolist()
    want_l = torch.as_tensor(want).reshape(-1).tolist()
    if got_l == want_l:
        return
    first = next(
        (i for i, (g, w) in enumerate(zip(got_l, want_l, strict=False)) if g != w),
        min(len(got_l), len(want_l)),
    )
    raise AssertionError(
        f"{name}: expected {len(want_l)} values, got {len(got_l)}; first difference at "
        f"position {first}: got {got_l[first : first + 5]}, want {want_l[first : first + 5]}"
    )


#: The upstream-made tiny fixtures (docs/cosyvoice-design.md, "Parity with upstream"): kept
#: beside the repository, never copied in. Tests and benches read them from here only.
FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "cosyvoice-upstream-tiny"


def fixture_dir(version: int) -> Path:
    """The upstream-made tiny model directory of a version, under `FIXTURES`."""
    return FIXTURES / f"cosyvoice{version}"


def load_fixture(version: int) -> tuple[ModelDir, dict[str, Any]]:
    """The fixture model directory of a version, loaded, and what upstream computed from it
    (reference.pt: the inputs and every stage's outputs)."""
    model_dir = load_model_dir(fixture_dir(version))
    return model_dir, torch.load(model_dir.path / "reference.pt", weights_only=True)


def copy_model_dir(version: int, dest: Path) -> Path:
    """A writable copy of the fixture directory; weight files are symlinked, not copied."""
    src = fixture_dir(version)
    dest.mkdir(parents=True)
    for item in src.iterdir():
        if item.is_dir():
            shutil.copytree(item, dest / item.name)
        elif item.suffix == ".pt":
            (dest / item.name).symlink_to(item)
        else:
            shutil.copy(item, dest / item.name)
    return dest
