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
holder lets go, the catalog calls back and the voice leaves the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.engine import Engine
from engine.errors import UnknownVoiceError, UnsupportedOptionError, VoxgateError
from engine.types import VoiceInfo
from gateway.errors import http_error
from gateway.registry import (
    CorruptRecordError,
    RegistryError,
    VoiceExistsError,
    VoiceRecord,
    VoiceRegistry,
    source_digest,
)
from gateway.voice_catalog import VoiceCatalog
from gateway.voice_upload import (
    VOICE_ID_RE,
    ReferenceAudio,
    UploadLimits,
    VoiceUpload,
    VoiceUploadError,
    check_fields,
    decode_reference,
    read_upload,
)

log = logging.getLogger("voxgate.gateway")


@dataclass(slots=True)
class VoiceConfig:
    """Where voices live and what an upload may be (VOXGATE_VOICE_ASSETS sets `assets_dir`)."""

    data_dir: Path
    assets_dir: Path | None = None  # None: <data_dir>/assets, when it exists
    default_voice: str = "joe"  # speaks for registered voices on backends that cannot clone
    limits: UploadLimits = field(default_factory=UploadLimits)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.assets_dir is not None:
            self.assets_dir = Path(self.assets_dir)

    @classmethod
    def from_gateway(cls, config: Any, environ: dict[str, str] | None = None) -> VoiceConfig:
        env = os.environ if environ is None else environ
        assets = getattr(config, "voice_assets", None) or env.get("VOXGATE_VOICE_ASSETS") or None
        return cls(data_dir=config.data_dir, assets_dir=Path(assets) if assets else None,
                   default_voice=config.voice)


def _store_failed() -> VoiceUploadError:
    return VoiceUploadError(503, "registry_unavailable", "the voice store could not be written; "
                            "the server logged why; try again later")


