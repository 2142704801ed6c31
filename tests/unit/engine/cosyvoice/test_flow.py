"""The CosyVoice flow (tokens -> mel) against upstream's outputs, and its padded batches."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.flow import FlowModel, FlowRow, build_flow, fixed_noise
from engine.backends.cosyvoice.models.mel import MelConfig, MelExtractor, slaney_filterbank
from engine.backends.cosyvoice.t2w.streams import FlowPrompt
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
def loaded(request: pytest.FixtureRequest) -> tuple[FlowModel, dict[str, Any]]:
    model_dir, reference = load_fixture(request.param)
    return build_flow(model_dir), reference


def reference_row(ref: dict[str, Any], extra: torch.Tensor | None = None,
                  lookahead: int = 0) -> FlowRow:
    tokens = torch.cat([ref["prompt_speech_token"][0], ref["flow_token"][0]])
    if extra is not None:
        tokens = torch.cat([tokens, extra])
    frames = 2 * (tokens.shape[0] - lookahead)
    return FlowRow(tokens, ref["prompt_feat"][0], ref["embedding"][0], lookahead,
                   torch.arange(frames))


def test_fixed_noise_is_upstreams_seed_zero_noise(loaded: Any) -> None:
    _, ref = loaded
    assert_close_report("flow.noise", fixed_noise()[None, :, :200], ref["flow_noise"], 0.0)


def test_offline_mel_matches_upstream(loaded: Any) -> None:
    flow, ref = loaded
    mel = flow.infer([reference_row(ref)], streaming=False)[0]
    prompt_frames = ref["prompt_feat"].shape[1]
    assert_close_report(f"flow_v{flow.version}.mel", mel[None, :, prompt_frames:], ref["flow_mel"],
                        ATOL)


def test_batched_rows_equal_rows_run_alone(loaded: Any) -> None:
    """Different lengths, one row with lookahead, one final, another voice: padding changes
    nothing."""
    flow, ref = loaded
    gen = torch.Generator().manual_seed(3)
    long_row = reference_row(ref, torch.randint(0, 6561, (9,), generator=gen), lookahead=3)
    short = reference_row(ref)
    other = FlowRow(short.tokens[:33], ref["prompt_feat"][0, :30] * 0.5,
                    torch.randn(192, generator=gen), 0, torch.arange(20, 86))
    rows = [short, long_row, other]
    for streaming in (True, False):
        together = flow.infer(rows, streaming=streaming)
        for i, row in enumerate(rows):
            alone = flow.infer([row], streaming=streaming)[0]
            assert_close_report(f"flow_v{flow.version}.batched_mel[{i}] streaming={streaming}",
                                together[i], alone, 1e-5)


def test_lookahead_tokens_change_only_the_frames_that_see_them(loaded: Any) -> None:
    """With lookahead, the mel stops 3 tokens early; frames far from the end equal the final
    run's."""
    flow, ref = loaded
    row = reference_row(ref)
    final = flow.infer([row], streaming=True)[0]
    with_lookahead = flow.infer([FlowRow(row.tokens, row.prompt_mel, row.embedding, 3,
                                         torch.arange(2 * (row.tokens.shape[0] - 3)))],
                                streaming=True)[0]
    assert with_lookahead.shape[1] == final.shape[1] - 6
    # chunked attention: the first 25-token cell cannot see the end of the sequence
    assert_close_report(f"flow_v{flow.version}.lookahead_prefix", with_lookahead[:, :50],
                        final[:, :50], 1e-5)


def test_a_checkpoint_missing_a_key_fails_naming_flow_pt(tmp_path: Path) -> None:
    model_dir = load_model_dir(copy_model_dir(3, tmp_path / "m"))
    state = torch.load(fixture_dir(3) / "flow.pt", weights_only=True)
    state.pop("decoder.estimator.proj_out.bias")
    (model_dir.path / "flow.pt").unlink()
    torch.save(state, model_dir.path / "flow.pt")
    with pytest.raises(ModelLoadError, match=r"flow\.pt.*proj_out\.bias"):
        build_flow(model_dir)


def test_flow_row_rejects_noise_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="expected noise_index"):
        FlowRow(torch.zeros(10, dtype=torch.long), torch.zeros(4, 80), torch.zeros(192), 3,
                torch.arange(20))


# -- prompt mel (upstream feat_extractor: Matcha-TTS mel_spectrogram with librosa's filterbank) --


def test_mel_filterbank_matches_librosas_slaney_filterbank() -> None:
    """Reference values printed by librosa 0.11 `filters.mel(sr=24000, n_fft=1920, n_mels=80,
    fmin=0, fmax=...)`."""
    basis = slaney_filterbank(24000, 1920, 80, 0.0, 8000.0)
    assert basis.shape == (80, 961)
    want_row_sums = torch.tensor([0.07999607920646667, 0.07999607920646667, 0.07995374500751495,
                                  0.08000148832798004])
    assert_close_report("mel.basis_row_sums", basis[[0, 10, 40, 79]].sum(1), want_row_sums, 1e-6)
    assert abs(float(basis.max()) - 0.02666536) < 1e-7
    assert abs(float(slaney_filterbank(24000, 1920, 80, 0.0, None).max()) - 0.023626816) < 1e-7


def test_prompt_mel_has_one_frame_per_480_samples_and_peaks_at_the_tone() -> None:
    model_dir = load_model_dir(fixture_dir(2))
    extractor = MelExtractor(MelConfig.from_hparams(model_dir.hparams["feat_extractor"]))
    t = torch.arange(24000) / 24000
    mel = extractor(0.5 * torch.sin(2 * torch.pi * 440 * t))
    assert mel.shape == (1, 50, 80)
    centres = torch.tensor([float(c)
                            for c in (slaney_filterbank(24000, 1920, 80, 0.0,
                                                        8000.0).argmax(1) * 12.5)])
    assert int(mel[0, 25].argmax()) == int((centres - 440).abs().argmin())
    assert float(mel.min()) >= torch.log(torch.tensor(1e-5)).item() - 1e-6


def test_flow_prompt_from_audio_trims_tokens_and_mel_to_one_to_two() -> None:
    prompt = FlowPrompt.from_audio(list(range(30)), torch.zeros(24000) + 0.01, torch.ones(192),
                                   MelExtractor())
    assert prompt.tokens.shape == (25,) and prompt.mel.shape == (50, 80)


def test_a_bfloat16_flow_stays_close_to_float32_and_keeps_its_noise_exact(loaded: Any) -> None:
    """Lower precision on a GPU: the ODE state, time, noise and rotary angles stay float32."""
    flow, ref = loaded
    half = copy.deepcopy(flow).to(torch.bfloat16)
    assert half.noise.dtype == torch.float32
    row = reference_row(ref)
    got = half.infer([row], streaming=True)[0]
    want = flow.infer([row], streaming=True)[0]
    assert got.dtype == torch.float32
    rel = float((got - want).pow(2).mean().sqrt() / want.std())
    assert rel < 0.1, f"bfloat16 mel departs {rel:.2%} (relative RMS) from float32"
