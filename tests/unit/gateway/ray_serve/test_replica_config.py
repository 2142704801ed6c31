"""A gateway replica's configuration (gateway/ray_serve/replica_config.py), without Ray: the
keys `voxgate serve` would load, and its refusal of an exposed proxy without them. On a local
cluster: tests/e2e/test_ray_serve_auth.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.ray_serve.replica_config import EXPOSED_HOST, replica_config

KEY = "sk-replica-key-0123"


def test_a_replica_loads_the_keys_of_its_environment_like_voxgate_serve() -> None:
    config = replica_config({"max_batch_size": 4}, "0.0.0.0", 8000, {"VOXGATE_API_KEYS": KEY})
    assert config.auth.is_enabled and config.auth.api_keys == (KEY,)
    assert not config.auth.is_loopback_mode  # a Host header naming localhost grants nothing
    assert (config.host, config.port, config.max_batch_size) == ("0.0.0.0", 8000, 4)


def test_a_replica_reads_a_keys_file_named_in_its_options(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    config = replica_config({"api_keys_file": str(keys)}, "0.0.0.0", 8000, {})
    assert config.auth.api_keys == (KEY,)


def test_a_replica_behind_an_exposed_proxy_refuses_to_start_without_keys() -> None:
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0 without API keys"):
        replica_config({}, "0.0.0.0", 8000, {})
    with pytest.raises(ValueError, match="without API keys"):  # an empty keys variable loads none
        replica_config({}, "10.0.0.5", 8000, {"VOXGATE_API_KEYS": " , "})
    with pytest.raises(ValueError, match=f"refusing to listen on {EXPOSED_HOST}"):
        replica_config({}, EXPOSED_HOST, 0, {})  # the proxy's address could not be read


def test_the_proxys_address_wins_over_a_host_in_the_options() -> None:
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0"):
        replica_config({"host": "127.0.0.1"}, "0.0.0.0", 8000, {"VOXGATE_HOST": "127.0.0.1"})


def test_no_auth_or_a_loopback_proxy_starts_without_keys() -> None:
    opened = replica_config({"no_auth": True}, "0.0.0.0", 8000, {})
    assert not opened.auth.is_enabled and opened.auth.allow_no_auth
    loopback = replica_config({}, "127.0.0.1", 8000, {})
    assert loopback.auth.is_loopback_mode  # the proxy is reachable from this machine only
