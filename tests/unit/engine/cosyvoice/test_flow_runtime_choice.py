"""Choosing the flow estimator's runtime (flow_runtime/choose.py): TensorRT where it works, else
CUDA graphs, one warning line; and the GPU extra's pins. Where a part needs a GPU (TensorRT itself)
it is replaced by a stand-in that records what was asked of it; the test says so.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import tomllib
from torch import nn

from engine.backends.cosyvoice.flow_runtime import choose
from engine.backends.cosyvoice.flow_runtime.estimator_graphs import GraphedEstimator
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.flow import build_flow
from tests.support.cosyvoice_parity import (
    fixture_dir,
    one_torch_thread,  # noqa: F401 (autouse)
)
from tests.support.server import REPO


def tiny_flow() -> Any:
    return build_flow(load_model_dir(fixture_dir(3)))
def test_auto_falls_back_to_cuda_graphs_with_one_warning_line_when_tensorrt_fails(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # stand-in: TensorRT "imports" here, then fails as a missing libnvinfer would
    def broken(*args: Any, **kwargs: Any) -> None:
        raise ImportError("libnvinfer.so.10: cannot open shared object file\nmore detail")

    monkeypatch.setattr(choose, "trt_available", lambda: True)
    monkeypatch.setattr(choose, "install_tensorrt", broken)
    flow = tiny_flow()
    with caplog.at_level(logging.WARNING, logger="voxgate.engine"):
        assert choose.accelerate_flow(flow, "auto", device_type="cuda") == "cuda_graphs"
    assert isinstance(flow.decoder.estimator, GraphedEstimator)
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "TensorRT failed (ImportError: libnvinfer.so.10" in record.getMessage()
    assert "\n" not in record.getMessage()  # one line
    with pytest.raises(ImportError):  # asked for by name: its failure is the caller's
        choose.accelerate_flow(tiny_flow(), "tensorrt", device_type="cuda")


def test_only_the_streaming_engine_is_exported_and_built_with_one_context(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[str, Any]] = []

    def export(estimator: nn.Module, path: Path, streaming: bool) -> Path:
        calls.append(("export", streaming))
        return path

    def engine(onnx_path: Path, *args: Any) -> Path:
        calls.append(("build", onnx_path.name))
        return tmp_path / "engine.plan"

    class FakeTrt(nn.Module):  # stand-in: TensorRT's runtime needs a GPU
        def __init__(self, path: Path, profile: Any, fallback: nn.Module, contexts: int,
                     device: Any) -> None:
            super().__init__()
            calls.append(("contexts", contexts))

    monkeypatch.setattr(choose, "export_estimator", export)
    monkeypatch.setattr(choose, "cached_engine", engine)
    monkeypatch.setattr(choose, "TrtEstimator", FakeTrt)
    monkeypatch.setattr(choose, "trt_available", lambda: True)
    flow = tiny_flow()
    assert choose.accelerate_flow(flow, "tensorrt", cache_dir=tmp_path,
                                  device_type="cuda") == "tensorrt"
    assert calls == [("export", True), ("build", "estimator_streaming.onnx"), ("contexts", 1)]


def test_the_gpu_extra_pins_tensorrt_10_and_installs_one_onnxruntime() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    gpu = project["optional-dependencies"]["gpu"]
    trt = [r for r in gpu if r.startswith("tensorrt")]
    # 11 removed BuilderFlag.FP16
    assert len(trt) == 1 and re.match(r"tensorrt(-cu13)?==10\.\d+", trt[0]), trt
    runtimes = [r for r in [*project["dependencies"], *gpu] if r.startswith("onnxruntime")]
    # onnxruntime and onnxruntime-gpu are one module: they collide
    assert len(runtimes) == 1, runtimes
