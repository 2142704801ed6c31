"""The engine tier: one continuous-batching `Engine` per Serve replica.

`synthesize` streams one request's chunks; the gateway calls it through a
`DeploymentHandle` with `stream=True`. When the caller cancels the call (a
barge-in) Serve cancels this generator, and the engine's own iterator cancels
the request: it leaves the scheduler before the next step.

Admission lives here, per replica: a context is admitted by its first
request (or refused with `busy`), and released by `release`. A gateway that
dies cannot release its contexts, so each gateway renews a lease on the
contexts it holds with every `capacity` poll; contexts of a gateway whose
lease lapsed are released (`LEASE_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from engine.engine import Engine
from engine.errors import EngineBusyError, VoxgateError
from engine.wire import counters_to_wire, info_to_wire
from gateway.app import build_engine
from gateway.config import AUTH_OPTIONS, load_config
from gateway.ray_serve import wire

log = logging.getLogger("voxgate.engine")

#: seconds a gateway's contexts outlive its last capacity poll (it polls every ~0.5 s)
LEASE_S = 15.0


def replica_id() -> str:
    """This replica's unique id (what `routing.PinnedRouter` matches)."""
    from ray import serve

    return str(serve.get_replica_context().replica_id.unique_id)


class EngineReplica:
    """The Serve deployment class of the engine tier (wrapped in `app.build_app`)."""

    async def __init__(self, overrides: dict[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        # the engine serves no client: the gateway-only auth options are not its to read
        self.config = load_config({k: v for k, v in overrides.items() if k not in AUTH_OPTIONS})
        self.engine: Engine = build_engine(self.config)
        self.replica = replica_id()
        self._owners: dict[str, str] = {}  # context key -> gateway id
        self._leases: dict[str, float] = {}  # gateway id -> monotonic time of its last poll
        await self.engine.start()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        log.info("engine replica %s ready", self.replica)

    async def __del__(self) -> None:
        self._sweeper.cancel()
        await self.engine.stop()

    async def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError("the engine loop stopped or its backend keeps failing")

    # -- requests -------------------------------------------------------------
    async def synthesize(self, request: dict[str, Any],
                         replica: str = "") -> AsyncIterator[dict[str, Any]]:
        """One request's audio chunks as wire dicts; an error ends the stream as a wire error."""
        synthesis = wire.request_from_wire(request)
        try:
            self._admit(synthesis.context_key, request["gateway"])
            async for chunk in self.engine.submit(synthesis):
                yield wire.chunk_to_wire(chunk)
        except VoxgateError as exc:
            yield wire.error_to_wire(exc)
        except Exception as exc:
            log.exception("request %s failed", synthesis.request_id)
            yield wire.error_to_wire(exc)

    def _admit(self, key: str, gateway: str) -> None:
        if not key or key in self._owners:
            return
        self.engine.admit(key)  # raises EngineBusyError when full
        self._owners[key] = gateway
        self._leases.setdefault(gateway, time.monotonic())

    async def release(self, context_key: str, replica: str = "") -> None:
        if self._owners.pop(context_key, None) is not None:
            self.engine.release_context(context_key)

    async def admit(self, context_key: str, gateway: str, replica: str = "") -> dict[str, Any]:
        """Reserve a context here now (a gateway may check room before the first request)."""
        try:
            self._admit(context_key, gateway)
        except EngineBusyError as exc:
            return wire.error_to_wire(exc)
        return {"replica": self.replica}

    # -- what the gateways poll -------------------------------------------------
    async def capacity(self, gateway: str = "", held: list[str] | None = None,
                       replica: str = "") -> dict[str, Any]:
        """Room, counters and voices of this replica; renews `gateway`'s lease on `held`."""
        if gateway:
            self._leases[gateway] = time.monotonic()
            for key in set(held or ()) - set(self._owners):
                with contextlib.suppress(EngineBusyError):
                    self._admit(key, gateway)  # re-admitted, e.g. after a lease lapsed
        return {"replica": self.replica, **counters_to_wire(self.engine),
                "voices": [wire.voice_to_wire(v) for v in self.engine.voices]}

    async def info(self, replica: str = "") -> dict[str, Any]:
        return {"replica": self.replica, **info_to_wire(self.engine)}

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 3)
            now = time.monotonic()
            lapsed = {g for g, t in self._leases.items() if now - t > LEASE_S}
            for key, gateway in list(self._owners.items()):
                if gateway in lapsed:
                    log.warning("context %s released: gateway %s stopped renewing it", key, gateway)
                    await self.release(key)
            for gateway in lapsed:
                self._leases.pop(gateway, None)

    # -- voices: the engine's verbs, run on this replica --------------------------
    async def make_voice_features(self, audio: bytes, sample_rate: int, transcript: str,
                                  replica: str = "") -> bytes | None:
        pcm = np.frombuffer(audio, dtype=np.float32)
        return await self.engine.make_voice_features(pcm, sample_rate, transcript)

    async def add_voice(self, voice_id: str, features: bytes | None, meta: dict[str, Any],
                        replica: str = "") -> dict[str, Any]:
        try:
            return wire.voice_to_wire(await self.engine.add_voice(voice_id, features, meta))
        except (VoxgateError, ValueError) as exc:
            return {"error": getattr(exc, "code", "bad_voice"), "message": str(exc)}

    async def retire_voice(self, voice_id: str, replica: str = "") -> dict[str, Any]:
        try:
            await self.engine.retire_voice(voice_id)
        except VoxgateError as exc:
            return wire.error_to_wire(exc)
        return {}

    async def remove_voice(self, voice_id: str, replica: str = "") -> dict[str, Any]:
        try:
            await self.engine.remove_voice(voice_id)
        except VoxgateError as exc:
            return wire.error_to_wire(exc)
        return {}
