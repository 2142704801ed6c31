"""Backend options from flags and the environment (engine/options.py), and the CLI flags that feed
them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.backends import create_backend
from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.options import config_from_options
from tests.support.server import REPO, free_port


def test_strings_become_the_fields_types_and_options_win_over_the_environment() -> None:
    env = {"VOXGATE_PIPER_NUM_THREADS": "3", "VOXGATE_PIPER_TARGET_PEAK": "0.7",
           "VOXGATE_PIPER_ONE_CALL_PER_ITEM": "false"}
    config = config_from_options(PiperBackendConfig, "piper",
                                 {"target_peak": "0.25", "voices_dir": "/v"}, "VOXGATE_PIPER_", env)
    assert (config.num_threads, config.target_peak, config.one_call_per_item) == (3, 0.25, False)
    assert config.voices_dir == Path("/v")
    none = config_from_options(PiperBackendConfig, "piper", {"target_peak": "none"}, None, {})
    assert none.target_peak is None and none.max_batch_size == PiperBackendConfig().max_batch_size


def test_unknown_keys_and_unreadable_values_are_clear_errors() -> None:
    with pytest.raises(ValueError,
                       match="unknown piper option 'model_dir'; expected one of: max_batch_size"):
        create_backend("piper", model_dir="/m")
    with pytest.raises(ValueError, match="num_threads must be an integer, got 'two'"):
        create_backend("piper", num_threads="two")
    with pytest.raises(ValueError, match="target_peak must be a number, got 'loud'"):
        create_backend("piper", target_peak="loud")
    assert isinstance(create_backend("piper", num_threads="1"), PiperBackend)


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--port", str(free_port()),
                           *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, check=False)


def test_a_bad_engine_option_stops_the_cli_with_a_message_not_a_traceback() -> None:
    result = _serve("--model-dir", "/models/cv3")  # piper (the default engine) has no model_dir
    assert result.returncode == 2
    assert "bad configuration: unknown piper option 'model_dir'" in result.stderr
    assert "Traceback" not in result.stderr


def test_model_dir_is_the_cosyvoice_option_it_stands_for(tmp_path: Path) -> None:
    result = _serve("--engine", "cosyvoice", "--model-dir", str(tmp_path / "missing"))
    assert result.returncode == 3  # uvicorn's exit code for a failed startup
    missing = tmp_path / "missing"
    assert f"voxgate cannot start: expected a CosyVoice model directory, got {missing}" \
        in result.stderr
    assert "Traceback" not in result.stderr
