"""Replicas sharing one voice store: picking up what the others registered or deleted.

Several gateway processes may share one `voices.sqlite3` (replicas on one host).
`ReplicaSync` owns keeping this process's voices in step with theirs: `sync()`
notices another process's commit through SQLite's data_version (one PRAGMA when
nothing changed), compares a checksum per id against the ones it last saw, and
forgets, reloads or loads each voice that differs; it runs every
`sync_interval_s` while the service is started (docs/voices.md, "Replicas").
`VoiceService` builds on it and supplies the state and the loading and
forgetting it uses, under the service's one lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from typing import Any

from gateway.voices.catalog import VoiceCatalog
from gateway.voices.policy import VoiceConfig
from gateway.voices.store import CorruptRecordError, VoiceRecord, VoiceRegistry

log = logging.getLogger("voxgate.gateway")


class ReplicaSync:
    """The replica half of `VoiceService`: its state is the service's (declared here)."""

    config: VoiceConfig
    registry: VoiceRegistry
    catalog: VoiceCatalog
    registered: dict[str, dict[str, Any]]
    unavailable: dict[str, tuple[str, str]]
    owners: dict[str, str]
    _checksums: dict[str, str]
    _lock: asyncio.Lock
    _data_version: int | None = None
    _sync_task: asyncio.Task[None] | None = None

    async def _load(self, record: VoiceRecord) -> None:
        raise NotImplementedError  # VoiceService's: into the engine, or into `unavailable`

    async def _forget(self, voice_id: str) -> None:
        raise NotImplementedError  # VoiceService's: out of the engine and the catalog

    async def _start_sync(self) -> None:
        """Take the store's state as seen, then sync in the background when configured."""
        self._checksums = await self.registry.checksums()
        self._data_version = await self.registry.data_version()
        if self.config.sync_interval_s > 0:
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_loop())

    async def _stop_sync(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync_task

    async def sync(self) -> bool:
        """Pick up voices other processes sharing the store registered or deleted since the
        last call; True when anything changed. Cheap when nothing did (one PRAGMA). Before
        `start` has taken the store's state as seen (it loads the store itself), nothing."""
        if self.registry._store is None or self._data_version is None:
            return False
        version = await self.registry.data_version()
        if version == self._data_version:
            return False
        changed = False
        async with self._lock:
            stored = await self.registry.checksums()
            for voice_id in [v for v in self._checksums if v not in stored]:
                if voice_id in self.registered or voice_id in self.unavailable:
                    await self._forget(voice_id)
                    changed = True
                    log.info("voice %r was deleted by another replica", voice_id)
            for voice_id, checksum in stored.items():
                if self._checksums.get(voice_id) == checksum:
                    continue
                if voice_id in self.registered or voice_id in self.unavailable:
                    await self._forget(voice_id)  # replaced elsewhere: load the new record
                self._checksums[voice_id] = checksum
                changed |= await self._load_from_store(voice_id)
        # seen only once picked up: a sync that fails halfway is tried again, not skipped
        self._data_version = version
        return changed

    async def sync_before_write(self) -> None:
        """Catch up before checking an id, so a replica never refuses its owner an id that
        another replica has just freed, nor misses one just taken (one PRAGMA when nothing
        changed). A store that cannot be read now leaves the check to the insert's own."""
        try:
            await self.sync()
        except (sqlite3.Error, OSError):
            log.warning("voice registry sync before a write failed; checking against this "
                        "replica's last view", exc_info=True)

    async def _load_from_store(self, voice_id: str) -> bool:
        try:
            record = await self.registry.get(voice_id)
        except CorruptRecordError as exc:
            self.unavailable[voice_id] = ("corrupt_voice", str(exc))
            self.owners[voice_id] = (await self.registry.owners()).get(voice_id, "")
            return True
        if record is None:
            return False
        await self._load(record)
        if voice_id in self.registered:
            self.catalog.add(voice_id, self.owners.get(voice_id, ""))
            log.info("voice %r was registered by another replica", voice_id)
        return True

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sync_interval_s)
            try:
                await self.sync()
            except Exception:  # a locked or vanished store: try again next time
                log.exception("voice registry sync failed")
