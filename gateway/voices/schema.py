"""The voice registry's on-disk format: its schema, migrations, records and checksums.

This module owns what a row of `voices.sqlite3` is: the two tables (`voices`, the
source of truth, and `voice_features`, derived data), the schema version kept in
`PRAGMA user_version` and the migrations up to it (version 2 added `owner`,
version 3 `retired_ids`), the
`VoiceRecord` and `StoredFeatures` a row reads as, the typed SHA-256 that every
row carries over its other columns, and the registry's errors. `registry.py`
reads and writes these rows (`VoiceStore`) and puts them behind an async face
(`VoiceRegistry`); nothing here opens a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import VoxgateError

SCHEMA_VERSION = 3

SCHEMA = """
CREATE TABLE voices (
    voice_id      TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    language      TEXT NOT NULL,
    transcript    TEXT NOT NULL,
    audio         BLOB NOT NULL,
    audio_format  TEXT NOT NULL,
    sample_rate   INTEGER NOT NULL,
    duration_s    REAL NOT NULL,
    base_voice    TEXT,
    source        TEXT NOT NULL,
    source_digest TEXT NOT NULL,
    created_at    REAL NOT NULL,
    checksum      TEXT NOT NULL,
    owner         TEXT NOT NULL DEFAULT ''
);
CREATE TABLE voice_features (
    voice_id  TEXT NOT NULL REFERENCES voices(voice_id) ON DELETE CASCADE,
    backend   TEXT NOT NULL,
    version   TEXT NOT NULL,
    features  BLOB,
    checksum  TEXT NOT NULL,
    PRIMARY KEY (voice_id, backend, version)
);
"""
#: a deleted voice's id, kept for its owner: sockets anywhere may still hold the voice, so the id
#: never passes to another tenant (docs/voices.md, "Deleting a voice in use")
RETIRED_IDS_TABLE = """
CREATE TABLE retired_ids (
    voice_id   TEXT PRIMARY KEY,
    owner      TEXT NOT NULL,
    retired_at REAL NOT NULL
)"""


class RegistryError(VoxgateError):
    """The store cannot be opened or used (unreadable file, newer schema)."""

    code = "registry_unavailable"
    status = 503


class VoiceExistsError(RegistryError):
    """A voice with that id is registered already."""

    code = "voice_exists"
    status = 409


class DamagedStoreError(RegistryError):
    """The file is not a readable SQLite database (a torn copy, a damaged disk, garbage)."""


class CorruptRecordError(RegistryError):
    """A stored record fails its checksum; it is reported, never served."""

    code = "corrupt_voice"
    status = 409


def digest(*parts: str | bytes | float | None) -> str:
    """SHA-256 over typed, length-prefixed parts (no two field lists hash alike)."""
    h = hashlib.sha256()
    for part in parts:
        if part is None:
            h.update(b"N")
            continue
        if isinstance(part, str):
            tag, data = b"S", part.encode("utf-8")
        elif isinstance(part, bytes):
            tag, data = b"B", part
        elif isinstance(part, float):
            tag, data = b"F", struct.pack("<d", part)
        else:
            tag, data = b"I", str(int(part)).encode()
        h.update(tag + struct.pack("<Q", len(data)) + data)
    return h.hexdigest()


def source_digest(audio: bytes, transcript: str) -> str:
    """What makes two registrations the same voice (assets are re-registered only on change)."""
    return digest(audio, transcript)


@dataclass(slots=True, frozen=True)
class VoiceRecord:
    """A registered voice as stored: metadata, reference audio (as uploaded), transcript."""

    voice_id: str
    name: str
    language: str
    transcript: str
    audio: bytes
    audio_format: str
    sample_rate: int
    duration_s: float
    base_voice: str | None = None
    source: str = "upload"  # "upload" (POST /v1/voices) or "assets" (the assets folder)
    source_digest: str = ""
    created_at: float = field(default_factory=time.time)
    owner: str = ""  # the registering tenant (a key hash); "": the operator's

    def checksum(self) -> str:
        # `owner` joins the digest only when set: version-1 rows (no owner) keep their checksums
        owner = (self.owner,) if self.owner else ()
        return digest(self.voice_id, self.name, self.language, self.transcript, self.audio,
                       self.audio_format, self.sample_rate, float(self.duration_s),
                       self.base_voice, self.source, self.source_digest, float(self.created_at),
                       *owner)

    def summary(self) -> dict[str, Any]:
        """The record without its audio, as JSON-ready values."""
        return {"id": self.voice_id, "name": self.name, "language": self.language,
                "transcript": self.transcript, "base_voice": self.base_voice,
                "source": self.source, "created_at": self.created_at,
                "reference": {"format": self.audio_format, "sample_rate": self.sample_rate,
                              "duration_s": round(self.duration_s, 3), "bytes": len(self.audio)}}


@dataclass(slots=True, frozen=True)
class StoredFeatures:
    features: bytes | None


VOICE_COLUMNS = ("voice_id, name, language, transcript, audio, audio_format, sample_rate, "
                 "duration_s, base_voice, source, source_digest, created_at, owner")
#: SQLite's primary result codes for a file that is not (or no longer) a database
SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    # IMMEDIATE takes the write lock up front: two writers queue instead of deadlocking.
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Bring the database at `path` to SCHEMA_VERSION (creating it when empty)."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise RegistryError(f"voice store {str(path)!r} has schema version {version}; "
                            f"this voxgate reads up to {SCHEMA_VERSION}: upgrade voxgate")
    if version == SCHEMA_VERSION:
        return
    with transaction(db):
        # Read again under the write lock: replicas sharing the file may start together.
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        if version == 0:
            for statement in (SCHEMA + RETIRED_IDS_TABLE).split(";"):
                if statement.strip():
                    db.execute(statement)
        if version == 1:  # tenancy: who registered each voice ("" for those before it)
            db.execute("ALTER TABLE voices ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
        if version in (1, 2):  # ids of deleted voices, kept for their owners
            db.execute(RETIRED_IDS_TABLE.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS"))
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