class VoiceService:
    """Registered voices of this process: store, engine and catalog kept in step."""

    def __init__(self, config: VoiceConfig, engine: Engine, catalog: VoiceCatalog | None = None) -> None:
        self.config = config
        self.engine = engine
        self.catalog = catalog if catalog is not None else VoiceCatalog()
        self.catalog.on_unheld = self._on_unheld
        self.registry = VoiceRegistry(config.data_dir)
        self.registered: dict[str, dict[str, Any]] = {}  # id -> record summary (no audio)
        self._digests: dict[str, str] = {}  # id -> source digest (assets re-register on change)
        self.unavailable: dict[str, tuple[str, str]] = {}  # id -> (code, message)
        self.installed: set[str] = set()
        self.num_features_computed = 0
        self._lock = asyncio.Lock()
        self._removals: set[asyncio.Task[None]] = set()  # retired voices whose last holder left

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Open the store, load its voices into the engine, register the assets folder."""
        self.installed = {v.voice_id for v in self.engine.voices}
        if not self.engine.can_register_voices:
            # Nothing to serve from the store, so none is created (tests with scripted engines).
            log.info("the %s backend cannot register voices; the voice registry is off",
                     self.engine.backend_name)
            self.catalog.set_listed(self.installed)
            return
        try:
            await self.registry.open()
        except RegistryError as exc:
            raise SystemExit(f"voxgate: {exc}") from None
        records, corrupt = await self.registry.load_all()
        for voice_id, problem in corrupt.items():
            log.error("registered voice %r not served: %s", voice_id, problem)
            self.unavailable[voice_id] = ("corrupt_voice", problem)
        for record in records:
            await self._load(record)
        await self._register_assets()
        self.catalog.set_listed(v.voice_id for v in self.engine.voices)
        log.info("voice registry %s: %d registered, %d unavailable", self.registry.path,
                 len(self.registered), len(self.unavailable))

    async def stop(self) -> None:
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
                reference = await asyncio.to_thread(decode_reference, record.audio, self.config.limits)
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
            return
        self.registered[record.voice_id] = record.summary()
        self._digests[record.voice_id] = record.source_digest

    async def _features(self, reference: ReferenceAudio, transcript: str) -> bytes | None:
        try:
            features = await self.engine.make_voice_features(reference.pcm, reference.sample_rate,
                                                             transcript)
        except ValueError as exc:
            raise VoiceUploadError(422, "unusable_audio", f"the engine cannot use this reference: {exc}") from None
        except Exception as exc:  # a backend failure must not become a 500
            log.exception("computing voice features failed")
            raise VoiceUploadError(422, "voice_features_failed", "the engine failed to compute this "
                                   f"voice's features ({type(exc).__name__}); the server logged it") from None
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
                raise VoiceUploadError(400, "unknown_voice", f"unknown base voice {requested!r}; "
                                       f"expected an installed voice: {', '.join(sorted(self.installed))}")
            return requested
        if self.config.default_voice in self.installed:
            return self.config.default_voice
        return min(self.installed)

    async def register(self, upload: VoiceUpload, *, source: str = "upload",
                       replace_existing: bool = False) -> dict[str, Any]:
        """Check, compute features once, store, and make speakable; raises VoiceUploadError."""
        engine = self.engine
        if not engine.can_register_voices:
            raise VoiceUploadError(400, "unsupported_option",
                                   f"the {engine.backend_name} engine cannot register voices")
        check_fields(upload, self.config.limits, needs_transcript=engine.needs_transcript)
        voice_id = upload.voice_id or "voice-" + uuid.uuid4().hex[:10]
        self._check_free(voice_id, replace_existing)
        base_voice = self._base_voice(upload.base_voice)
        reference = await asyncio.to_thread(decode_reference, upload.audio, self.config.limits)
        features = await self._features(reference, upload.transcript)
        record = VoiceRecord(
            voice_id=voice_id, name=upload.name or voice_id, language=upload.language,
            transcript=upload.transcript, audio=upload.audio, audio_format=reference.format,
            sample_rate=reference.sample_rate, duration_s=reference.duration_s,
            base_voice=base_voice if features is None else None, source=source,
            source_digest=source_digest(upload.audio, upload.transcript))
        async with self._lock:
            self._check_free(voice_id, replace_existing)
            try:
                info = await self._add_to_engine(record, features)
            except (VoxgateError, ValueError) as exc:
                code = exc.code if isinstance(exc, (UnknownVoiceError, UnsupportedOptionError)) else "bad_voice"
                raise VoiceUploadError(400, code, str(exc)) from None
            try:
                await self.registry.insert(record, (engine.backend_name, engine.voice_features_version,
                                                    features), replace_existing=replace_existing)
            except VoiceExistsError as exc:  # another process took the id meanwhile
                await engine.remove_voice(voice_id)
                raise VoiceUploadError(exc.status, exc.code, str(exc)) from None
            except (sqlite3.Error, OSError):  # disk full, read-only, locked too long
                log.exception("storing voice %r failed", voice_id)
                await engine.remove_voice(voice_id)
                raise _store_failed() from None
            self.unavailable.pop(voice_id, None)
            self.registered[voice_id] = record.summary()
            self._digests[voice_id] = record.source_digest
            self.catalog.add(voice_id)  # open sockets may switch to it now
        log.info("registered voice %r (%s, %.1f s, %s)", voice_id, source, record.duration_s,
                 "no features" if features is None else f"{len(features)} feature bytes")
        return self.describe_registered(info, self.registered[voice_id])

    def _check_free(self, voice_id: str, replace_existing: bool) -> None:
        if voice_id in self.installed:
            raise VoiceUploadError(409, "voice_exists", f"{voice_id!r} names an installed voice; "
                                   "choose another id")
        if not replace_existing and (voice_id in self.registered or voice_id in self.unavailable):
            raise VoiceUploadError(409, "voice_exists", f"voice {voice_id!r} is registered already; "
                                   "delete it first or choose another id")

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
                transcript = text_path.read_text(encoding="utf-8").strip() if text_path.is_file() else ""
            except (OSError, UnicodeDecodeError) as exc:
                log.warning("voice asset %s skipped: %s", wav, exc)
                continue
            existing = self.registered.get(voice_id)
            if existing is not None:
                if existing["source"] != "assets":
                    log.warning("voice asset %s skipped: %r was registered by upload", wav, voice_id)
                    continue
                if self._digests.get(voice_id) == source_digest(audio, transcript):
                    continue  # registered already, unchanged
            upload = VoiceUpload(audio=audio, transcript=transcript, voice_id=voice_id, name=voice_id)
            try:
                await self.register(upload, source="assets", replace_existing=existing is not None)
            except VoiceUploadError as exc:
                log.warning("voice asset %s skipped: %s (%s)", wav, exc.message, exc.code)

    # -- deleting -------------------------------------------------------------

    async def delete(self, voice_id: str) -> None:
        """Forget a registered voice; whoever holds it keeps it until they let go."""
        async with self._lock:
            if voice_id in self.registered:
                await self._delete_stored(voice_id)
                del self.registered[voice_id]
                self._digests.pop(voice_id, None)
                await self.engine.retire_voice(voice_id)
                if self.catalog.retire(voice_id):  # nobody holds it: gone at once
                    await self._remove(voice_id)
            elif voice_id in self.unavailable:
                await self._delete_stored(voice_id)
                del self.unavailable[voice_id]
            elif voice_id in self.installed:
                raise VoiceUploadError(409, "builtin_voice", f"{voice_id!r} is an installed voice; "
                                       "remove its model files to remove it")
            else:
                raise VoiceUploadError(404, "unknown_voice", f"no voice {voice_id!r} is registered")
        log.info("deleted voice %r", voice_id)

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
                "backend": info.backend, "sample_rate": info.sample_rate, "builtin": info.is_builtin,
                "supports_instructions": info.supports_instructions}

    def describe_registered(self, info: VoiceInfo, summary: dict[str, Any]) -> dict[str, Any]:
        out = {**summary, **self.describe_info(info), "registered": True}
        out["reference_language"] = summary["language"] or None  # what the upload said it speaks
        return out

    def listing(self) -> dict[str, Any]:
        voices = [{**self.describe_info(v), "registered": v.voice_id in self.registered}
                  for v in self.engine.voices]
        unavailable = [{"id": k, "code": c, "message": m} for k, (c, m) in sorted(self.unavailable.items())]
        return {"voices": voices, "default": self.config.default_voice, "unavailable": unavailable}

    async def describe(self, voice_id: str) -> dict[str, Any]:
        if voice_id in self.unavailable:
            code, message = self.unavailable[voice_id]
            raise VoiceUploadError(409, code, message)
        info = next((v for v in self.engine.voices if v.voice_id == voice_id), None)
        if info is None:
            raise VoiceUploadError(404, "unknown_voice", f"no voice {voice_id!r}")
        if voice_id not in self.registered:
            return {**self.describe_info(info), "registered": False}
        try:
            record = await self.registry.get(voice_id)
        except CorruptRecordError as exc:
            raise VoiceUploadError(exc.status, exc.code, str(exc)) from None
        if record is None:
            raise VoiceUploadError(404, "unknown_voice", f"no voice {voice_id!r}")
        return self.describe_registered(info, record.summary())


# -- routes -------------------------------------------------------------------

def _service(request: Request) -> VoiceService:
    service: VoiceService = request.app.state.voice_service
    return service


async def list_voices(request: Request) -> Response:
    return JSONResponse(_service(request).listing())


async def create_voice(request: Request) -> Response:
    service = _service(request)
    try:
        body = await service.register(await read_upload(request, service.config.limits))
    except VoiceUploadError as exc:
        return http_error(exc.status, exc.code, exc.message)
    return JSONResponse(body, status_code=201)


async def get_voice(request: Request) -> Response:
    try:
        return JSONResponse(await _service(request).describe(request.path_params["voice_id"]))
    except VoiceUploadError as exc:
        return http_error(exc.status, exc.code, exc.message)


async def delete_voice(request: Request) -> Response:
    voice_id = request.path_params["voice_id"]
    try:
        await _service(request).delete(voice_id)
    except VoiceUploadError as exc:
        return http_error(exc.status, exc.code, exc.message)
    return JSONResponse({"id": voice_id, "deleted": True})


def voice_routes() -> list[Route]:
    return [
        Route("/v1/voices", list_voices, methods=["GET"]),
        Route("/v1/voices", create_voice, methods=["POST"]),
        Route("/v1/voices/{voice_id}", get_voice, methods=["GET"]),
        Route("/v1/voices/{voice_id}", delete_voice, methods=["DELETE"]),
    ]


__all__ = ["VOICE_ID_RE", "VoiceConfig", "VoiceService", "voice_routes"]
