"""The voice registry's store: registered voices in SQLite, checksummed.

This module owns the file and the access to it: `VoiceStore` opens it and reads
and writes its rows (quotas, the disk reserve, deletes on a full disk), and
`VoiceRegistry` is its async face. What a row is - the schema, its migrations,
`VoiceRecord`, the checksums and the errors - lives in `registry_schema.py`;
its names stay importable from here.

One database file (`<data_dir>/voices.sqlite3`) holds three tables:

- `voices`: one row per registered voice: its metadata, the reference audio
  exactly as uploaded, and its transcript. This is the source of truth.
- `voice_features`: the prompt features a backend computed from that audio,
  keyed by (voice, backend, features version). They are derived data: stored
  so that a restart recomputes nothing, recomputed from the audio when the
  backend or its model changes.
- `retired_ids`: each deleted voice's id and owner. Sockets on any replica may
  still speak with a deleted voice, so its id stays its owner's: `insert`
  refuses it to anyone else (`VoiceExistsError`, as for a registered id) in
  the same transaction that writes, which every replica sharing the file
  obeys. The owner registering it again takes it back.

Every row carries a SHA-256 over all its other columns (blobs included), so a
corrupt or tampered record is detected on read and reported, never served.
SQLite's transactions already make a half-written row impossible; the
checksum covers what they cannot (a damaged page, a hand edit, a foreign
writer). The schema version lives in `PRAGMA user_version`; version 2 added
`owner`, the tenant (a hash of the API key, never the key) that registered a
voice ("" for the operator's voices: assets, and uploads from before tenancy).

Reference recordings are biometric data: the data directory is made 0700 and
the database file 0600. Writes run with `synchronous=FULL`, so an answered
registration survives a power loss. A file that is not a readable database is
moved aside (`voices.sqlite3.damaged-<time>`) by `VoiceRegistry.open`, which
starts an empty one and reports the damage (`damaged`) instead of refusing to
start. Quotas (`Quota`) are checked inside the writing transaction, so replicas
sharing the file cannot overrun them together; a reserve file keeps room for a
DELETE when the disk is full (`space.py`).

Concurrency: `VoiceStore` is synchronous and owns one connection; the async
`VoiceRegistry` runs every call on one dedicated thread, so calls from the
event loop never block it and never interleave. WAL mode and a busy timeout
let several processes share one file (replicas on one host); each sees the
others' commits through `data_version()` (SQLite's `PRAGMA data_version`), which
`VoiceService.sync` polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from gateway.voices.schema import (
    SCHEMA_VERSION,
    SQLITE_CORRUPT,
    SQLITE_NOTADB,
    VOICE_COLUMNS,
    CorruptRecordError,
    DamagedStoreError,
    RegistryError,
    StoredFeatures,
    VoiceExistsError,
    VoiceRecord,
    digest,
    migrate,
    source_digest,
    transaction,
)
from gateway.voices.space import (
    DEFAULT_RESERVE_BYTES,
    RESERVE_NAME,
    Quota,
    QuotaExceededError,
    SpaceReserve,
    StoreFullError,
    is_disk_full,
    over_quota,
    private_dir,
)

log = logging.getLogger("voxgate.gateway")

DB_NAME = "voices.sqlite3"
#: how long opening a new store waits out other processes setting it up at the same moment
SETUP_WAIT_S = 5.0
T = TypeVar("T")


class VoiceStore:
    """Synchronous access to the database; use it from one thread (VoiceRegistry does)."""

    def __init__(self, path: Path, *, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> None:
        self.path = Path(path)
        try:
            private_dir(self.path.parent)
            # created 0600 before SQLite opens it; the -wal and -shm files take its mode
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            os.chmod(self.path, 0o600)
            self.reserve = SpaceReserve(self.path.parent / RESERVE_NAME, reserve_bytes)
            self._db = sqlite3.connect(str(self.path), timeout=5.0, isolation_level=None,
                                       check_same_thread=False)
        except OSError as exc:
            raise RegistryError(
                f"cannot create the voice store at {str(self.path)!r}: {exc}") from exc
        try:
            self._set_up()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
            kind = DamagedStoreError if code in (SQLITE_CORRUPT, SQLITE_NOTADB) else RegistryError
            raise kind(f"voice store {str(self.path)!r} is unreadable ({exc}); "
                       "move it aside to start with an empty registry") from exc
        self.reserve.ensure()

    def _set_up(self) -> None:
        """WAL, the pragmas, the schema. Processes that open a new file together (the workers
        of `--workers`, Ray replicas) can meet SQLite's "database is locked" at the switch to
        WAL, which its busy timeout does not wait out: the setup is tried again for a while."""
        give_up_at = time.monotonic() + SETUP_WAIT_S
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA foreign_keys=ON")
                # an answered registration survives power loss
                self._db.execute("PRAGMA synchronous=FULL")
                migrate(self._db, self.path)
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= give_up_at:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self._db.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def data_version(self) -> int:
        """Changes when another connection (another replica) commits; not on our own commits."""
        return int(self._db.execute("PRAGMA data_version").fetchone()[0])

    # -- voices -------------------------------------------------------------

    def insert(self, record: VoiceRecord, features: tuple[str, str, bytes | None] | None = None,
               *, replace_existing: bool = False, quota: Quota | None = None) -> None:
        """Store a voice (and its features for (backend, version)) in one transaction.

        Raises VoiceExistsError, QuotaExceededError, or StoreFullError when the disk
        lacks room for it beyond the reserve kept for deletes.
        """
        self.reserve.check_room(len(record.audio) + len(features[2] or b"") if features
                                else len(record.audio))
        with transaction(self._db):
            if replace_existing:
                self._db.execute("DELETE FROM voices WHERE voice_id = ?", (record.voice_id,))
            retired = self._retired_owner(record.voice_id)
            if retired is not None and retired != record.owner:
                raise VoiceExistsError(f"voice {record.voice_id!r} is registered already")
            self._db.execute("DELETE FROM retired_ids WHERE voice_id = ?", (record.voice_id,))
            if quota is not None:
                self._check_quota(record, quota)
            try:
                self._db.execute(
                    f"INSERT INTO voices ({VOICE_COLUMNS}, checksum) VALUES "
                    "(?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (record.voice_id, record.name, record.language, record.transcript, record.audio,
                     record.audio_format, record.sample_rate, record.duration_s, record.base_voice,
                     record.source, record.source_digest, record.created_at, record.owner,
                     record.checksum()))
            except sqlite3.IntegrityError:
                raise VoiceExistsError(f"voice {record.voice_id!r} is registered already") from None
            if features is not None:
                self._put_features(record.voice_id, *features)

    def _check_quota(self, record: VoiceRecord, quota: Quota) -> None:
        size = len(record.audio)
        count, used = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(audio)), 0) FROM "
                                       "voices WHERE owner = ?", (record.owner,)).fetchone()
        if over_quota(quota.max_voices_per_owner, count, 1):
            raise QuotaExceededError(f"this key has {count} voices registered; the limit is "
                                     f"{quota.max_voices_per_owner}: delete one first")
        if over_quota(quota.max_bytes_per_owner, used, size):
            raise QuotaExceededError(f"this key's voices hold {used} reference bytes; {size} more "
                                     f"would pass its limit of {quota.max_bytes_per_owner}: delete "
                                     "one first")
        count, used = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(audio)), 0) "
                                       "FROM voices").fetchone()
        if over_quota(quota.max_voices, count, 1) or over_quota(quota.max_bytes, used, size):
            raise QuotaExceededError(f"the server holds {count} voices ({used} bytes), its limit "
                                     f"({quota.max_voices} voices, {quota.max_bytes} bytes); "
                                     "try again after voices are deleted")

    def get(self, voice_id: str) -> VoiceRecord | None:
        """A voice by id, None when absent; raises CorruptRecordError when it fails its checksum."""
        row = self._db.execute(f"SELECT {VOICE_COLUMNS}, checksum FROM voices WHERE voice_id = ?",
                               (voice_id,)).fetchone()
        return None if row is None else self._record(row)

    def load_all(self) -> tuple[list[VoiceRecord], dict[str, str]]:
        """Every intact voice, and {voice_id: problem} for the corrupt ones."""
        records: list[VoiceRecord] = []
        corrupt: dict[str, str] = {}
        for row in self._db.execute(f"SELECT {VOICE_COLUMNS}, checksum FROM voices ORDER BY "
                                    "created_at"):
            try:
                records.append(self._record(row))
            except CorruptRecordError as exc:
                corrupt[str(row[0])] = str(exc)
        return records, corrupt

    def owners(self) -> dict[str, str]:
        """{voice_id: owner} as stored, unchecked: whom a corrupt record is shown to."""
        return {str(r[0]): str(r[1])
                for r in self._db.execute("SELECT voice_id, owner FROM voices")}

    def checksums(self) -> dict[str, str]:
        """{voice_id: stored checksum}: what changed since the last look, without the audio."""
        return {str(r[0]): str(r[1])
                for r in self._db.execute("SELECT voice_id, checksum FROM voices")}

    def claimant(self, voice_id: str) -> str | None:
        """Whose the id is: the owner of its voice or of its retired id; None when it is free."""
        row = self._db.execute("SELECT owner FROM voices WHERE voice_id = ?",
                               (voice_id,)).fetchone()
        return str(row[0]) if row is not None else self._retired_owner(voice_id)

    def _retired_owner(self, voice_id: str) -> str | None:
        row = self._db.execute("SELECT owner FROM retired_ids WHERE voice_id = ?",
                               (voice_id,)).fetchone()
        return None if row is None else str(row[0])

    def delete(self, voice_id: str) -> bool:
        """Remove a voice and its features, keeping its id for its owner; False when there was none.

        On a full disk the reserve file is given up and the delete tried again, so
        that freeing space through the API always works.
        """
        try:
            return self._delete(voice_id)
        except (sqlite3.OperationalError, OSError) as exc:
            if not is_disk_full(exc) or not self.reserve.release():
                raise
            deleted = self._delete(voice_id)
        with contextlib.suppress(sqlite3.Error):  # empty the WAL: its pages back to the disk
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return deleted

    def _delete(self, voice_id: str) -> bool:
        with transaction(self._db):
            row = self._db.execute("SELECT owner FROM voices WHERE voice_id = ?",
                                   (voice_id,)).fetchone()
            if row is None:
                return False
            self._db.execute("DELETE FROM voices WHERE voice_id = ?", (voice_id,))
            self._db.execute("INSERT OR REPLACE INTO retired_ids (voice_id, owner, retired_at) "
                             "VALUES (?,?,?)", (voice_id, str(row[0]), time.time()))
        return True

    @staticmethod
    def _record(row: tuple[Any, ...]) -> VoiceRecord:
        try:
            record = VoiceRecord(str(row[0]), row[1], row[2], row[3], bytes(row[4]), row[5],
                                 int(row[6]), float(row[7]), row[8], row[9], row[10],
                                 float(row[11]), str(row[12]))
            is_intact = record.checksum() == row[13]
        except (TypeError, ValueError) as exc:
            raise CorruptRecordError(f"voice {row[0]!r} has a malformed column: {exc}") from None
        if not is_intact:
            raise CorruptRecordError(f"voice {row[0]!r} fails its checksum: the stored record "
                                     "is damaged; delete it and register it again")
        return record

    # -- features -----------------------------------------------------------

    def put_features(self, voice_id: str, backend: str, version: str,
                     features: bytes | None) -> None:
        with transaction(self._db):
            self._put_features(voice_id, backend, version, features)

    def _put_features(self, voice_id: str, backend: str, version: str,
                      features: bytes | None) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO voice_features (voice_id, backend, version, features, "
            "checksum) VALUES (?,?,?,?,?)",
            (voice_id, backend, version, features, digest(voice_id, backend, version, features)))

    def get_features(self, voice_id: str, backend: str, version: str) -> StoredFeatures | None:
        """Stored features, None when absent; raises CorruptRecordError when damaged."""
        row = self._db.execute(
            "SELECT features, checksum FROM voice_features WHERE voice_id=? AND backend=? AND "
            "version=?",
            (voice_id, backend, version)).fetchone()
        if row is None:
            return None
        features = None if row[0] is None else bytes(row[0])
        if digest(voice_id, backend, version, features) != row[1]:
            raise CorruptRecordError(f"the {backend} features of voice {voice_id!r} fail their "
                                     "checksum")
        return StoredFeatures(features)


class VoiceRegistry:
    """The store behind an async face: every call runs on one dedicated thread.

    `damaged` is set when the file was not a readable database and was moved aside.
    """

    def __init__(self, data_dir: Path, *, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> None:
        self.path = Path(data_dir) / DB_NAME
        self.reserve_bytes = reserve_bytes
        self.damaged: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voxgate-registry")
        self._store: VoiceStore | None = None

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    @property
    def store(self) -> VoiceStore:
        if self._store is None:
            raise RegistryError("the voice registry is not open")
        return self._store

    async def open(self) -> None:
        self._store = await self._call(self._open)

    def _open(self) -> VoiceStore:
        try:
            return VoiceStore(self.path, reserve_bytes=self.reserve_bytes)
        except DamagedStoreError as exc:
            aside = self.path.with_name(
                f"{self.path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
            for suffix in ("", "-wal", "-shm"):  # the journal belongs to the damaged file
                with contextlib.suppress(FileNotFoundError):
                    os.replace(f"{self.path}{suffix}", f"{aside}{suffix}")
            self.damaged = (f"the voice store was unreadable ({exc.__cause__}); it was moved to "
                            f"{aside.name} and an empty one started: its voices are not served")
            log.error("voice registry degraded: %s", self.damaged)
            return VoiceStore(self.path, reserve_bytes=self.reserve_bytes)

    async def close(self) -> None:
        if self._store is not None:
            await self._call(self._store.close)
            self._store = None
        self._executor.shutdown(wait=True)

    async def insert(self, record: VoiceRecord,
                     features: tuple[str, str, bytes | None] | None = None,
                     *, replace_existing: bool = False, quota: Quota | None = None) -> None:
        await self._call(self.store.insert, record, features, replace_existing=replace_existing,
                         quota=quota)

    async def get(self, voice_id: str) -> VoiceRecord | None:
        return await self._call(self.store.get, voice_id)

    async def load_all(self) -> tuple[list[VoiceRecord], dict[str, str]]:
        return await self._call(self.store.load_all)

    async def owners(self) -> dict[str, str]:
        return await self._call(self.store.owners)

    async def checksums(self) -> dict[str, str]:
        return await self._call(self.store.checksums)

    async def data_version(self) -> int:
        return await self._call(self.store.data_version)

    async def delete(self, voice_id: str) -> bool:
        return await self._call(self.store.delete, voice_id)

    async def claimant(self, voice_id: str) -> str | None:
        return await self._call(self.store.claimant, voice_id)

    async def get_features(self, voice_id: str, backend: str,
                           version: str) -> StoredFeatures | None:
        return await self._call(self.store.get_features, voice_id, backend, version)

    async def put_features(self, voice_id: str, backend: str, version: str,
                           features: bytes | None) -> None:
        await self._call(self.store.put_features, voice_id, backend, version, features)


__all__ = [
    "SCHEMA_VERSION",
    "CorruptRecordError",
    "DamagedStoreError",
    "Quota",
    "QuotaExceededError",
    "RegistryError",
    "StoreFullError",
    "StoredFeatures",
    "VoiceExistsError",
    "VoiceRecord",
    "VoiceRegistry",
    "VoiceStore",
    "source_digest",
]
