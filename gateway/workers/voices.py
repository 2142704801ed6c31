"""The engine process's one voice table, shared by every gateway worker.

Each worker runs its own `VoiceService` over the one SQLite store in data_dir
(gateway/voices/sync.py keeps the workers' catalogs in step through its
data_version), so each worker adds every stored voice at its start, and a
voice registered through one worker is added again by the others as they sync.
The engine holds one copy. `SharedVoices` counts, per voice, the workers that
added it, and lets the engine forget a voice only when the last of them removes
it: a worker whose sockets no longer hold a deleted voice must not take it from
the sockets of another that still do. The verbs keep their meaning otherwise:

- `add`: a voice already listed with the same features and metadata is only
  counted for the worker; anything else goes to the engine (which replaces a
  voice of that id, for everyone).
- `retire`: the first worker to retire a voice unlists it in the engine (its
  holders keep speaking with it); the later ones find it retired.
- `remove`: the worker stops counting; the engine forgets the voice when no
  worker counts it. A worker that goes away stops counting every voice, and a
  retired voice nobody counts is forgotten.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import msgpack

from engine.client import EngineClient
from engine.errors import UnknownVoiceError
from engine.types import VoiceInfo

log = logging.getLogger("voxgate.engine")


def _fingerprint(features: bytes | None, meta: dict[str, Any]) -> str:
    digest = hashlib.sha256(features or b"")
    digest.update(msgpack.packb(meta, use_bin_type=True))
    return digest.hexdigest()


class SharedVoices:
    """Registered voices by the workers that added them (see the module doc)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self._holders: dict[str, set[int]] = {}  # voice id -> workers that added it
        self._fingerprints: dict[str, str] = {}
        self._retired: set[str] = set()

    def num_holders(self, voice_id: str) -> int:
        return len(self._holders.get(voice_id, ()))

    async def add(self, worker: int, voice_id: str, features: bytes | None,
                  meta: dict[str, Any]) -> VoiceInfo:
        fingerprint = _fingerprint(features, meta)
        listed = next((v for v in self.engine.voices if v.voice_id == voice_id), None)
        if listed is None or self._fingerprints.get(voice_id) != fingerprint:
            listed = await self.engine.add_voice(voice_id, features, meta)
            self._fingerprints[voice_id] = fingerprint
            self._retired.discard(voice_id)
        self._holders.setdefault(voice_id, set()).add(worker)
        return listed

    async def retire(self, worker: int, voice_id: str) -> None:
        if voice_id in self._retired:
            return
        await self.engine.retire_voice(voice_id)
        self._retired.add(voice_id)

    async def remove(self, worker: int, voice_id: str) -> None:
        holders = self._holders.get(voice_id)
        if holders is None:  # never added through a worker: the engine's own answer
            await self.engine.remove_voice(voice_id)
            return
        holders.discard(worker)
        if not holders:
            await self._forget(voice_id)

    async def drop_worker(self, worker: int) -> None:
        """A worker went away: it counts no voice; retired voices nobody counts are forgotten."""
        for voice_id, holders in list(self._holders.items()):
            holders.discard(worker)
            if not holders and voice_id in self._retired:
                try:
                    await self._forget(voice_id)
                except UnknownVoiceError:
                    log.warning("voice %r was gone from the engine already", voice_id)

    async def _forget(self, voice_id: str) -> None:
        self._holders.pop(voice_id, None)
        self._fingerprints.pop(voice_id, None)
        self._retired.discard(voice_id)
        await self.engine.remove_voice(voice_id)
