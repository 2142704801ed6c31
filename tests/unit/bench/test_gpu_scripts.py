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

from bench import gpu_cosyvoice_lm, gpu_cosyvoice_pipeline, gpu_flow_profile
from tests.support.cosyvoice_tiny import tiny_model_dir
from tests.support.server import REPO


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


def test_flow_profile_sums_kernels_per_category_and_times_each_mask_form(tmp_path: Path) -> None:
    # this build's own flow_dit.py as the anchor: the same pass, so no difference at all
    anchor = REPO / "engine" / "backends" / "cosyvoice" / "models" / "flow_dit.py"
    result = gpu_flow_profile.main(["--smoke", "--json", str(tmp_path / "profile.json"), "--anchor-dit", str(anchor)])
    assert not result["errors"]
    assert [(c["streams"], c["frames"]) for c in result["cases"]] == [(2, 64), (1, 64)]
    for case in result["cases"]:
        assert case["eager_ms"] > 0
        kernels = case["kernels"]
        assert kernels["total_ms"] == pytest.approx(sum(kernels["by_category_ms"].values()), abs=0.01)
        assert {"matmul", "attention"} <= set(kernels["by_category_ms"])
        assert set(case["attention_ms"]) == {"per_row_bool_mask", "shared_bool_mask", "no_mask"}
        assert len(case["attention_backends"]["math"]["first_call_ms"]) == 3  # the CPU's one backend
        assert case["anchor"]["rel_rms"] == 0 and case["anchor"]["ops"] == case["ops"]["total"] > 0
        assert "compiled" not in case  # not in smoke mode unless asked
    assert json.loads((tmp_path / "profile.json").read_text())["cases"][0]["eager_ms"] > 0


def test_flow_profile_reads_cases_and_refuses_malformed_ones() -> None:
    assert gpu_flow_profile.parse_cases("128x480, 1x200") == [(128, 480), (1, 200)]
    for bad in ("128", "0x480", "8x1", "ax4"):
        with pytest.raises(ValueError, match="STREAMSxFRAMES"):
            gpu_flow_profile.parse_cases(bad)
    assert gpu_flow_profile.category("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>") == "matmul"
    assert gpu_flow_profile.category("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert gpu_flow_profile.category("void at::native::vectorized_elementwise_kernel<4>") == "other"


SCRIPTS = ("gpu_flow_estimator", "gpu_flow_profile", "gpu_cosyvoice_lm", "gpu_cosyvoice_pipeline")


def test_the_one_device_call_runs_all_four_and_returns_few_enough_files(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SMOKE": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    result = subprocess.run(["bash", str(REPO / "bench" / "gpu_all.sh")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600, check=True)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == sorted(["gpu.txt", "gpu.log"] + [f"{name}.json" for name in SCRIPTS])  # the device returns 8
    log = (tmp_path / "out" / "gpu.log").read_text()
    for name in SCRIPTS:
        assert json.loads((tmp_path / "out" / f"{name}.json").read_text()), name
        assert f"== {name}" in result.stdout and f"== {name}" in log
    assert result.stdout.count("   exit 0 after") == 4


def test_the_one_device_call_runs_only_the_parts_asked_for(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SMOKE": "1", "PARTS": "gpu_flow_profile",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    result = subprocess.run(["bash", str(REPO / "bench" / "gpu_all.sh")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600, check=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu.log", "gpu.txt", "gpu_flow_profile.json"]
    assert result.stdout.count("   exit 0 after") == 1
