"""Speech backends, created by name.

Each backend module is imported only when asked for, so a CPU install never
imports torch (cosyvoice) and a GPU install pays nothing for piper.
"""

from __future__ import annotations

from typing import Any

from engine.backend import Backend
from engine.options import config_from_options

BACKEND_NAMES = ("piper", "cosyvoice")


def create_backend(name: str, **options: Any) -> Backend:
    """A backend by name, its config built from `options` (not loaded yet: call `load()`)."""
    if name == "piper":
        from engine.backends.piper.backend import PiperBackend
        from engine.backends.piper.config import PiperBackendConfig

        return PiperBackend(config_from_options(PiperBackendConfig, "piper", options,
                                                "VOXGATE_PIPER_"))
    if name == "cosyvoice":  # imports torch: only when asked for
        from engine.backends.cosyvoice.backend import CosyVoiceBackend
        from engine.backends.cosyvoice.config import CosyVoiceBackendConfig

        return CosyVoiceBackend(CosyVoiceBackendConfig.from_options(options))
    expected = ", ".join(BACKEND_NAMES)
    raise ValueError(f"unknown backend {name!r}; expected one of: {expected}")
