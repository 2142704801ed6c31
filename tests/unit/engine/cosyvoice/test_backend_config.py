"""The cosyvoice backend's defaults are sized for the device it runs on (config.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.backends.cosyvoice.config import CosyVoiceBackendConfig


def test_batch_caps_default_to_gpu_sizes_on_a_gpu_and_small_ones_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = CosyVoiceBackendConfig(model_dir=Path("m"), device="cpu")
    assert (cpu.batch_size, cpu.num_streams, cpu.flow_streams, cpu.uses_flow_thread) == (8, 16, 16, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # stand-in: no GPU here
    gpu = CosyVoiceBackendConfig(model_dir=Path("m"))
    assert (gpu.batch_size, gpu.num_streams, gpu.flow_streams, gpu.uses_flow_thread) == (256, 512, 128, True)
    assert CosyVoiceBackendConfig(model_dir=Path("m"), max_batch_size=4).num_streams == 8  # asked: kept


def test_voice_features_are_versioned_by_the_frontend_models_bytes_not_their_size(tmp_path: Path) -> None:
    from engine.backends.cosyvoice.backend import _features_version

    def version_with(campplus: bytes) -> str:
        model_dir = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"
        model_dir.mkdir()
        (model_dir / "campplus.onnx").write_bytes(campplus)
        (model_dir / "cosyvoice3.yaml").write_text("sample_rate: 24000\n")
        return _features_version(CosyVoiceBackendConfig(model_dir=model_dir, device="cpu"))

    first = version_with(b"\x00\x01\x02\x03" * 1000)
    assert version_with(b"\x00\x01\x02\x03" * 1000) == first  # the same files: stored features stay
    # a re-exported speaker model of the same size: its features differ, so stored ones are stale
    assert version_with(b"\x00\x01\x02\x04" * 1000) != first
