"""The GPU benchmark scripts run end to end in their CPU smoke mode, so they do not rot between GPU
runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import gpu_cosyvoice_lm, gpu_cosyvoice_pipeline, gpu_flow_cache, gpu_flow_profile
from tests.support.cosyvoice_tiny import tiny_model_dir
from tests.support.server import REPO


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_lm_benchmark_times_every_batch_in_every_mode(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    result = gpu_cosyvoice_lm.main(["--smoke", "--json", str(tmp_path / "lm.json")])
    assert [(r["mode"], r["batch"]) for r in result["rows"]] == [
        (m, b) for m in ("dynamic", "static") for b in (1, 2, 4)]
    assert all(r["decode_ms"] > 0 for r in result["rows"])
    assert "| 4 |" in capsys.readouterr().out
    assert (tmp_path / "lm.json").is_file()


def test_pipeline_benchmark_reports_ttfa_gaps_and_stage_times(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp(), 3)
    result = gpu_cosyvoice_pipeline.main(["--smoke", "--model-dir", str(model_dir), "--workdir",
                                          str(tmp_path)])
    assert [r["streams"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert 0 < row["ttfa_p50_ms"] <= row["ttfa_p95_ms"] <= row["ttfa_max_ms"]
        assert row["audio_s_mean"] > 0
        assert set(row["stages"]) == {"lm_step", "flow", "hift"}
    assert "gap-free with TTFA p95 < 300 ms up to" in capsys.readouterr().out


def test_flow_cache_benchmark_times_the_cached_tick_against_recomputation_and_both_layouts(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    result = gpu_flow_cache.main(["--smoke", "--json", str(tmp_path / "cache.json")])
    assert not result["errors"]
    assert [r["streams"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["recompute_ms"] > 0 and row["cached_ms"] > 0 and row["cached_audio_s_per_s"] > 0
    for case in result["attention"]:
        assert case["paged_ms"] > 0 and case["contiguous_ms"] > 0
        # the prompt is not copied
        assert case["paged_gib_per_stream"] < case["contiguous_gib_per_stream"]
    assert result["memory"]["gib_per_stream"] > 0
    assert [v["streams"] for v in result["vocoder"]["rows"]] == [1, 2]
    assert all(v["eager_ms"] > 0 and v["graphs_ms"] > 0 for v in result["vocoder"]["rows"])
    assert "| 2 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "cache.json").read_text())["rows"][1]["cached_ms"] > 0


def test_flow_profile_sums_kernels_per_category_and_times_each_mask_form(tmp_path: Path) -> None:
    # this build's own flow_dit.py as the anchor: the same pass, so no difference at all
    anchor = REPO / "engine" / "backends" / "cosyvoice" / "models" / "flow_dit.py"
    result = gpu_flow_profile.main(["--smoke", "--json", str(tmp_path / "profile.json"),
                                    "--anchor-dit", str(anchor)])
    assert not result["errors"]
    assert [(c["streams"], c["frames"]) for c in result["cases"]] == [(2, 64), (1, 64)]
    for case in result["cases"]:
        assert case["eager_ms"] > 0
        kernels = case["kernels"]
        assert kernels["total_ms"] == pytest.approx(sum(kernels["by_category_ms"].values()),
                                                    abs=0.01)
        assert {"matmul", "attention"} <= set(kernels["by_category_ms"])
        assert set(case["attention_ms"]) == {"per_row_bool_mask", "shared_bool_mask", "no_mask"}
        # the CPU's one backend
        assert len(case["attention_backends"]["math"]["first_call_ms"]) == 3
        assert case["anchor"]["rel_rms"] == 0 and case["anchor"]["ops"] == case["ops"]["total"] > 0
        assert "compiled" not in case  # not in smoke mode unless asked
    assert json.loads((tmp_path / "profile.json").read_text())["cases"][0]["eager_ms"] > 0


def test_flow_profile_reads_cases_and_refuses_malformed_ones() -> None:
    assert gpu_flow_profile.parse_cases("128x480, 1x200") == [(128, 480), (1, 200)]
    for bad in ("128", "0x480", "8x1", "ax4"):
        with pytest.raises(ValueError, match="STREAMSxFRAMES"):
            gpu_flow_profile.parse_cases(bad)
    assert gpu_flow_profile.category(
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>") == "matmul"
    assert gpu_flow_profile.category("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert gpu_flow_profile.category("void at::native::vectorized_elementwise_kernel<4>") == "other"


def bash_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
            "SMOKE": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            **extra}


def copy_as_anchor(target: Path) -> Path:
    """This checkout's engine, gateway and test support as the 'build before' (what gpu_prepare.sh
    would archive), so the smoke run drives a second tree exactly as the device run does."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("engine", "gateway", "web", "bench", "tests/support"):
        shutil.copytree(REPO / part, target / part, ignore=skip)
    shutil.copy(REPO / "tests" / "__init__.py", target / "tests" / "__init__.py")
    (target / "REF").write_text("this checkout\n")
    return target


