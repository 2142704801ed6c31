"""Gateway configuration from VOXGATE_* variables, converted as backend options are."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import GatewayConfig


def test_variables_fill_the_config_with_their_fields_types_and_overrides_win() -> None:
    env = {"VOXGATE_PORT": "9001", "VOXGATE_SHUTDOWN_GRACE_S": "2.5", "VOXGATE_WEB_DIR": "/srv/web",
           "VOXGATE_VOICE": "amy", "VOXGATE_LIMIT_MAX_OPEN_CONTEXTS": "3",
           "VOXGATE_LIMIT_IDLE_TIMEOUT_S": "60"}
    config = GatewayConfig.from_env(env, voice="joe", host=None)
    assert (config.port, config.shutdown_grace_s, config.web_dir) == (9001, 2.5, Path("/srv/web"))
    assert config.voice == "joe" and config.host == "127.0.0.1"  # None: not given
    assert (config.limits.max_open_contexts, config.limits.idle_timeout_s) == (3, 60.0)


def test_an_optional_path_given_as_none_or_empty_is_none() -> None:
    assert GatewayConfig.from_env({"VOXGATE_WEB_DIR": "none"}).web_dir is None
    assert GatewayConfig.from_env({"VOXGATE_VOICE_ASSETS": ""}).voice_assets is None


def test_a_bad_value_says_what_was_expected() -> None:
    with pytest.raises(ValueError, match="port must be an integer, got 'http'"):
        GatewayConfig.from_env({"VOXGATE_PORT": "http"})
    with pytest.raises(ValueError, match="max_open_contexts must be >= 1, got 0"):
        GatewayConfig.from_env({"VOXGATE_LIMIT_MAX_OPEN_CONTEXTS": "0"})


def test_structured_fields_are_never_read_whole_from_one_variable() -> None:
    config = GatewayConfig.from_env({"VOXGATE_LIMITS": "x", "VOXGATE_AUTH": "y",
                                     "VOXGATE_ENGINE_OPTIONS": "z"})
    assert config.engine_options == {} and config.auth.api_keys == ()
    assert config.limits.max_open_contexts == 16


def test_the_fair_share_caps_tenants_and_leaves_loopback_mode_uncapped_unless_asked() -> None:
    from gateway.access.keys import AuthConfig

    keyed = AuthConfig(api_keys=("key-one-12345",))
    assert GatewayConfig(auth=keyed).engine_share == 0.5  # keys name tenants
    assert GatewayConfig(host="0.0.0.0", auth=AuthConfig(allow_no_auth=True)).engine_share == 0.5
    assert GatewayConfig().engine_share == 1.0  # loopback mode: the operator's own processes
    assert GatewayConfig(max_engine_share=0.25).engine_share == 0.25
    with pytest.raises(ValueError, match=r"max_engine_share must be within \[0, 1\]"):
        GatewayConfig(max_engine_share=1.5)


def test_voice_for_comes_from_its_variable_or_the_flags_which_win() -> None:
    env = {"VOXGATE_VOICE_FOR": "zh-CN=mei, ru=ivan"}
    assert GatewayConfig.from_env(env).voice_for == {"zh": "mei", "ru": "ivan"}
    assert GatewayConfig.from_env(env, voice_for={"ja": "kumi"}).voice_for == {"ja": "kumi"}
    assert GatewayConfig.from_env({}).voice_for == {}
    with pytest.raises(ValueError, match="LANGUAGE=VOICE"):
        GatewayConfig.from_env({"VOXGATE_VOICE_FOR": "mei"})
    with pytest.raises(ValueError, match="language tags"):
        GatewayConfig(voice_for={"chinese!": "mei"})
