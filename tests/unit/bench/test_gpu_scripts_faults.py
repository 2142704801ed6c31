"""The GPU benchmark scripts survive what a one-shot GPU run can meet: a failing case, no PyAV.

A device call is short and cannot be repeated at will, so a script must keep
every number it measured when one case fails, and must not need packages the
GPU image lacks (PyAV). These run the CPU smoke modes with faults injected.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.backends.cosyvoice.frontend.voice_prompts as voice_prompts_module
import engine.backends.cosyvoice.loader as loader_module
from bench import gpu_cosyvoice_lm, gpu_cosyvoice_pipeline, gpu_flow_estimator
from engine.backends.cosyvoice.backend import CosyVoiceBackend
from tests.support.cosyvoice_tiny import tiny_model_dir


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_lm_benchmark_reports_a_failing_case_and_measures_the_rest(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = gpu_cosyvoice_lm.time_decode

    def flaky(runner: Any, streams: list[Any], *args: Any) -> float:
        if len(streams) == 2:
            raise RuntimeError("CUDA error: out of memory")
        return real(runner, streams, *args)

    monkeypatch.setattr(gpu_cosyvoice_lm, "time_decode", flaky)
    result = gpu_cosyvoice_lm.main(["--smoke", "--json", str(tmp_path / "lm.json")])
    assert [(r["mode"], r["batch"]) for r in result["rows"]] == [
        (m, b) for m in ("dynamic", "static") for b in (1, 4)]
    assert set(result["errors"]) == {"dynamic 2", "static 2"}
    saved = json.loads((tmp_path / "lm.json").read_text(encoding="utf-8"))
    assert saved["errors"] == result["errors"] and len(saved["sampling_ms"]) == 3


def test_flow_benchmark_reports_a_failing_batch_and_measures_the_rest(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = gpu_flow_estimator.median_ms

    def flaky(run: Any, *args: Any) -> float:
        if run.args[0].shape[0] == 4:  # 2 streams: 4 CFG rows
            raise RuntimeError("CUDA error: out of memory")
        return real(run, *args)

    monkeypatch.setattr(gpu_flow_estimator, "median_ms", flaky)
    result = gpu_flow_estimator.main(["--smoke", "--json", str(tmp_path / "flow.json")])
    assert set(result["errors"]) == {"eager 2", "static 2", "onnxruntime 2"}
    assert [(r["mode"], r["streams"]) for r in result["rows"]] == [
        ("eager", 1), ("static", 1), ("onnxruntime", 1)]
    saved = json.loads((tmp_path / "flow.json").read_text(encoding="utf-8"))
    assert saved["errors"] == result["errors"] and len(saved["concurrency"]) == 2


def test_pipeline_benchmark_reports_a_failing_n_and_runs_the_next(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    real_step = CosyVoiceBackend.step
    calls = 0

    def failing_third_step(self: CosyVoiceBackend, batch: list[Any]) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:  # mid-pass, the first request holding its KV-cache slot
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step(self, batch)

    monkeypatch.setattr(CosyVoiceBackend, "step", failing_third_step)
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp(), 3)
    result = gpu_cosyvoice_pipeline.main(["--smoke", "--model-dir", str(model_dir), "--workdir",
                                          str(tmp_path), "--json", str(tmp_path / "pipeline.json")])
    assert list(result["errors"]) == ["1"] and "illegal memory access" in result["errors"]["1"]
    # the failed pass gave its slot back: both streams of the next N ran to the end
    assert [r["streams"] for r in result["rows"]] == [2]
    assert result["rows"][0]["silent"] == 0
    saved = json.loads((tmp_path / "pipeline.json").read_text(encoding="utf-8"))
    assert saved["errors"] == result["errors"] and len(saved["rows"]) == 1


def test_pipeline_benchmark_stops_a_pass_that_outlives_its_budget(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp(), 3)
    result = gpu_cosyvoice_pipeline.main(["--smoke", "--model-dir", str(model_dir), "--workdir",
                                          str(tmp_path), "--budget-s", "0"])
    assert result["rows"] == []
    assert all(e.startswith("skipped") for e in result["errors"].values())
    assert len(result["errors"]) == 2


def test_pipeline_benchmark_runs_without_pyav(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # the script swaps in stand-ins for these two; put the originals back afterwards
    monkeypatch.setattr(loader_module, "read_audio", loader_module.read_audio)
    monkeypatch.setattr(voice_prompts_module, "resample", vars(voice_prompts_module)["resample"])
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now raises ImportError
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp(), 3)
    result = gpu_cosyvoice_pipeline.main(["--smoke", "--model-dir", str(model_dir), "--workdir",
                                          str(tmp_path)])
    assert result["pyav"] is False and result["errors"] == {}
    assert all(r["audio_s_mean"] > 0 for r in result["rows"])


def test_the_cosyvoice_backend_imports_without_pyav() -> None:
    code = ("import sys; sys.modules['av'] = None\n"
            "import engine.backends.cosyvoice.backend, engine.backends.cosyvoice.loader\n"
            "import bench.gpu_cosyvoice_lm, bench.gpu_cosyvoice_pipeline, "
            "bench.gpu_flow_estimator\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3], check=False)
    assert done.returncode == 0, done.stderr[-2000:]
