"""cuDNN's attention kernels are off on a GPU unless asked (loader.choose_attention), chosen before
anything runs; the CPU is left alone."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.loader import choose_attention


@pytest.fixture
def cudnn_sdp_flag() -> Any:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cudnn_attention_is_off_on_a_gpu_unless_asked_and_the_cpu_is_left_alone(
        cudnn_sdp_flag: Any, caplog: pytest.LogCaptureFixture) -> None:
    # torch's switch is a process-wide flag that a CPU build keeps too: the choice is visible here
    torch.backends.cuda.enable_cudnn_sdp(True)
    choose_attention(torch.device("cpu"), False)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with caplog.at_level(logging.INFO, logger="voxgate.engine"):
        choose_attention(torch.device("cuda"), False)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert "cuDNN kernels off" in caplog.text
    choose_attention(torch.device("cuda"), True)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert CosyVoiceBackendConfig().cudnn_attention is False
    assert CosyVoiceBackendConfig.from_options({"cudnn_attention": "on"},
                                               {}).cudnn_attention is True


def test_the_loader_chooses_the_attention_before_anything_runs(
        monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    from engine.backends.cosyvoice import loader
    from tests.support.cosyvoice_tiny import tiny_options

    events: list[object] = []
    monkeypatch.setattr(loader, "choose_attention",
                        lambda device, cudnn: events.append((device.type, cudnn)))
    real_load_lm = loader.load_speech_lm
    monkeypatch.setattr(loader, "load_speech_lm",
                        lambda *a, **k: (events.append("lm"), real_load_lm(*a, **k))[1])
    config = CosyVoiceBackendConfig.from_options({**tiny_options(tmp_path_factory.getbasetemp()),
                                                  "cudnn_attention": "yes"}, {})
    loader.load_model(config, config.resolve(has_cuda=False))
    assert events == [("cpu", True), "lm"]  # chosen once, before the first model is built
