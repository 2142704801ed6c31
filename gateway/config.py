"""Gateway configuration: one dataclass, filled from CLI flags and VOXGATE_* variables.

`load_config` is the one way to build it from options and the environment:
`voxgate serve`, every Ray Serve replica and `create_app()` without a config
all call it, so none of them can miss a part of the configuration (keys
included: docs/operations.md, "Auth", and "Keys on Ray Serve").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.options import config_from_options
from gateway.access.keys import AuthConfig, load_keys
from gateway.access.origins import is_loopback
from gateway.stream.options import Limits
from gateway.text.routing import merge_voice_for, normalize_voice_for, parse_voice_for

#: fields with a structure of their own, never read whole from one variable (limits field by
#: field, auth from AUTH_OPTIONS and its variables, voice_for from
#: VOXGATE_VOICE_FOR=zh=NAME,ru=OTHER)
_STRUCTURED = ("limits", "auth", "engine_options", "voice_for")

#: the options `auth` is built from, named as `voxgate serve` names its flags; their variables:
#: VOXGATE_API_KEYS(_FILE), VOXGATE_ADMIN_KEYS(_FILE), VOXGATE_ALLOWED_ORIGINS (no_auth has none)
AUTH_OPTIONS = ("api_keys_file", "admin_keys_file", "allowed_origins", "no_auth")


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "voxgate"


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "piper"
    voice: str = "joe"
    #: language -> the voice for segments the context's voice cannot speak (docs/voices.md,
    #: "Languages"); sessions may override it key by key
    voice_for: dict[str, str] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)
    max_batch_size: int = 0  # 0: the engine's own (piper 8; cosyvoice 256 on a GPU, 8 on a CPU)
    max_contexts: int = 0
    scheduler_policy: str = "edf"
    data_dir: Path = field(default_factory=_default_data_dir)
    limits: Limits = field(default_factory=Limits)
    auth: AuthConfig = field(default_factory=AuthConfig)
    max_sessions: int = 1000
    max_sockets_per_key: int = 200
    #: sockets waiting for a first-message key, in a pool of their own (gateway/access/keyless.py)
    max_keyless_sockets: int = 64
    max_keyless_sockets_per_address: int = 8
    web_dir: Path | None = None
    voice_assets: Path | None = None
    ws_ping_interval_s: float = 20.0
    #: permessage-deflate on the sockets, for clients that offer it; off: audio is Opus, which
    #: it cannot shrink (about 9% of 5-frame messages) for CPU on the event loop that serves
    #: every socket (docs/benchmarks.md, "The process around a GPU, on the CPU")
    ws_per_message_deflate: bool = False
    #: the sockets' audio encoded on a worker thread beside the event loop, in arrival order
    #: (gateway/stream/encoding.py); off by default, encoded on the loop most urgent first: the
    #: thread needs the GIL back after each call into FFmpeg, and first audio under load was
    #: later with it (docs/benchmarks.md, "The process around a GPU, on the CPU"); for more
    #: than a core of gateway work, --workers
    encode_on_thread: bool = False
    shutdown_grace_s: float = 10.0
    #: the part of the engine's talking contexts one key (auth off: one client address) may hold;
    #: 0 is "auto" (`engine_share`): 0.5 where clients are tenants, 1.0 in loopback mode
    max_engine_share: float = 0.0
    #: a connection that has not sent a whole request head after this long is closed
    header_timeout_s: float = 10.0
    #: uvicorn's limit on open connections (0: max_sessions + 256 for HTTP); more get 503
    max_connections: int = 0
    # POST /v1/session-tokens: how long a token may wait for its use
    session_token_ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be within 0-65535, got {self.port}")
        if self.max_batch_size < 0:
            raise ValueError("max_batch_size must be >= 0 (0: the engine's default), got "
                             f"{self.max_batch_size}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.max_sockets_per_key < 1:
            raise ValueError(f"max_sockets_per_key must be >= 1, got {self.max_sockets_per_key}")
        if not 1 <= self.max_keyless_sockets_per_address <= self.max_keyless_sockets:
            raise ValueError("expected 1 <= max_keyless_sockets_per_address <= "
                             f"max_keyless_sockets, got {self.max_keyless_sockets_per_address} and "
                             f"{self.max_keyless_sockets}")
        if self.max_contexts < 0:
            raise ValueError(f"max_contexts must be >= 0 (0: estimate), got {self.max_contexts}")
        if not 0 < self.session_token_ttl_s <= 3600:
            raise ValueError("session_token_ttl_s must be within (0, 3600], got "
                             f"{self.session_token_ttl_s}")
        if not 0.0 <= self.max_engine_share <= 1.0:
            raise ValueError("max_engine_share must be within [0, 1] (0: auto), got "
                             f"{self.max_engine_share}")
        if self.header_timeout_s <= 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if self.max_connections < 0:
            raise ValueError("max_connections must be >= 0 (0: max_sessions + 256), got "
                             f"{self.max_connections}")
        self.data_dir = Path(self.data_dir)
        self.voice_for = merge_voice_for(normalize_voice_for(self.voice_for))

    @property
    def engine_share(self) -> float:
        """The fair share in force (gateway/access/fair_share.py; docs/operations.md, "Fair share").

        Where keys name tenants (auth on), or any address may connect (`--no-auth`
        on a public bind), one owner holds at most half the engine. In loopback mode
        (auth off, bound to loopback) every client is a process of the operator's
        own, one tenant as for voices, and a cap would only halve the capacity of
        the usual set-up: one LLM service driving many sockets from one address.
        """
        if self.max_engine_share:
            return self.max_engine_share
        return 0.5 if self.auth.is_enabled or not is_loopback(self.host) else 1.0


def load_config(options: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """The gateway's whole configuration from `options` over the environment.

    `options` are GatewayConfig fields (None: not given) and AUTH_OPTIONS, as
    `voxgate serve` passes its flags and a Ray Serve app its `gateway` args. The
    environment gives VOXGATE_<FIELD> (e.g. VOXGATE_PORT=9000; $PORT too),
    VOXGATE_LIMIT_<FIELD> for `limits`, VOXGATE_VOICE_FOR, and the keys: options
    win. Strings convert as backend options do (engine/options.py): one
    conversion, one "expected X, got Y" message for a bad value. Raises
    ValueError for a bad value, OSError for a keys file that cannot be read.
    """
    env = dict(os.environ if environ is None else environ)
    given = {k: v for k, v in (options or {}).items() if v is not None}
    if "auth" in given:
        raise ValueError(f"auth is built from {', '.join(AUTH_OPTIONS)}, not given whole")
    auth = _load_auth({k: given.pop(k) for k in AUTH_OPTIONS if k in given}, env)
    voice_for = env.get("VOXGATE_VOICE_FOR", "")
    if "port" not in given and env.get("PORT", "").strip():  # platforms that set $PORT (Procfile)
        given["port"] = env["PORT"]
    for name in _STRUCTURED:  # never read whole from one variable
        env.pop("VOXGATE_" + name.upper(), None)
    limits = config_from_options(Limits, "limit", {}, env_prefix="VOXGATE_LIMIT_", environ=env)
    fields_given = {"limits": limits, "auth": auth, **given}
    if "voice_for" not in fields_given and voice_for.strip():
        fields_given["voice_for"] = parse_voice_for(p for p in voice_for.split(",") if p.strip())
    return config_from_options(GatewayConfig, "gateway", fields_given, env_prefix="VOXGATE_",
                               environ=env)


def _load_auth(options: dict[str, Any], env: Mapping[str, str]) -> AuthConfig:
    no_auth = options.get("no_auth", False)
    if not isinstance(no_auth, bool):
        raise TypeError(f"no_auth must be true or false, got {no_auth!r}")
    origins = options.get("allowed_origins") or env.get("VOXGATE_ALLOWED_ORIGINS", "")
    if isinstance(origins, str):
        origins = origins.split(",")
    return AuthConfig(api_keys=load_keys(env, options.get("api_keys_file")),
                      admin_keys=load_keys(env, options.get("admin_keys_file"),
                                           variable="VOXGATE_ADMIN_KEYS"),
                      allowed_origins=tuple(o.strip() for o in origins if o.strip()),
                      allow_no_auth=no_auth)
