"""Disk space and privacy for the voice store's directory.

Reference recordings are biometric data, so the directory holding them is
private to the server's user (0700). A full disk must not leave the registry
stuck: deleting a voice writes too (SQLite's WAL), so the store keeps a reserve
file of `DEFAULT_RESERVE_BYTES` beside it and gives it up when a delete meets a
full disk; registrations are refused while free space is short, before any
write, so they never eat into what a delete needs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import stat
from dataclasses import dataclass
from pathlib import Path

from engine.errors import VoxgateError

log = logging.getLogger("voxgate.gateway")

DEFAULT_RESERVE_BYTES = 4 * 1024 * 1024
RESERVE_NAME = ".voxgate-space-reserve"
#: SQLite result codes a full disk shows up as (SQLITE_FULL; SQLITE_IOERR_WRITE and its kin)
_SQLITE_FULL, _SQLITE_IOERR = 13, 10


class StoreFullError(VoxgateError):
    """The disk under the voice store has no room for another registration."""

    code = "insufficient_storage"
    status = 507


class QuotaExceededError(VoxgateError):
    """A registration over a voice-count or byte quota (the tenant's or the server's)."""

    code = "quota_exceeded"
    status = 403


@dataclass(slots=True)
class Quota:
    """Most voices and reference bytes per owner (tenant) and in all (0: no limit)."""

    max_voices_per_owner: int = 50
    max_bytes_per_owner: int = 100 * 1024 * 1024
    max_voices: int = 2000
    max_bytes: int = 2 * 1024 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_voices_per_owner", "max_bytes_per_owner", "max_voices", "max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")


def over_quota(limit: int, used: int, adding: int) -> bool:
    return limit > 0 and used + adding > limit


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        return code in (_SQLITE_FULL, _SQLITE_IOERR) or "disk is full" in str(exc)
    return False


def private_dir(path: Path) -> None:
    """Create `path` 0700, or take group and world access away from an existing one."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        os.chmod(path, mode & 0o700)
        log.warning("voice store directory %s was open to other users (mode %o); made it %o",
                    path, mode, mode & 0o700)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize)


@dataclass(slots=True)
class SpaceReserve:
    """A file of `size` bytes that a delete on a full disk may free (0: none)."""

    path: Path
    size: int = DEFAULT_RESERVE_BYTES

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"the space reserve must be >= 0 bytes, got {self.size}")

    @property
    def is_held(self) -> bool:
        return self.path.is_file()

    def ensure(self) -> None:
        """(Re)create the reserve when there is room for it and as much again."""
        if self.size == 0 or self.is_held:
            return
        try:
            if free_bytes(self.path.parent) < 2 * self.size:
                return
            with open(self.path, "wb") as file:  # real bytes: a sparse file would reserve nothing
                os.fchmod(file.fileno(), 0o600)
                chunk = b"\0" * (1 << 20)
                left = self.size
                while left > 0:
                    left -= file.write(chunk[:left])
                file.flush()
                os.fsync(file.fileno())
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.path.unlink()
            log.warning("could not keep a %d-byte space reserve at %s: %s", self.size, self.path,
                        exc)

    def release(self) -> bool:
        """Give the reserve up (a delete met a full disk); False when there was none."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        log.warning("the disk under the voice store is full: released the %d-byte space reserve "
                    "so that a delete can go through", self.size)
        return True

    def check_room(self, num_bytes: int) -> None:
        """Raise StoreFullError unless `num_bytes` fit (twice: the WAL, then the database),
        with the reserve still in place and a margin besides."""
        need = 2 * num_bytes + max(self.size, 1 << 20)
        try:
            free = free_bytes(self.path.parent)
        except OSError:
            return  # cannot tell: let SQLite report it
        if free < need or (self.size and not self.is_held and free < need + self.size):
            raise StoreFullError(f"the disk holding the voice store has {free} bytes free; this "
                                 f"registration needs {need}: delete voices or free disk space")
        self.ensure()
