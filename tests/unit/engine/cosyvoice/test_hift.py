"""The HiFT vocoder against upstream's outputs, and the properties streaming relies on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.hift import HiFT, HiFTConfig, build_hift, load_hift_state
from engine.errors import ModelLoadError
from tests.support.cosyvoice_parity import (
    ATOL,
    assert_close_report,
    copy_model_dir,
    fixture_dir,
    load_fixture,
    one_torch_thread,  # noqa: F401 (autouse)
)


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def loaded(request: pytest.FixtureRequest) -> tuple[HiFT, dict[str, Any]]:
    model_dir, reference = load_fixture(request.param)
    return build_hift(model_dir), reference


def name(hift: HiFT, tensor: str) -> str:
    return f"hift_v{3 if hift.cfg.causal else 2}.{tensor}"


def test_f0_matches_upstream(loaded: Any) -> None:
    hift, ref = loaded
    with torch.inference_mode():
        f0 = hift.predict_f0(ref["flow_mel"])
    assert_close_report(name(hift, "f0"), f0, ref["hift_f0"], ATOL)


def test_wave_decoded_from_the_recorded_source_matches_upstream(loaded: Any) -> None:
    hift, ref = loaded
    with torch.inference_mode():
        wav = hift.decode(ref["flow_mel"], ref["hift_source"])
    assert_close_report(name(hift, "wav"), wav, ref["hift_wav"], ATOL)


def test_source_has_one_sample_per_wave_sample_and_stays_in_tanh_range(loaded: Any) -> None:
    hift, ref = loaded
    with torch.inference_mode():
        source, cycles = hift.source(ref["hift_f0"], generator=torch.Generator().manual_seed(0))
    assert source.shape == ref["hift_source"].shape
    assert cycles.shape == (1, ref["hift_f0"].shape[1], hift.cfg.nb_harmonics + 1)
    assert float(source.abs().max()) < 1.0


def test_source_phase_continues_across_a_split(loaded: Any) -> None:
    """Two halves, the second started from the first's phase, give the whole's source (v3: noise
    too)."""
    hift, ref = loaded
    f0 = ref["hift_f0"] + 100.0  # voiced everywhere, so the harmonics dominate
    hift.cfg.noise_scale = 0.0
    try:
        with torch.inference_mode():
            whole, cycles = hift.source(f0)
            first, c1 = hift.source(f0[:, :30])
            second, _ = hift.source(f0[:, 30:], phase0=c1[:, -1],
                                    start=30 * hift.cfg.samples_per_frame)
    finally:
        hift.cfg.noise_scale = 1.0
    assert_close_report(name(hift, "source_cycles"), c1, cycles[:, :30], 1e-9)
    if hift.cfg.causal:  # one phase per frame: the halves are exact
        assert_close_report(name(hift, "split_source"), torch.cat([first, second], 2), whole, 1e-5)
    else:  # linear phase interpolation clamps at each edge: only half a frame differs
        spf = hift.cfg.samples_per_frame
        assert_close_report(name(hift, "split_source"), second[:, :, spf:], whole[:, :, 31 * spf:],
                            1e-5)


def test_decode_of_a_prefix_agrees_with_the_whole_decode_where_streaming_needs_it(
        loaded: Any) -> None:
    """v3: a non-final call emits (T - 8) frames of audio that later mel cannot change.
    v2: not causal, so the last frames of a prefix differ (t2w holds 8 back and cross-fades)."""
    hift, ref = loaded
    mel, source, spf = ref["flow_mel"], ref["hift_source"], hift.cfg.samples_per_frame
    with torch.inference_mode():
        whole = hift.decode(mel, source)
        if hift.cfg.causal:
            f0 = hift.predict_f0(mel[:, :, :40], finalize=False)
            assert f0.shape == (1, 37)
            assert_close_report(name(hift, "f0_prefix"), f0, hift.predict_f0(mel)[:, :37], 1e-6)
            part = hift.decode(mel[:, :, :37], source[:, :, : 37 * spf], finalize=False)
            assert part.shape == (1, 32 * spf)
            assert_close_report(name(hift, "prefix_wav"), part, whole[:, : 32 * spf], 1e-6)
        else:
            part = hift.decode(mel[:, :, :40], source[:, :, : 40 * spf])
            tail = (part[:, 32 * spf:] - whole[:, 32 * spf: 40 * spf]).abs().max()
            assert float(tail) > 1e-4, \
                "expected the non-causal vocoder's prefix to differ near its end"
            assert_close_report(name(hift, "prefix_head"), part[:, : 16 * spf],
                                whole[:, : 16 * spf], 1e-6)


def test_hift_pt_loads_with_or_without_the_generator_prefix(loaded: Any) -> None:
    hift, _ = loaded
    version = 3 if hift.cfg.causal else 2
    model_dir = load_model_dir(fixture_dir(version))
    state = torch.load(fixture_dir(version) / "hift.pt", weights_only=True)
    bare = {k.removeprefix("generator."): v for k, v in state.items()}
    fresh = HiFT(HiFTConfig.from_hparams(model_dir.section("hift"), version))
    load_hift_state(fresh, bare)
    assert torch.equal(fresh.conv_post.parametrizations.weight.original1,
                       bare["conv_post.parametrizations.weight.original1"].float())


def test_a_hift_pt_with_a_wrong_shape_fails_naming_hift_pt(tmp_path: Path) -> None:
    model_dir = load_model_dir(copy_model_dir(2, tmp_path / "m"))
    state = torch.load(fixture_dir(2) / "hift.pt", weights_only=True)
    state["generator.conv_post.bias"] = torch.zeros(3)
    (model_dir.path / "hift.pt").unlink()
    torch.save(state, model_dir.path / "hift.pt")
    with pytest.raises(ModelLoadError, match=r"hift\.pt.*conv_post\.bias"):
        build_hift(model_dir)
