"""The GPU benchmark scripts run end to end in their CPU smoke mode, so they do not rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import gpu_cosyvoice_lm, gpu_cosyvoice_pipeline
from tests.conftest import REPO
from tests.cosyvoice_tiny import tiny_model_dir


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_lm_benchmark_times_every_batch_in_every_mode(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    result = gpu_cosyvoice_lm.main(["--smoke", "--json", str(tmp_path / "lm.json")])
    assert [(r["mode"], r["batch"]) for r in result["rows"]] == [
        (m, b) for m in ("dynamic", "static") for b in (1, 2, 4)]
    assert all(r["decode_ms"] > 0 for r in result["rows"])
    assert "| 4 |" in capsys.readouterr().out
    assert (tmp_path / "lm.json").is_file()


def test_pipeline_benchmark_reports_ttfa_gaps_and_stage_times(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp(), 3)
    result = gpu_cosyvoice_pipeline.main(["--smoke", "--model-dir", str(model_dir), "--workdir", str(tmp_path)])
    assert [r["streams"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert 0 < row["ttfa_p50_ms"] <= row["ttfa_p95_ms"] <= row["ttfa_max_ms"]
        assert row["audio_s_mean"] > 0
        assert set(row["stages"]) == {"lm_step", "flow", "hift"}
    assert "gap-free with TTFA p95 < 300 ms up to" in capsys.readouterr().out


def test_the_one_device_call_runs_all_three_and_returns_few_enough_files(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SMOKE": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    result = subprocess.run(["bash", str(REPO / "bench" / "gpu_all.sh")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600, check=True)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) <= 8  # the device returns at most 8 files
    for name in ("gpu_flow_estimator", "gpu_cosyvoice_lm", "gpu_cosyvoice_pipeline"):
        assert f"{name}.log" in files
        assert json.loads((tmp_path / "out" / f"{name}.json").read_text()), name
        assert f"== {name}" in result.stdout
    assert result.stdout.count("   exit 0 after") == 3
