"""The voice store's data against real servers on loopback (issue 21, "Smaller faults"): private
files, a damaged file that no longer stops the server, replicas that see each other's voices."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import httpx

from tests.e2e.test_voices import listed, register, say
from tests.support.server import start_server
from tests.support.wait import wait_until


def test_the_data_dir_and_the_database_are_private_to_the_server_user(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = start_server(tmp_path, env={"VOXGATE_DATA_DIR": str(data)})
    try:
        assert register(proc.url, "private-voice").status_code == 201
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        for name in ("voices.sqlite3", "voices.sqlite3-wal", "voices.sqlite3-shm"):
            assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
    finally:
        proc.stop()


def test_a_damaged_database_is_moved_aside_and_the_server_starts_degraded(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "voices.sqlite3").write_bytes(b"\x00garbage, not SQLite\xff" * 500)
    proc = start_server(tmp_path, env={"VOXGATE_DATA_DIR": str(data)})
    try:
        ready = httpx.get(proc.url + "/readyz")
        assert ready.status_code == 200
        degraded = ready.json()["degraded"]
        assert len(degraded) == 1 and "moved to voices.sqlite3.damaged-" in degraded[0]
        assert "voice registry degraded" in proc.log()
        assert len(list(data.glob("voices.sqlite3.damaged-*"))) == 1
        assert register(proc.url, "after-damage").status_code == 201  # an empty, working store
    finally:
        proc.stop()


def test_replicas_sharing_one_store_see_each_other_s_registrations_and_deletes(
        tmp_path: Path) -> None:
    env = {"VOXGATE_DATA_DIR": str(tmp_path / "shared"), "VOXGATE_VOICE_SYNC_INTERVAL_S": "0.5"}
    logs = [tmp_path / "a", tmp_path / "b"]
    for folder in logs:
        folder.mkdir()
    first, second = (start_server(folder, env=env) for folder in logs)
    try:
        assert register(first.url, "shared-voice").status_code == 201
        wait_until(lambda: "shared-voice" in listed(second.url), timeout=20, interval=0.2,
                   message="the other replica never listed the voice")
        done, frames, errors = asyncio.run(say(second.ws_url, "Spoken by the other replica.",
                                               "shared-voice"))
        assert done["type"] == "context.done" and frames > 0 and not errors
        assert httpx.delete(second.url + "/v1/voices/shared-voice").status_code == 200
        wait_until(lambda: "shared-voice" not in listed(first.url), timeout=20, interval=0.2,
                   message="the first replica still lists the deleted voice")
        assert httpx.get(first.url + "/v1/voices/shared-voice").status_code == 404
        assert register(first.url, "shared-voice").status_code == 201  # the id is free again
    finally:
        first.stop()
        second.stop()
