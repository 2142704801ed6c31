"""The voice store (SQLite, checksums, schema) and the service that feeds it to the engine."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import stat
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.engine import Engine, EngineConfig
from engine.types import VoiceInfo
from gateway.access.keys import OPERATOR, Principal
from gateway.voices.service import VoiceConfig, VoiceService
from gateway.voices.space import Quota, QuotaExceededError
from gateway.voices.store import (
    SCHEMA_VERSION,
    CorruptRecordError,
    RegistryError,
    VoiceExistsError,
    VoiceRecord,
    VoiceRegistry,
    VoiceStore,
)
from gateway.voices.upload import VoiceUpload, VoiceUploadError
from tests.e2e.test_voices import make_wav
from tests.support.scripted_backend import ScriptedBackend


def record(voice_id: str = "ada", audio: bytes = b"RIFF\x00fake-audio\xff") -> VoiceRecord:
    return VoiceRecord(voice_id, "Ada", "en", "Hello there.", audio, "wav", 16000, 2.5,
                       created_at=1_700_000_000.0)


@contextlib.contextmanager
def tamper(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A second, raw connection to the store's file (a hand edit, a damaged page)."""
    with contextlib.closing(sqlite3.connect(tmp_path / "voices.sqlite3")) as db, db:
        yield db


def store_at(tmp_path: Path) -> VoiceStore:
    return VoiceStore(tmp_path / "voices.sqlite3")


# -- the store --------------------------------------------------------------------


