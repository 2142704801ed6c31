"""Voice policy: what may be registered, by whom it is seen, and the voice service's settings.

Built-in names are reserved for everyone: installed voices, OpenAI's voice
names (which OpenAI clients send and the default voice answers, so a tenant
registering `alloy` would speak for everyone's OpenAI client), and piper's
model names (aliases of installed voices, or models yet to be installed).
Registered voices belong to an owner, the tenant that registered them, or ""
for the operator's (assets, and uploads from before tenancy): everyone sees
the operator's; a tenant sees its own; an admin sees and deletes all.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.options import config_from_options
from gateway.access.keys import Principal
from gateway.voices.space import DEFAULT_RESERVE_BYTES, Quota
from gateway.voices.upload import UploadLimits

#: OpenAI's voice names: requests for them speak the default voice (gateway/http/speech.py), so
#: nobody may register one and take over what OpenAI clients hear
OPENAI_VOICE_NAMES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx",
                                "sage", "shimmer", "verse", "marin", "cedar"})
#: piper's model names (en_US-joe-medium): aliases of installed voices, or models yet to install
PIPER_NAME_RE = re.compile(r"[a-z]{2,3}_[A-Z]{2}-.+-(x_low|low|medium|high)", re.IGNORECASE)


@dataclass(slots=True)
class VoiceConfig:
    """Where voices live and what an upload may be (VOXGATE_VOICE_ASSETS sets `assets_dir`)."""

    data_dir: Path
    assets_dir: Path | None = None  # None: <data_dir>/assets, when it exists
    default_voice: str = "joe"  # speaks for registered voices on backends that cannot clone
    limits: UploadLimits = field(default_factory=UploadLimits)
    quota: Quota = field(default_factory=Quota)
    max_concurrent_uploads: int = 2  # decode + features at once, bodies read first; more get 429
    #: the whole upload body must arrive within this (408 after): a stalled one holds nothing long
    upload_timeout_s: float = 60.0
    sync_interval_s: float = 2.0  # how often other replicas' changes are picked up (0: never)
    reserve_bytes: int = DEFAULT_RESERVE_BYTES  # kept free on the store's disk for deletes

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.assets_dir is not None:
            self.assets_dir = Path(self.assets_dir)
        if self.max_concurrent_uploads < 1:
            raise ValueError("max_concurrent_uploads must be >= 1, got "
                             f"{self.max_concurrent_uploads}")
        if self.upload_timeout_s <= 0:
            raise ValueError(f"upload_timeout_s must be > 0, got {self.upload_timeout_s}")
        if self.sync_interval_s < 0:
            raise ValueError(f"sync_interval_s must be >= 0 (0: never), got {self.sync_interval_s}")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")

    @classmethod
    def from_gateway(cls, config: Any, environ: dict[str, str] | None = None) -> VoiceConfig:
        """VOXGATE_VOICE_ASSETS, VOXGATE_VOICE_<FIELD> (e.g. VOXGATE_VOICE_SYNC_INTERVAL_S) and
        VOXGATE_VOICE_QUOTA_<FIELD> (e.g. VOXGATE_VOICE_QUOTA_MAX_VOICES_PER_OWNER)."""
        env = {k: v for k, v in (os.environ if environ is None else environ).items()
               if k not in ("VOXGATE_VOICE_LIMITS", "VOXGATE_VOICE_QUOTA",
                            "VOXGATE_VOICE_ASSETS_DIR",
                            "VOXGATE_VOICE_DATA_DIR", "VOXGATE_VOICE_DEFAULT_VOICE")}
        assets = getattr(config, "voice_assets", None) or env.get("VOXGATE_VOICE_ASSETS") or None
        quota = config_from_options(Quota, "voice quota", {}, env_prefix="VOXGATE_VOICE_QUOTA_",
                                    environ=env)
        options = {"data_dir": config.data_dir, "assets_dir": Path(assets) if assets else None,
                   "default_voice": config.voice, "quota": quota}
        return config_from_options(cls, "voice", options, env_prefix="VOXGATE_VOICE_", environ=env)


def is_reserved(voice_id: str, installed: Collection[str]) -> bool:
    """A built-in name: an installed voice, one of OpenAI's, or a piper model name (any case)."""
    lowered = voice_id.lower()
    return (lowered in OPENAI_VOICE_NAMES or lowered in {v.lower() for v in installed}
            or PIPER_NAME_RE.fullmatch(voice_id) is not None)


def is_visible(owner: str, principal: Principal) -> bool:
    """Installed voices and the operator's ("") are everyone's; a tenant's, its own and admins'."""
    return principal.is_admin or not owner or owner == principal.tenant


def may_delete(owner: str, principal: Principal) -> bool:
    """A tenant deletes its own voices; the operator's take an admin key."""
    return principal.is_admin or (bool(owner) and owner == principal.tenant)
