"""A real voxgate app whose piper backend fails on purpose for marked text.

Run by the hardening tests as `uvicorn tests.support.apps.faulty:create_app --factory`:
a fault cannot be provoked in the real model from the outside, so this wraps
the real backend and raises inside `step` for any segment containing "FAULT".
"""

from __future__ import annotations

from engine.backend import BackendRequest, StepResult
from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.engine import Engine, EngineConfig
from gateway.app import create_app as create_voxgate_app
from gateway.config import load_config


class FaultyPiper(PiperBackend):
    def step(self, batch: list[BackendRequest]) -> list[StepResult]:
        if any("FAULT" in item.request.text for item in batch):
            raise RuntimeError("injected backend fault")
        return super().step(batch)


def create_app():  # type: ignore[no-untyped-def]
    config = load_config()
    return create_voxgate_app(config,
                              engine=Engine(FaultyPiper(PiperBackendConfig()), EngineConfig()))