PARTS = ("flow", "lm", "pipeline", "gateway", "pipeline_before")
RESULTS = {"flow": "flow.json", "lm": "lm.json", "pipeline": "pipeline.json",
           "gateway": "gateway.json", "pipeline_before": "pipeline_before.json"}


def test_the_one_device_call_runs_both_builds_and_the_gateway_and_returns_at_most_eight_files(
        tmp_path: Path) -> None:
    anchor = copy_as_anchor(tmp_path / "anchor")
    result = subprocess.run(["bash", str(REPO / "bench" / "gpu_all.sh")], cwd=REPO,
                            env=bash_env(tmp_path, ANCHOR=str(anchor)), capture_output=True,
                            text=True, timeout=600, check=True)
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["gpu.txt", "gpu.log", "gateway_server.log", *RESULTS.values()])
    assert len(files) <= 8  # what the device gives back
    assert result.stdout.count("   exit 0 after") == len(PARTS)
    log = (out / "gpu.log").read_text()
    for name in PARTS:
        assert f"== {name} (at most" in result.stdout and f"== {name} (at most" in log
    this, before = (json.loads((out / name).read_text())
                    for name in ("pipeline.json", "pipeline_before.json"))
    assert (this["label"], before["label"]) == ("this build", "build before")
    for row in this["rows"] + before["rows"]:
        assert row["lm_step_p50_ms"] <= row["lm_step_p99_ms"] and row["solo_step_p50_ms"] > 0
        assert row["audio_s_per_s"] > 0 and row["cache_gib"]["lm"] > 0
    assert [r["streams"] for r in this["rows"]] == [r["streams"] for r in before["rows"]] == [1, 2]
    gateway = json.loads((out / "gateway.json").read_text())
    assert [level["sessions"] for level in gateway["levels"]] == [1, 2] and not gateway["errors"]
    assert all(level["turns_completed"] == level["turns_started"] > 0
               for level in gateway["levels"])
    assert gateway["metrics"]["voxgate_engine_audio_seconds_total"] > 0
    assert "anchor: this checkout" in (out / "gpu.txt").read_text()
    assert f"voxgate from {REPO}" in (out / "gateway_server.log").read_text()


def test_the_one_device_call_runs_only_the_parts_asked_for(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(REPO / "bench" / "gpu_all.sh")], cwd=REPO,
                            env=bash_env(tmp_path, PARTS="lm", ANCHOR=str(tmp_path / "none")),
                            capture_output=True, text=True, timeout=600, check=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu.log", "gpu.txt", "lm.json"]
    assert result.stdout.count("   exit 0 after") == 1
    assert "no build before" in result.stdout  # said, not failed


def test_every_part_of_the_device_call_gets_a_budget_inside_its_timeout() -> None:
    script = (REPO / "bench" / "gpu_all.sh").read_text(encoding="utf-8")
    calls = [line.split() for line in script.replace("\\\n", " ").splitlines()
             if line.strip().startswith("part ")]
    assert {call[1] for call in calls} == {"flow", "lm", "pipeline", "gateway", "pipeline_before",
                                           "gateway_before", "profile"}
    # each script ends itself cleanly before `timeout` kills it; the LM bench is short
    for call in calls:
        assert call[1] == "lm" or "@BUDGET@" in call, call[1]
    assert 'command+=("$((limit - 15))")' in script  # the budget: 15 s inside the part's timeout
    shares = {}
    for name in ("FLOW_S", "LM_S", "PIPELINE_S", "GATEWAY_S"):
        found = re.search(rf"{name}=\${{{name}:-(\d+)}}", script)
        assert found is not None, name
        shares[name] = int(found.group(1))
    assert sum(shares.values()) <= 570 - 60  # the build before keeps a minute at least
