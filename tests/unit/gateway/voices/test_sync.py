"""Replicas on one voice store: writes see the store as it is, and a failed sync is not lost.

Two `VoiceService`s on one SQLite file, each with its own engine and the background poll
off (`sync_interval_s=0`), so nothing but the calls under test brings them in step.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine, EngineConfig
from gateway.voices.service import VoiceConfig, VoiceService
from gateway.voices.upload import VoiceUploadError
from tests.e2e.test_voices import make_wav
from tests.unit.gateway.voices.test_store import CloningBackend, upload, with_service

ALICE, BOB = "a" * 32, "b" * 32


@asynccontextmanager
async def two_replicas(tmp_path: Path) -> AsyncIterator[tuple[VoiceService, VoiceService]]:
    engines = [Engine(CloningBackend(), EngineConfig(warmup_text="")) for _ in range(2)]
    services = [VoiceService(VoiceConfig(data_dir=tmp_path, default_voice="v", sync_interval_s=0),
                             engine) for engine in engines]
    for engine, service in zip(engines, services, strict=True):
        await engine.start()
        await service.start()
    try:
        yield services[0], services[1]
    finally:
        for engine, service in zip(engines, services, strict=True):
            await service.stop()
            await engine.stop()


async def outcome(call: Callable[[], Awaitable[Any]]) -> str:
    try:
        await call()
    except VoiceUploadError as exc:
        return exc.code
    return "ok"


def test_an_id_freed_on_one_replica_is_its_owners_again_on_the_other_at_once(
        tmp_path: Path) -> None:
    async def scenario() -> list[str]:
        async with two_replicas(tmp_path) as (here, there):
            await here.register(upload("ada"), owner=ALICE)
            await there.sync()  # the other replica serves "ada" too
            await here.delete("ada")
            # no poll ran: each write catches up on its own
            return [await outcome(lambda: there.register(upload("ada"), owner=BOB)),
                    await outcome(lambda: there.register(upload("ada"), owner=ALICE)),
                    await outcome(lambda: here.register(upload("ada"), owner=BOB))]

    assert asyncio.run(scenario()) == ["voice_exists", "ok", "voice_exists"]


def test_a_voice_registered_on_one_replica_can_be_deleted_on_the_other_at_once(
        tmp_path: Path) -> None:
    async def scenario() -> list[Any]:
        async with two_replicas(tmp_path) as (here, there):
            await here.register(upload("ada"), owner=ALICE)
            deleted = await outcome(lambda: there.delete("ada"))
            await here.sync()
            return [deleted, "ada" in there.registered, "ada" in here.registered]

    assert asyncio.run(scenario()) == ["ok", False, False]


def test_a_sync_that_fails_halfway_picks_the_change_up_on_the_next_try(tmp_path: Path) -> None:
    async def scenario() -> list[Any]:
        async with two_replicas(tmp_path) as (here, there):
            await here.register(upload("ada"), owner=ALICE)
            real = there.registry.checksums

            async def locked_once() -> dict[str, str]:
                there.registry.checksums = real  # type: ignore[method-assign]
                raise sqlite3.OperationalError("database is locked")

            there.registry.checksums = locked_once  # type: ignore[method-assign]
            try:
                await there.sync()
                failed = "no"
            except sqlite3.OperationalError:
                failed = "yes"
            return [failed, "ada" in there.registered, await there.sync(),
                    "ada" in there.registered]

    assert asyncio.run(scenario()) == ["yes", False, True, True]


def test_a_write_goes_on_when_the_sync_before_it_cannot_read_the_store(tmp_path: Path) -> None:
    async def scenario() -> list[Any]:
        async with two_replicas(tmp_path) as (here, there):
            await here.register(upload("ada"), owner=ALICE)

            async def locked() -> dict[str, str]:
                raise sqlite3.OperationalError("database is locked")

            there.registry.checksums = locked  # type: ignore[method-assign]
            # the store's own transaction still refuses another tenant the id
            return [await outcome(lambda: there.register(upload("ada"), owner=BOB)),
                    await outcome(lambda: there.register(upload("bea"), owner=BOB))]

    assert asyncio.run(scenario()) == ["voice_exists", "ok"]


def test_registering_the_assets_at_start_reloads_nothing_the_store_held(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "teller.wav").write_bytes(make_wav(2.0, rate=16000))
    (assets / "teller.txt").write_text("A story.", encoding="utf-8")

    def run(body: Callable[[VoiceService], Awaitable[Any]]) -> Any:
        return asyncio.run(with_service(tmp_path, CloningBackend(), body, sync_interval_s=0,
                                        assets_dir=assets))

    async def upload_ada(service: VoiceService) -> None:
        await service.register(upload("ada"), owner=ALICE)

    async def voices(service: VoiceService) -> list[str]:
        return sorted(service.registered)

    run(upload_ada)
    (assets / "teller.txt").write_text("A changed story.", encoding="utf-8")  # registered again
    with caplog.at_level(logging.INFO, logger="voxgate.gateway"):
        assert run(voices) == ["ada", "teller"]
    # the restart loaded each stored voice once: the asset's registration synced nothing
    assert not [r for r in caplog.records if "another replica" in r.getMessage()]
