"""The voice registry's HTTP face and its wiring to the engine (docs/voices.md).

`VoiceService` owns the registered voices of one process: at start-up it loads
them from the store (features as stored, nothing recomputed unless the
engine's features version changed) and registers the assets folder; at run
time it registers and deletes voices for `/v1/voices`. It reaches the engine
only through its voice verbs (run on the engine's worker, keeping its listing
current) and sessions only through the shared `VoiceCatalog`. Voice changes
run under one asyncio lock, so registrations and deletes never interleave.

Deleting a voice retires it at once: unlisted, new sessions and requests get
`unknown_voice`, but whoever holds it in the catalog (a socket's voice, an
open context's, an HTTP request's) keeps speaking with it. When the last
holder lets go, the catalog calls back and the voice leaves the engine. Its id
stays its owner's for good (the store's `retired_ids`): only that tenant may
register it again, so a socket still holding it never speaks another tenant's
voice, whichever replica holds it and whichever registers.

Tenancy: each registered voice has an owner, the tenant (a hash of the API
key) that registered it, or "" for the operator's (assets, and uploads from
before tenancy). A tenant lists, reads, deletes and speaks with its own voices
and the operator's (deleting those takes an admin key); an admin reaches all.
Another tenant's voice is unknown to it on every route, as one that does not
exist (the catalog resolves ids per caller: gateway/voices/catalog.py). With
auth off there is one tenant. Voice ids are one namespace: built-in names (OpenAI's
voice names, installed voices and piper model names) cannot be registered.

Replicas sharing one store are kept in step by `ReplicaSync` (sync.py),
which `VoiceService` builds on.

The module is a little past the ~400 lines the style asks for: loading,
registering, deleting and describing all read and change the same state (the
registered voices, their owners and checksums, the unavailable ones) under the
one lock, and the engine's and the catalog's views must change with it; a
split by verb would pass that state between modules. What stands apart already
lives apart: the store (store.py, schema.py), reading an upload (upload.py),
what may be registered (policy.py), replicas (sync.py) and the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import uuid
from collections.abc import Iterator
from typing import Any

from engine.client import EngineClient
from engine.errors import UnknownVoiceError, UnsupportedOptionError, VoxgateError
from engine.types import VoiceInfo
from gateway.access.keys import OPERATOR, Principal
from gateway.voices.catalog import VoiceCatalog, unknown_voice_message
from gateway.voices.policy import VoiceConfig, is_reserved, is_visible, may_delete
from gateway.voices.space import (
    QuotaExceededError,
    StoreFullError,
    is_disk_full,
)
from gateway.voices.store import (
    CorruptRecordError,
    RegistryError,
    VoiceExistsError,
    VoiceRecord,
    VoiceRegistry,
    source_digest,
)
from gateway.voices.sync import ReplicaSync
from gateway.voices.upload import (
    ReferenceAudio,
    VoiceUpload,
    VoiceUploadError,
    check_fields,
    decode_reference,
)

log = logging.getLogger("voxgate.gateway")

def _store_full() -> VoiceUploadError:
    return VoiceUploadError(507, "insufficient_storage",
                            "the disk holding the voice store is full; "
                            "delete voices or free disk space")


def _store_failed() -> VoiceUploadError:
    return VoiceUploadError(503, "registry_unavailable", "the voice store could not be written; "
                            "the server logged why; try again later")


class VoiceService(ReplicaSync):
    """Registered voices of this process: store, engine and catalog kept in step."""

    def __init__(self, config: VoiceConfig, engine: EngineClient,
                 catalog: VoiceCatalog | None = None) -> None:
        self.config = config
        self.engine = engine
        self.catalog = catalog if catalog is not None else VoiceCatalog()
        self.catalog.on_unheld = self._on_unheld
        self.registry = VoiceRegistry(config.data_dir, reserve_bytes=config.reserve_bytes)
        self.registered: dict[str, dict[str, Any]] = {}  # id -> record summary (no audio)
        self._digests: dict[str, str] = {}  # id -> source digest (assets re-register on change)
        self.unavailable: dict[str, tuple[str, str]] = {}  # id -> (code, message)
        self.owners: dict[str, str] = {}  # id -> owning tenant, registered and unavailable ones
        self._checksums: dict[str, str] = {}  # id -> stored checksum: what sync() compares
        self.installed: set[str] = set()
        self.num_features_computed = 0
        self.num_uploads = 0  # uploads being decoded or featurized now (their bodies complete)
        self._lock = asyncio.Lock()
        self._removals: set[asyncio.Task[None]] = set()  # retired voices whose last holder left

    @property
    def degraded(self) -> list[str]:
        """What is wrong though the server runs (reported by /readyz)."""
        return [self.registry.damaged] if self.registry.damaged else []

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Open the store, load its voices into the engine, register the assets folder."""
        self.installed = {v.voice_id for v in self.engine.voices}
        if not self.engine.can_register_voices:
            # Nothing to serve from the store, so none is created (tests with scripted engines).
            log.info("the %s backend cannot register voices; the voice registry is off",
                     self.engine.backend_name)
            self.catalog.set_listed(self.installed, owners={})
            return
        try:
            await self.registry.open()
        except RegistryError as exc:
            raise SystemExit(f"voxgate: {exc}") from None
        records, corrupt = await self.registry.load_all()
        owners = await self.registry.owners() if corrupt else {}
        for voice_id, problem in corrupt.items():
            log.error("registered voice %r not served: %s", voice_id, problem)
            self.unavailable[voice_id] = ("corrupt_voice", problem)
            self.owners[voice_id] = owners.get(voice_id, "")  # its tenant may see and delete it
        for record in records:
            await self._load(record)
        await self._register_assets()
        self.catalog.set_listed((v.voice_id for v in self.engine.voices), owners=self.owners)
        await self._start_sync()
        log.info("voice registry %s: %d registered, %d unavailable", self.registry.path,
                 len(self.registered), len(self.unavailable))

    async def stop(self) -> None:
        await self._stop_sync()
        if self._removals:
            await asyncio.gather(*self._removals, return_exceptions=True)
        await self.registry.close()

    async def _load(self, record: VoiceRecord) -> None:
        engine = self.engine
        try:
            stored = await self.registry.get_features(record.voice_id, engine.backend_name,
                                                      engine.voice_features_version)
        except CorruptRecordError as exc:
            log.warning("%s; recomputing them from the stored audio", exc)
            stored = None
        try:
            if stored is None:
                reference = await asyncio.to_thread(decode_reference, record.audio,
                                                    self.config.limits)
                features = await self._features(reference, record.transcript)
                await self.registry.put_features(record.voice_id, engine.backend_name,
                                                 engine.voice_features_version, features)
            else:
                features = stored.features
            await self._add_to_engine(record, features)
        except (VoxgateError, ValueError) as exc:
            message = exc.message if isinstance(exc, VoiceUploadError) else str(exc)
            log.error("registered voice %r not served: %s", record.voice_id, message)
            self.unavailable[record.voice_id] = ("voice_unavailable", message)
            self.owners[record.voice_id] = record.owner
            return
        self.registered[record.voice_id] = record.summary()
        self._digests[record.voice_id] = record.source_digest
        self.owners[record.voice_id] = record.owner

    async def _features(self, reference: ReferenceAudio, transcript: str) -> bytes | None:
        try:
            features = await self.engine.make_voice_features(reference.pcm, reference.sample_rate,
                                                             transcript)
        except ValueError as exc:
            raise VoiceUploadError(422, "unusable_audio",
                                   f"the engine cannot use this reference: {exc}") from None
        except Exception as exc:  # a backend failure must not become a 500
            log.exception("computing voice features failed")
            raise VoiceUploadError(422, "voice_features_failed",
                                   "the engine failed to compute this voice's features "
                                   f"({type(exc).__name__}); the server logged it") from None
        self.num_features_computed += 1
        return features

    async def _add_to_engine(self, record: VoiceRecord, features: bytes | None) -> VoiceInfo:
        meta = {"name": record.name, "language": record.language,
                "base_voice": record.base_voice or self.config.default_voice}
        return await self.engine.add_voice(record.voice_id, features, meta)

    # -- registering ----------------------------------------------------------

    def _base_voice(self, requested: str | None) -> str:
        if requested is not None:
            if requested not in self.installed:
                raise VoiceUploadError(400, "unknown_voice",
                                       f"unknown base voice {requested[:64]!r}; "
                                       "expected an installed voice (GET /v1/voices: builtin)")
            return requested
        if self.config.default_voice in self.installed:
            return self.config.default_voice
        return min(self.installed)

    @contextlib.contextmanager
    def upload_slot(self) -> Iterator[None]:
        """One of `max_concurrent_uploads` places for decoding and featurizing an upload whose
        body is complete; when all are taken, 429 at once (decoding is the costly, bounded
        part; a body still on its way takes none, so a stalled one blocks nobody)."""
        if self.num_uploads >= self.config.max_concurrent_uploads:
            raise VoiceUploadError(429, "too_many_uploads", f"{self.num_uploads} voice uploads are "
                                   "being processed; try again in a few seconds")
        self.num_uploads += 1
        try:
            yield
        finally:
            self.num_uploads -= 1

    async def register(self, upload: VoiceUpload, *, source: str = "upload",
                       replace_existing: bool = False, owner: str = "") -> dict[str, Any]:
        """Check, compute features once, store, and make speakable; raises VoiceUploadError.

        `owner` is the registering tenant; uploads count against its quota and the total."""
        engine = self.engine
        if not engine.can_register_voices:
            raise VoiceUploadError(400, "unsupported_option",
                                   f"the {engine.backend_name} engine cannot register voices")
        check_fields(upload, self.config.limits, needs_transcript=engine.needs_transcript)
        voice_id = upload.voice_id or "voice-" + uuid.uuid4().hex[:10]
        base_voice = self._base_voice(upload.base_voice)
        # The body first: a 409 for an id costs a whole, valid reference, not one byte.
        reference = await asyncio.to_thread(decode_reference, upload.audio, self.config.limits)
        await self.sync_before_write()  # another replica may have freed or taken the id
        await self._check_free(voice_id, owner, replace_existing)
        features = await self._features(reference, upload.transcript)
        record = VoiceRecord(
            voice_id=voice_id, name=upload.name or voice_id, language=upload.language,
            transcript=upload.transcript, audio=upload.audio, audio_format=reference.format,
            sample_rate=reference.sample_rate, duration_s=reference.duration_s,
            base_voice=base_voice if features is None else None, source=source,
            source_digest=source_digest(upload.audio, upload.transcript), owner=owner)
        quota = self.config.quota if source == "upload" else None  # the operator's assets: none
        async with self._lock:
            # before the engine hears of it
            await self._check_free(voice_id, owner, replace_existing)
            try:
                info = await self._add_to_engine(record, features)
            except (VoxgateError, ValueError) as exc:
                code = (exc.code if isinstance(exc, (UnknownVoiceError, UnsupportedOptionError))
                        else "bad_voice")
                raise VoiceUploadError(400, code, str(exc)) from None
            try:
                await self.registry.insert(record,
                                           (engine.backend_name, engine.voice_features_version,
                                            features), replace_existing=replace_existing,
                                           quota=quota)
            except (VoiceExistsError, QuotaExceededError, StoreFullError) as exc:
                # (exists: another process took the id meanwhile)
                await engine.remove_voice(voice_id)
                raise VoiceUploadError(exc.status, exc.code, str(exc)) from None
            except (sqlite3.Error, OSError) as exc:  # disk full, read-only, locked too long
                log.exception("storing voice %r failed", voice_id)
                await engine.remove_voice(voice_id)
                raise (_store_full() if is_disk_full(exc) else _store_failed()) from None
            self.unavailable.pop(voice_id, None)
            self.registered[voice_id] = record.summary()
            self._digests[voice_id] = record.source_digest
            self.owners[voice_id] = owner
            self._checksums[voice_id] = record.checksum()
            self.catalog.add(voice_id, owner)  # its tenant's open sockets may switch to it now
        log.info("registered voice %r (%s, %.1f s, %s)", voice_id, source, record.duration_s,
                 "no features" if features is None else f"{len(features)} feature bytes")
        return self.describe_registered(info, self.registered[voice_id])

    async def _check_free(self, voice_id: str, owner: str, replace_existing: bool) -> None:
        """Refuse a built-in name, an id registered here, and an id the store gives another owner.

        A deleted voice's id stays its owner's (store.py, `retired_ids`): sockets on any
        replica may still hold the voice, and adding another tenant's voice under that id
        would replace it under them, in the engine shared by every backend (engine/voice_table.py).
        """
        if is_reserved(voice_id, self.installed):
            raise VoiceUploadError(409, "reserved_voice_id",
                                   f"{voice_id!r} is a built-in voice name "
                                   "(an installed voice, an OpenAI voice name or a piper model "
                                   "name); choose another id")
        is_taken = not replace_existing and (voice_id in self.registered
                                             or voice_id in self.unavailable)
        if is_taken or await self.registry.claimant(voice_id) not in (None, owner):
            # ids are one namespace: this says the id is taken, never whose it is, or since when
            raise VoiceUploadError(409, "voice_exists", f"voice id {voice_id!r} is taken; choose "
                                   "another id (or, to replace a voice of yours, delete it first)")

    async def _register_assets(self) -> None:
        """`name.wav` + `name.txt` pairs, registered once; a changed pair is registered again."""
        folder = self.config.assets_dir or self.config.data_dir / "assets"
        if not folder.is_dir():
            if self.config.assets_dir is not None:
                log.warning("voice assets folder %s does not exist; none registered", folder)
            return
        for wav in sorted(folder.glob("*.wav")):
            voice_id = wav.stem
            text_path = wav.with_suffix(".txt")
            try:
                audio = wav.read_bytes()
                transcript = (text_path.read_text(encoding="utf-8").strip()
                              if text_path.is_file() else "")
            except (OSError, UnicodeDecodeError) as exc:
                log.warning("voice asset %s skipped: %s", wav, exc)
                continue
            existing = self.registered.get(voice_id)
            if existing is not None:
                if existing["source"] != "assets":
                    log.warning("voice asset %s skipped: %r was registered by upload", wav,
                                voice_id)
                    continue
                if self._digests.get(voice_id) == source_digest(audio, transcript):
                    continue  # registered already, unchanged
            upload = VoiceUpload(audio=audio, transcript=transcript, voice_id=voice_id,
                                 name=voice_id)
            try:
                await self.register(upload, source="assets", replace_existing=existing is not None)
            except VoiceUploadError as exc:
                log.warning("voice asset %s skipped: %s (%s)", wav, exc.message, exc.code)

    # -- tenancy --------------------------------------------------------------

    def is_visible(self, voice_id: str, principal: Principal) -> bool:
        return is_visible(self.owners.get(voice_id, ""), principal)

    def _unknown(self, voice_id: str) -> VoiceUploadError:  # another tenant's voice reads as absent
        return VoiceUploadError(404, "unknown_voice", unknown_voice_message(voice_id))

    # -- deleting -------------------------------------------------------------

    async def delete(self, voice_id: str, principal: Principal = OPERATOR) -> None:
        """Forget a registered voice; whoever holds it keeps it until they let go."""
        await self.sync_before_write()  # one registered on another replica a moment ago
        async with self._lock:
            if voice_id in self.installed:
                raise VoiceUploadError(409, "builtin_voice", f"{voice_id!r} is an installed voice; "
                                       "remove its model files to remove it")
            if voice_id not in self.registered and voice_id not in self.unavailable:
                raise self._unknown(voice_id)
            if not self.is_visible(voice_id, principal):
                raise self._unknown(voice_id)
            if not may_delete(self.owners.get(voice_id, ""), principal):
                raise VoiceUploadError(403, "forbidden",
                                       f"voice {voice_id!r} belongs to the operator; "
                                       "deleting it takes an admin key")
            await self._delete_stored(voice_id)
            await self._forget(voice_id)
        log.info("deleted voice %r", voice_id)

    async def _forget(self, voice_id: str) -> None:
        """Drop a voice that left the store (here or on another replica); under the lock."""
        self.owners.pop(voice_id, None)
        self._checksums.pop(voice_id, None)
        if self.unavailable.pop(voice_id, None) is not None:
            return
        del self.registered[voice_id]
        self._digests.pop(voice_id, None)
        await self.engine.retire_voice(voice_id)
        if self.catalog.retire(voice_id):  # nobody holds it: gone at once
            await self._remove(voice_id)

    async def _delete_stored(self, voice_id: str) -> None:
        try:
            await self.registry.delete(voice_id)
        except (sqlite3.Error, OSError):
            log.exception("deleting voice %r failed", voice_id)
            raise _store_failed() from None

    async def _remove(self, voice_id: str) -> None:
        with contextlib.suppress(UnknownVoiceError):
            await self.engine.remove_voice(voice_id)
        log.info("released deleted voice %r", voice_id)

    def _on_unheld(self, voice_id: str) -> None:
        """The catalog's call: the last holder of a retired voice let go (on the event loop)."""
        task = asyncio.get_running_loop().create_task(self._remove_unheld(voice_id))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def _remove_unheld(self, voice_id: str) -> None:
        async with self._lock:
            # registered again, or (through a new context of a holder) held again meanwhile: keep it
            if self.catalog.is_retired(voice_id) and self.catalog.num_holders(voice_id) == 0:
                self.catalog.forget(voice_id)
                await self._remove(voice_id)

    # -- describing -----------------------------------------------------------

    @staticmethod
    def describe_info(info: VoiceInfo) -> dict[str, Any]:
        return {"id": info.voice_id, "name": info.name, "language": info.language,
                "languages": list(info.languages), "backend": info.backend,
                "sample_rate": info.sample_rate, "builtin": info.is_builtin,
                "supports_instructions": info.supports_instructions}

    def describe_registered(self, info: VoiceInfo, summary: dict[str, Any]) -> dict[str, Any]:
        out = {**summary, **self.describe_info(info), "registered": True}
        out["reference_language"] = summary["language"] or None  # what the upload said it speaks
        return out

    def listing(self, principal: Principal = OPERATOR) -> dict[str, Any]:
        voices = [{**self.describe_info(v), "registered": v.voice_id in self.registered}
                  for v in self.engine.voices if self.is_visible(v.voice_id, principal)]
        unavailable = [{"id": k, "code": c, "message": m}
                       for k, (c, m) in sorted(self.unavailable.items())
                       if self.is_visible(k, principal)]
        return {"voices": voices, "default": self.config.default_voice, "unavailable": unavailable}

    async def describe(self, voice_id: str, principal: Principal = OPERATOR) -> dict[str, Any]:
        if not self.is_visible(voice_id, principal):
            raise self._unknown(voice_id)
        if voice_id in self.unavailable:
            code, message = self.unavailable[voice_id]
            raise VoiceUploadError(409, code, message)
        info = next((v for v in self.engine.voices if v.voice_id == voice_id), None)
        if info is None:
            raise self._unknown(voice_id)
        if voice_id not in self.registered:
            return {**self.describe_info(info), "registered": False}
        try:
            record = await self.registry.get(voice_id)
        except CorruptRecordError as exc:
            raise VoiceUploadError(exc.status, exc.code, str(exc)) from None
        if record is None:
            raise self._unknown(voice_id)
        return self.describe_registered(info, record.summary())


__all__ = ["VoiceConfig", "VoiceService"]
