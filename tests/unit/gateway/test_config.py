"""Gateway configuration from options and VOXGATE_* variables, converted as backend options are."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import GatewayConfig, load_config


def test_variables_fill_the_config_with_their_fields_types_and_overrides_win() -> None:
    env = {"VOXGATE_PORT": "9001", "VOXGATE_SHUTDOWN_GRACE_S": "2.5", "VOXGATE_WEB_DIR": "/srv/web",
           "VOXGATE_VOICE": "amy", "VOXGATE_LIMIT_MAX_OPEN_CONTEXTS": "3",
           "VOXGATE_LIMIT_IDLE_TIMEOUT_S": "60"}
    config = load_config({"voice": "joe", "host": None}, env)
    assert (config.port, config.shutdown_grace_s, config.web_dir) == (9001, 2.5, Path("/srv/web"))
    assert config.voice == "joe" and config.host == "127.0.0.1"  # None: not given
    assert (config.limits.max_open_contexts, config.limits.idle_timeout_s) == (3, 60.0)


def test_deflate_is_off_unless_the_operator_turns_it_on() -> None:
    assert load_config({}, {}).ws_per_message_deflate is False
    assert load_config({}, {"VOXGATE_WS_PER_MESSAGE_DEFLATE": "true"}).ws_per_message_deflate


def test_an_optional_path_given_as_none_or_empty_is_none() -> None:
    assert load_config(None, {"VOXGATE_WEB_DIR": "none"}).web_dir is None
    assert load_config(None, {"VOXGATE_VOICE_ASSETS": ""}).voice_assets is None


def test_a_bad_value_says_what_was_expected() -> None:
    with pytest.raises(ValueError, match="port must be an integer, got 'http'"):
        load_config(None, {"VOXGATE_PORT": "http"})
    with pytest.raises(ValueError, match="max_open_contexts must be >= 1, got 0"):
        load_config(None, {"VOXGATE_LIMIT_MAX_OPEN_CONTEXTS": "0"})


def test_structured_fields_are_never_read_whole_from_one_variable() -> None:
    config = load_config(None, {"VOXGATE_LIMITS": "x", "VOXGATE_AUTH": "y",
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
    assert load_config(None, env).voice_for == {"zh": "mei", "ru": "ivan"}
    assert load_config({"voice_for": {"ja": "kumi"}}, env).voice_for == {"ja": "kumi"}
    assert load_config(None, {}).voice_for == {}
    with pytest.raises(ValueError, match="LANGUAGE=VOICE"):
        load_config(None, {"VOXGATE_VOICE_FOR": "mei"})
    with pytest.raises(ValueError, match="language tags"):
        GatewayConfig(voice_for={"chinese!": "mei"})


KEY, ADMIN = "sk-config-key-0123", "sk-config-admin-0123"


def test_keys_come_from_their_variables_as_voxgate_serve_reads_them() -> None:
    env = {"VOXGATE_API_KEYS": f"{KEY}, other-key-0123", "VOXGATE_ADMIN_KEYS": ADMIN,
           "VOXGATE_ALLOWED_ORIGINS": "https://app.example, https://b.example"}
    auth = load_config(None, env).auth
    assert auth.api_keys == (KEY, "other-key-0123") and auth.admin_keys == (ADMIN,)
    assert auth.allowed_origins == ("https://app.example", "https://b.example")
    assert auth.is_enabled and not auth.allow_no_auth
    assert not load_config(None, {}).auth.is_enabled  # no keys: auth off (loopback mode)


def test_keys_files_come_from_the_options_or_their_variables(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# tenants\n{KEY}\n")
    admins = tmp_path / "admins"
    admins.write_text(ADMIN + "\n")
    by_option = load_config({"api_keys_file": str(keys), "admin_keys_file": str(admins)}, {}).auth
    assert by_option.api_keys == (KEY,) and by_option.admin_keys == (ADMIN,)
    by_variable = load_config(None, {"VOXGATE_API_KEYS_FILE": str(keys)}).auth
    assert by_variable.api_keys == (KEY,)
    with pytest.raises(OSError):
        load_config({"api_keys_file": str(tmp_path / "missing")}, {})


def test_no_auth_must_be_a_boolean_and_auth_is_never_given_whole() -> None:
    assert load_config({"no_auth": True}, {}).auth.allow_no_auth
    with pytest.raises(TypeError, match="no_auth must be true or false, got 'false'"):
        load_config({"no_auth": "false"}, {})  # a string from a config file opens nothing
    from gateway.access.keys import AuthConfig

    with pytest.raises(ValueError, match="auth is built from api_keys_file"):
        load_config({"auth": AuthConfig()}, {})


def test_the_port_comes_from_the_option_then_port_then_its_variable() -> None:
    assert load_config(None, {"PORT": "5000", "VOXGATE_PORT": "9000"}).port == 5000
    assert load_config({"port": 7000}, {"PORT": "5000"}).port == 7000
    assert load_config(None, {"VOXGATE_PORT": "9000"}).port == 9000
