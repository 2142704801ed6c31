"""The cosyvoice backend's options: data without the runtime, "auto" resolved once for the device
it runs on (config.py), and voice features versioned by what they depend on (voices.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine.backends.cosyvoice.config import CosyVoiceBackendConfig, Resolved


def test_every_auto_resolves_once_to_gpu_sizes_on_a_gpu_and_small_ones_on_the_cpu() -> None:
    options = CosyVoiceBackendConfig(model_dir=Path("m"))
    assert options.resolve(has_cuda=False, num_cores=2) == Resolved(
        device="cpu", lm_dtype="float32", flow_dtype="float32", decode_mode="dynamic", batch_size=8,
        num_streams=16, flow_streams=16, uses_flow_thread=False, num_threads=1,
        max_history_tokens=100)
    assert options.resolve(has_cuda=True, num_cores=32) == Resolved(
        device="cuda", lm_dtype="bfloat16", flow_dtype="bfloat16", decode_mode="cuda_graphs",
        batch_size=256, num_streams=512, flow_streams=128, uses_flow_thread=True, num_threads=8,
        max_history_tokens=100)
    asked = CosyVoiceBackendConfig(model_dir=Path("m"), device="cpu", max_batch_size=4,
                                   max_history_tokens=-1).resolve(has_cuda=True)
    assert (asked.device, asked.num_streams, asked.max_history_tokens) == ("cpu", 8, None)
    few_slots = CosyVoiceBackendConfig(model_dir=Path("m"), max_batch_size=8, max_streams=2)
    assert few_slots.resolve(False).batch_size == 2  # a step holds no more requests than slots


def test_the_options_module_imports_nothing_of_the_runtime() -> None:
    code = ("import sys; import engine.backends.cosyvoice.config as c; "
            "c.CosyVoiceBackendConfig().resolve(False); "
            "print(sorted(m for m in ('torch', 'onnxruntime', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_voice_features_are_versioned_by_the_frontend_models_bytes_not_their_size(
        tmp_path: Path) -> None:
    from engine.backends.cosyvoice.voices import features_version

    def version_with(campplus: bytes) -> str:
        model_dir = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"
        model_dir.mkdir()
        (model_dir / "campplus.onnx").write_bytes(campplus)
        (model_dir / "cosyvoice3.yaml").write_text("sample_rate: 24000\n")
        return features_version(CosyVoiceBackendConfig(model_dir=model_dir, device="cpu"))

    first = version_with(b"\x00\x01\x02\x03" * 1000)
    assert version_with(b"\x00\x01\x02\x03" * 1000) == first  # the same files: stored features stay
    # a re-exported speaker model of the same size: its features differ, so stored ones are stale
    assert version_with(b"\x00\x01\x02\x04" * 1000) != first
