"""The engine's face as the gateway sees it: one protocol, in-process or remote.

`engine.Engine` satisfies `EngineClient` as it is (the gateway runs it in its
own process, `voxgate serve`); `gateway.ray_serve.remote.RemoteEngine`
satisfies it over Ray Serve handles (`voxgate ray-serve`, docs/scaling.md), and
`gateway.workers.client.WorkerEngine` over a Unix socket to the engine process
of `voxgate serve --workers N`. Session, socket, speech and voice code are
typed against this protocol and never learn which one they hold.

What the protocol asks is exactly what the gateway uses: requests (`submit`,
`cancel`), admission (`admit`, `release_context`; both synchronous, because
the sans-I/O session calls them), the voice listing and verbs, readiness, and
the counters /metrics reads (`stats`, and `scheduler` as a read-only view).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engine.types import AudioChunk, RequestId, SynthesisRequest, VoiceInfo

if TYPE_CHECKING:
    from engine.stats import EngineStats


class SchedulerStatsView(Protocol):
    """The scheduler counters /metrics exports."""

    @property
    def num_deadline_misses(self) -> int: ...
    @property
    def num_admitted(self) -> int: ...
    @property
    def num_refused(self) -> int: ...


class SchedulerView(Protocol):
    """What /metrics reads from the scheduler (a sum over replicas when remote)."""

    @property
    def num_queued(self) -> int: ...
    @property
    def num_contexts(self) -> int: ...
    @property
    def stats(self) -> SchedulerStatsView: ...
    def max_contexts(self) -> int: ...


class EngineClient(Protocol):
    """The speech engine as the gateway reaches it (docs/architecture.md, "The engine")."""

    # -- lifecycle and health -------------------------------------------------
    @property
    def is_ready(self) -> bool: ...
    @property
    def is_healthy(self) -> bool: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    # -- what it speaks -------------------------------------------------------
    @property
    def sample_rate(self) -> int: ...
    @property
    def voices(self) -> list[VoiceInfo]: ...
    @property
    def backend_name(self) -> str: ...

    # -- admission (synchronous: the sans-I/O session calls it) --------------
    def admit(self, context_key: str) -> None: ...
    def release_context(self, context_key: str) -> None: ...

    # -- requests -------------------------------------------------------------
    def submit(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]: ...
    def cancel(self, request_id: RequestId) -> None: ...

    # -- registered voices (docs/voices.md) -----------------------------------
    @property
    def can_register_voices(self) -> bool: ...
    @property
    def needs_transcript(self) -> bool: ...
    @property
    def voice_features_version(self) -> str: ...
    async def make_voice_features(self, audio: np.ndarray, sample_rate: int,
                                  transcript: str) -> bytes | None: ...
    async def add_voice(self, voice_id: str, features: bytes | None,
                        meta: dict[str, Any]) -> VoiceInfo: ...
    async def retire_voice(self, voice_id: str) -> None: ...
    async def remove_voice(self, voice_id: str) -> None: ...

    # -- counters for /metrics --------------------------------------------------
    @property
    def stats(self) -> EngineStats: ...
    @property
    def scheduler(self) -> SchedulerView: ...