def test_a_stored_voice_reads_back_byte_for_byte_with_its_features(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    features = bytes(range(256)) * 4
    store.insert(record(), ("cosyvoice", "v3", features))
    assert store.get("ada") == record()
    stored = store.get_features("ada", "cosyvoice", "v3")
    assert stored is not None and stored.features == features
    assert store.get_features("ada", "cosyvoice", "v2") is None
    assert store.get("nobody") is None


def test_the_schema_version_is_recorded_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    assert store.schema_version == SCHEMA_VERSION
    store.close()
    with tamper(tmp_path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(RegistryError, match="upgrade voxgate"):
        store_at(tmp_path)


@pytest.mark.parametrize(("column", "value"), [
    ("audio", b"RIFF\x00fake-audio\xfe"), ("transcript", "Hello there!"), ("name", "Eve"),
    ("sample_rate", 48000), ("created_at", 0.0), ("base_voice", "joe"),
])
def test_tampering_with_any_stored_column_is_detected(tmp_path: Path, column: str,
                                                      value: Any) -> None:
    store = store_at(tmp_path)
    store.insert(record())
    store.insert(record("bob"))
    with tamper(tmp_path) as db:
        db.execute(f"UPDATE voices SET {column} = ? WHERE voice_id = 'ada'", (value,))
    with pytest.raises(CorruptRecordError, match="checksum"):
        store.get("ada")
    records, corrupt = store.load_all()
    assert [r.voice_id for r in records] == ["bob"] and list(corrupt) == ["ada"]


def test_damaged_features_are_reported_not_returned(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.insert(record(), ("cosyvoice", "v3", b"\x01\x02\x03"))
    with tamper(tmp_path) as db:
        db.execute("UPDATE voice_features SET features = X'010203FF'")
    with pytest.raises(CorruptRecordError, match="features"):
        store.get_features("ada", "cosyvoice", "v3")


def test_deleting_a_voice_deletes_its_features_and_reports_whether_it_existed(
        tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.insert(record(), ("piper", "", None))
    assert store.delete("ada") is True and store.delete("ada") is False
    with tamper(tmp_path) as db:
        assert db.execute("SELECT COUNT(*) FROM voice_features").fetchone() == (0,)


def test_registering_an_id_twice_raises_voice_exists_and_keeps_the_first(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.insert(record())
    with pytest.raises(VoiceExistsError):
        store.insert(record(audio=b"other"))
    assert store.get("ada") == record()
    store.insert(record(audio=b"other"), replace_existing=True)
    stored = store.get("ada")
    assert stored is not None and stored.audio == b"other"


def test_a_deleted_id_stays_its_owners_and_only_its_owner_takes_it_back(tmp_path: Path) -> None:
    first, second = store_at(tmp_path), store_at(tmp_path)  # two replicas on one file
    tenant = VoiceRecord("x", "X", "en", "Hi.", b"a", "wav", 16000, 2.0, owner="t1")
    first.insert(tenant)
    assert first.delete("x") is True and first.get("x") is None
    assert second.claimant("x") == "t1"
    for owner in ("t2", ""):  # another tenant, or the operator's assets
        with pytest.raises(VoiceExistsError):
            second.insert(VoiceRecord("x", "X", "en", "Hi.", b"b", "wav", 16000, 2.0, owner=owner))
    second.insert(VoiceRecord("x", "X2", "en", "Hi.", b"c", "wav", 16000, 2.0, owner="t1"))
    stored = first.get("x")
    assert stored is not None and (stored.name, stored.owner) == ("X2", "t1")
    with tamper(tmp_path) as db:  # taken back: a live voice again, no retired id left
        assert db.execute("SELECT COUNT(*) FROM retired_ids").fetchone() == (0,)
    assert first.claimant("free") is None


def test_a_version_2_store_gains_retired_ids(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.insert(record("ada"))
    store.close()
    with tamper(tmp_path) as db:  # what version 2 wrote: no retired ids
        db.execute("DROP TABLE retired_ids")
        db.execute("PRAGMA user_version=2")
    migrated = store_at(tmp_path)
    assert migrated.schema_version == SCHEMA_VERSION == 3
    assert migrated.get("ada") == record("ada")
    assert migrated.delete("ada") and migrated.claimant("ada") == ""


def test_a_file_that_is_not_a_database_is_reported_with_its_path(tmp_path: Path) -> None:
    (tmp_path / "voices.sqlite3").write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(RegistryError, match="move it aside"):
        store_at(tmp_path)


def test_two_stores_on_one_file_see_each_others_writes(tmp_path: Path) -> None:
    first, second = store_at(tmp_path), store_at(tmp_path)
    first.insert(record("ada"))
    second.insert(record("bob"))
    with pytest.raises(VoiceExistsError):
        second.insert(record("ada"))
    assert [r.voice_id for r in first.load_all()[0]] == ["ada", "bob"]


def test_concurrent_async_inserts_and_deletes_all_land(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[str], int]:
        registry = VoiceRegistry(tmp_path)
        await registry.open()
        await asyncio.gather(*(registry.insert(record(f"v{n}")) for n in range(20)))
        outcomes = await asyncio.gather(*(registry.insert(record("v0")) for _ in range(3)),
                                        return_exceptions=True)
        await asyncio.gather(*(registry.delete(f"v{n}") for n in range(0, 20, 2)))
        records, _ = await registry.load_all()
        await registry.close()
        return sorted(r.voice_id for r in records), sum(isinstance(o, VoiceExistsError)
                                                        for o in outcomes)

    ids, num_conflicts = asyncio.run(scenario())
    assert ids == sorted(f"v{n}" for n in range(1, 20, 2))
    assert num_conflicts == 3


# -- the service, on a backend that clones ------------------------------------------


class CloningBackend(ScriptedBackend):
    """A scripted backend that takes features from the reference (as cosyvoice will)."""

    can_register_voices = True
    needs_transcript = True

    def __init__(self, version: str = "model-a") -> None:
        super().__init__()
        self.voice_features_version = version
        self.num_made = 0
        self.added: dict[str, bytes | None] = {}

    def voices(self) -> list[VoiceInfo]:
        registered = [VoiceInfo(v, v, "en", self.name, self.sample_rate, is_builtin=False)
                      for v in self.added]
        return super().voices() + registered

    def make_voice_features(self, audio: np.ndarray, sample_rate: int,
                            transcript: str) -> bytes | None:
        self.num_made += 1
        return f"{self.voice_features_version}:{len(audio)}@{sample_rate}:{transcript}".encode()

    def add_voice(self, voice_id: str, features: bytes | None, meta: dict[str, Any]) -> VoiceInfo:
        self.added[voice_id] = features
        return VoiceInfo(voice_id, meta["name"], "en", self.name, self.sample_rate,
                         is_builtin=False)

    def retire_voice(self, voice_id: str) -> None:
        self.added.pop(voice_id)

    def remove_voice(self, voice_id: str) -> None:
        self.added.pop(voice_id, None)


async def with_service(tmp_path: Path, backend: ScriptedBackend,
                       body: Callable[[VoiceService], Awaitable[Any]], **config: Any) -> Any:
    engine = Engine(backend, EngineConfig(warmup_text=""))
    await engine.start()
    service = VoiceService(VoiceConfig(data_dir=tmp_path, default_voice="v", **config), engine)
    await service.start()
    try:
        return await body(service)
    finally:
        await service.stop()
        await engine.stop()


def upload(voice_id: str = "ada", transcript: str = "Hello there.") -> VoiceUpload:
    return VoiceUpload(audio=make_wav(2.0, rate=16000), transcript=transcript, voice_id=voice_id)


def test_features_are_computed_once_at_registration_and_reused_after_a_restart(
        tmp_path: Path) -> None:
    first, second = CloningBackend(), CloningBackend()

    async def register(service: VoiceService) -> dict[str, Any]:
        return await service.register(upload())

    async def listing(service: VoiceService) -> dict[str, Any]:
        return service.listing()

    body = asyncio.run(with_service(tmp_path, first, register))
    assert body["id"] == "ada" and body["base_voice"] is None
    assert first.num_made == 1 and first.added["ada"] == b"model-a:32000@16000:Hello there."
    voices = asyncio.run(with_service(tmp_path, second, listing))["voices"]
    assert second.num_made == 0  # loaded as stored
    assert second.added["ada"] == first.added["ada"]
    assert {"id": "ada", "registered": True}.items() <= next(v for v in voices
                                                             if v["id"] == "ada").items()


def test_features_made_by_another_model_are_recomputed_once_from_the_stored_audio(
        tmp_path: Path) -> None:
    async def register(service: VoiceService) -> None:
        await service.register(upload())

    async def nothing(service: VoiceService) -> None:
        return None

    asyncio.run(with_service(tmp_path, CloningBackend("model-a"), register))
    upgraded, again = CloningBackend("model-b"), CloningBackend("model-b")
    asyncio.run(with_service(tmp_path, upgraded, nothing))
    asyncio.run(with_service(tmp_path, again, nothing))
    assert upgraded.num_made == 1 and upgraded.added["ada"] == b"model-b:32000@16000:Hello there."
    assert again.num_made == 0 and again.added["ada"] == upgraded.added["ada"]


def test_damaged_features_are_recomputed_and_the_voice_is_still_served(tmp_path: Path) -> None:
    async def register(service: VoiceService) -> None:
        await service.register(upload())

    async def nothing(service: VoiceService) -> None:
        return None

    asyncio.run(with_service(tmp_path, CloningBackend(), register))
    with tamper(tmp_path) as db:
        db.execute("UPDATE voice_features SET features = X'00'")
    healed = CloningBackend()
    asyncio.run(with_service(tmp_path, healed, nothing))
    assert healed.num_made == 1 and healed.added["ada"] == b"model-a:32000@16000:Hello there."


def test_a_backend_that_clones_refuses_a_reference_without_its_transcript(tmp_path: Path) -> None:
    async def register(service: VoiceService) -> None:
        await service.register(upload(transcript=""))

    backend = CloningBackend()
    with pytest.raises(VoiceUploadError) as caught:
        asyncio.run(with_service(tmp_path, backend, register))
    assert caught.value.code == "missing_transcript" and backend.num_made == 0


def test_a_backend_that_cannot_register_voices_answers_unsupported_option(tmp_path: Path) -> None:
    async def register(service: VoiceService) -> None:
        await service.register(upload())

    with pytest.raises(VoiceUploadError) as caught:
        asyncio.run(with_service(tmp_path, ScriptedBackend(), register))
    assert caught.value.code == "unsupported_option" and caught.value.status == 400
    assert not (tmp_path / "voices.sqlite3").exists()  # no store is created for it


def test_a_changed_asset_is_registered_again_and_an_unchanged_one_is_not(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "teller.wav").write_bytes(make_wav(2.0, rate=16000))
    (assets / "teller.txt").write_text("A story.", encoding="utf-8")
    (assets / "mute.wav").write_bytes(make_wav(2.0, rate=16000, amplitude=0.0))  # invalid: skipped

    async def transcript(service: VoiceService) -> tuple[str, list[str]]:
        return (await service.describe("teller"))["transcript"], sorted(service.registered)

    runs = []
    for text in ("A story.", "A story.", "Another story."):
        (assets / "teller.txt").write_text(text, encoding="utf-8")
        backend = CloningBackend()
        runs.append((*asyncio.run(with_service(tmp_path, backend, transcript, assets_dir=assets)),
                     backend.num_made))
    assert runs == [("A story.", ["teller"], 1), ("A story.", ["teller"], 0),
                    ("Another story.", ["teller"], 1)]


@pytest.mark.parametrize(("failure", "status", "code"), [
    ("database is locked", 503, "registry_unavailable"),
    ("database or disk is full", 507, "insufficient_storage"),
])
def test_a_store_that_cannot_be_written_answers_503_or_507_and_leaves_no_half_voice(
        tmp_path: Path, failure: str, status: int, code: str) -> None:
    backend = CloningBackend()

    async def register(service: VoiceService) -> None:
        async def broken_insert(*args: Any, **kwargs: Any) -> None:
            raise sqlite3.OperationalError(failure)

        service.registry.insert = broken_insert  # type: ignore[method-assign]
        await service.register(upload())

    with pytest.raises(VoiceUploadError) as caught:
        asyncio.run(with_service(tmp_path, backend, register))
    assert (caught.value.status, caught.value.code) == (status, code)
    assert "ada" not in backend.added


# -- tenancy, quotas, durability, privacy, replicas (issue 21) ---------------------

def test_a_version_1_store_gains_owners_and_keeps_every_checksum(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.insert(record("ada"))
    store.close()
    with tamper(tmp_path) as db:  # back to what version 1 wrote: no owner column
        db.execute("ALTER TABLE voices DROP COLUMN owner")
        db.execute("PRAGMA user_version=1")
    migrated = store_at(tmp_path)
    assert migrated.schema_version == SCHEMA_VERSION == 3
    assert migrated.get("ada") == record("ada")  # intact under its old checksum, owner ""
    migrated.insert(VoiceRecord("bob", "Bob", "en", "Hi.", b"x", "wav", 16000, 2.0, owner="t1"))
    stored = migrated.get("bob")
    assert stored is not None and stored.owner == "t1"


def test_changing_a_voice_owner_by_hand_is_detected(tmp_path: Path) -> None:
    store_at(tmp_path).insert(VoiceRecord("bob", "Bob", "en", "Hi.", b"x", "wav", 16000, 2.0,
                                          owner="t1"))
    with tamper(tmp_path) as db:
        db.execute("UPDATE voices SET owner = 't2' WHERE voice_id = 'bob'")
    with pytest.raises(CorruptRecordError):
        store_at(tmp_path).get("bob")


def test_quotas_count_voices_and_bytes_per_owner_and_in_all(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    quota = Quota(max_voices_per_owner=2, max_bytes_per_owner=250, max_voices=3, max_bytes=0)

    def add(voice_id: str, owner: str, size: int = 100) -> None:
        store.insert(VoiceRecord(voice_id, voice_id, "en", "Hi.", b"a" * size, "wav", 16000, 2.0,
                                 owner=owner), quota=quota)

    add("a1", "alice")
    with pytest.raises(QuotaExceededError, match="reference bytes"):
        add("a2", "alice", size=200)  # 100 + 200 > 250
    add("a2", "alice")
    with pytest.raises(QuotaExceededError, match="2 voices registered"):
        add("a3", "alice")
    add("b1", "bob")  # another tenant has its own count
    with pytest.raises(QuotaExceededError, match="the server holds 3 voices"):
        add("c1", "carol")
    store.delete("a1")
    add("c1", "carol")
    assert sorted(store.checksums()) == ["a2", "b1", "c1"]


def test_the_store_is_private_to_the_server_user_and_writes_with_full_sync(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    store = store_at(data)
    store.insert(record())
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for name in ("voices.sqlite3", "voices.sqlite3-wal", "voices.sqlite3-shm"):
        assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_another_connection_s_commit_changes_the_data_version_and_our_own_does_not(
        tmp_path: Path) -> None:
    mine, theirs = store_at(tmp_path), store_at(tmp_path)
    before = mine.data_version()
    mine.insert(record("ada"))
    assert mine.data_version() == before
    theirs.insert(record("bob"))
    assert mine.data_version() != before
    assert set(mine.checksums()) == {"ada", "bob"}


def test_a_damaged_file_is_moved_aside_and_an_empty_store_opened(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "voices.sqlite3").write_bytes(b"not a database, just bytes " * 200)

    async def scenario() -> tuple[str | None, int]:
        registry = VoiceRegistry(tmp_path)
        await registry.open()
        try:
            return registry.damaged, len((await registry.load_all())[0])
        finally:
            await registry.close()

    damaged, count = asyncio.run(scenario())
    assert damaged is not None and "moved to voices.sqlite3.damaged-" in damaged and count == 0
    aside = list(tmp_path.glob("voices.sqlite3.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"not a database")
    assert "voice registry degraded" in caplog.text


def test_a_delete_on_a_full_disk_gives_up_the_reserve_and_goes_through(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path / "voices.sqlite3", reserve_bytes=64 * 1024)
    store.insert(record("ada"))
    assert store.reserve.is_held
    calls: list[str] = []
    real_delete = store._delete

    def full_once(voice_id: str) -> bool:  # SQLite's answer on a full disk, the first time
        calls.append(voice_id)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return real_delete(voice_id)

    store._delete = full_once  # type: ignore[method-assign]
    assert store.delete("ada") is True and calls == ["ada", "ada"]
    assert not store.reserve.is_held and store.get("ada") is None


def test_a_corrupt_voice_is_shown_to_its_own_tenant_and_admins_only(tmp_path: Path) -> None:
    alice, bob = Principal("a" * 32), Principal("b" * 32)

    async def register(service: VoiceService) -> None:
        await service.register(upload(), owner=alice.tenant)

    asyncio.run(with_service(tmp_path, CloningBackend(), register))
    with tamper(tmp_path) as db:
        db.execute("UPDATE voices SET transcript = 'changed by hand' WHERE voice_id = 'ada'")

    async def views(service: VoiceService) -> list[list[str]]:
        return [[u["id"] for u in service.listing(p)["unavailable"]]
                for p in (alice, bob, OPERATOR)]

    assert asyncio.run(with_service(tmp_path, CloningBackend(), views)) == [["ada"], [], ["ada"]]


def test_sync_picks_up_what_another_service_on_the_same_store_registered_and_deleted(
        tmp_path: Path) -> None:
    async def scenario() -> list[Any]:
        engines = [Engine(CloningBackend(), EngineConfig(warmup_text="")) for _ in range(2)]
        configs = [VoiceConfig(data_dir=tmp_path, default_voice="v", sync_interval_s=0)
                   for _ in engines]
        services = [VoiceService(c, e) for c, e in zip(configs, engines, strict=True)]
        for engine, service in zip(engines, services, strict=True):
            await engine.start()
            await service.start()
        here, there = services
        try:
            seen = [await there.sync()]  # nothing happened yet
            await here.register(upload("ada"))
            seen += [await there.sync(), "ada" in there.catalog.listed, "ada" in there.registered]
            seen.append(await there.sync())  # nothing new since
            await here.delete("ada")
            seen += [await there.sync(), "ada" in there.catalog.listed, "ada" in there.registered]
            return seen
        finally:
            for engine, service in zip(engines, services, strict=True):
                await service.stop()
                await engine.stop()

    assert asyncio.run(scenario()) == [False, True, True, True, False, True, False, False]


def _open_together(path: Path, n: int) -> list[str]:
    """`n` processes open a new store at one moment (each waits at a barrier); their errors."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, errors = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_open_store, args=(str(path), barrier, errors)) for _ in range(n)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    found = []
    while not errors.empty():
        found.append(errors.get())
    return found


def _open_store(path: str, barrier: Any, errors: Any) -> None:
    barrier.wait()
    try:
        VoiceStore(Path(path)).close()
    except Exception as exc:  # noqa: BLE001 - sent to the test, which names it
        errors.put(repr(exc))


def test_processes_that_open_a_new_store_together_all_open_it(tmp_path: Path) -> None:
    # the workers of --workers (and Ray replicas) start together on one data dir
    for round_ in range(3):
        assert _open_together(tmp_path / f"d{round_}" / "voices.sqlite3", 6) == []
