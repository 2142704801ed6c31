"""The voice registry's HTTP face and its wiring to the engine (docs/voices.md).

`VoiceService` owns the registered voices of one process: at start-up it loads
them from the store (features as stored, nothing recomputed unless the
backend's features version changed) and registers the assets folder; at run
time it registers and deletes voices for `/v1/voices`. Each voice change runs
in the engine's worker thread (backends need no locks) under one asyncio lock,
so concurrent registrations and deletes never interleave.

Deleting a voice retires it at once: it leaves the list, new sessions and
HTTP requests get `unknown_voice`, but a socket that holds it (its current
voice, or an open context's) keeps speaking with it. A sweep forgets retired
voices once no socket holds them.
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

from engine.backend import Backend
from engine.engine import Engine
from engine.errors import EngineError, UnknownVoiceError, UnsupportedOptionError
from engine.types import VoiceInfo
from gateway.registry import (
    CorruptRecordError,
    RegistryError,
    VoiceExistsError,
    VoiceRecord,
    VoiceRegistry,
    source_digest,
)
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
    sweep_interval_s: float = 2.0

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.assets_dir is not None:
            self.assets_dir = Path(self.assets_dir)
        if self.sweep_interval_s <= 0:
            raise ValueError(f"sweep_interval_s must be > 0, got {self.sweep_interval_s}")

    @classmethod
    def from_gateway(cls, config: Any, environ: dict[str, str] | None = None) -> VoiceConfig:
        env = os.environ if environ is None else environ
        assets = getattr(config, "voice_assets", None) or env.get("VOXGATE_VOICE_ASSETS") or None
        return cls(data_dir=config.data_dir, assets_dir=Path(assets) if assets else None,
                   default_voice=config.voice)


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=status)


def _store_failed() -> VoiceUploadError:
    return VoiceUploadError(503, "registry_unavailable", "the voice store could not be written; "
                            "the server logged why; try again later")


def _can_register(backend: Backend) -> bool:
    return type(backend).add_voice is not Backend.add_voice


class VoiceService:
    """Registered voices of this process: store, engine and sessions kept in step."""

    def __init__(self, config: VoiceConfig, engine: Engine, app_state: Any = None) -> None:
        self.config = config
        self.engine = engine
        self.app_state = app_state
        self.registry = VoiceRegistry(config.data_dir)
        self.registered: dict[str, dict[str, Any]] = {}  # id -> record summary (no audio)
        self._digests: dict[str, str] = {}  # id -> source digest (assets re-register on change)
        self.unavailable: dict[str, tuple[str, str]] = {}  # id -> (code, message)
        self.retired: set[str] = set()
        self.installed: set[str] = set()
        self.num_features_computed = 0
        self._lock = asyncio.Lock()
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def backend(self) -> Backend:
        return self.engine.backend

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Open the store, load its voices into the engine, register the assets folder."""
        self.installed = {v.voice_id for v in self.engine.voices}
        if not _can_register(self.backend):
            # Nothing to serve from the store, so none is created (tests with scripted engines).
            log.info("the %s backend cannot register voices; the voice registry is off",
                     self.backend.name)
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
        self.engine.refresh_voices()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="voxgate-voice-sweep")
        log.info("voice registry %s: %d registered, %d unavailable", self.registry.path,
                 len(self.registered), len(self.unavailable))

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.registry.close()

    async def _load(self, record: VoiceRecord) -> None:
        backend = self.backend
        try:
            stored = await self.registry.get_features(record.voice_id, backend.name,
                                                      backend.voice_features_version)
        except CorruptRecordError as exc:
            log.warning("%s; recomputing them from the stored audio", exc)
            stored = None
        try:
            if stored is None:
                reference = await asyncio.to_thread(decode_reference, record.audio, self.config.limits)
                features = await self._features(reference, record.transcript)
                await self.registry.put_features(record.voice_id, backend.name,
                                                 backend.voice_features_version, features)
            else:
                features = stored.features
            await self._add_to_engine(record, features)
        except (VoiceUploadError, EngineError, ValueError) as exc:
            message = getattr(exc, "message", None) or str(exc)
            log.error("registered voice %r not served: %s", record.voice_id, message)
            self.unavailable[record.voice_id] = ("voice_unavailable", message)
            return
        self.registered[record.voice_id] = record.summary()
        self._digests[record.voice_id] = record.source_digest

    async def _features(self, reference: ReferenceAudio, transcript: str) -> bytes | None:
        try:
            features = await self.engine.run_in_worker(
                self.backend.make_voice_features, reference.pcm, reference.sample_rate, transcript)
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
        return await self.engine.run_in_worker(self.backend.add_voice, record.voice_id, features, meta)

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
        if not _can_register(self.backend):
            raise VoiceUploadError(400, "unsupported_option",
                                   f"the {self.backend.name} engine cannot register voices")
        check_fields(upload, self.config.limits, needs_transcript=self.backend.needs_transcript)
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
            except (EngineError, ValueError) as exc:
                code = exc.code if isinstance(exc, (UnknownVoiceError, UnsupportedOptionError)) else "bad_voice"
                raise VoiceUploadError(400, code, str(exc)) from None
            try:
                await self.registry.insert(record, (self.backend.name, self.backend.voice_features_version,
                                                    features), replace_existing=replace_existing)
            except VoiceExistsError as exc:  # another process took the id meanwhile
                await self.engine.run_in_worker(self.backend.remove_voice, voice_id)
                raise VoiceUploadError(409, "voice_exists", str(exc)) from None
            except (sqlite3.Error, OSError):  # disk full, read-only, locked too long
                log.exception("storing voice %r failed", voice_id)
                await self.engine.run_in_worker(self.backend.remove_voice, voice_id)
                raise _store_failed() from None
            self.retired.discard(voice_id)
            self.unavailable.pop(voice_id, None)
            self.registered[voice_id] = record.summary()
            self._digests[voice_id] = record.source_digest
            self.engine.refresh_voices()
            self._update_sessions(add=voice_id)
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
        """Forget a registered voice; sockets holding it keep it until they let go."""
        async with self._lock:
            if voice_id in self.registered:
                await self._delete_stored(voice_id)
                del self.registered[voice_id]
                self._digests.pop(voice_id, None)
                await self.engine.run_in_worker(self.backend.retire_voice, voice_id)
                self.retired.add(voice_id)
                self.engine.refresh_voices()
                self._update_sessions(remove=voice_id)
            elif voice_id in self.unavailable:
                await self._delete_stored(voice_id)
                del self.unavailable[voice_id]
            elif voice_id in self.installed:
                raise VoiceUploadError(409, "builtin_voice", f"{voice_id!r} is an installed voice; "
                                       "remove its model files to remove it")
            else:
                raise VoiceUploadError(404, "unknown_voice", f"no voice {voice_id!r} is registered")
        log.info("deleted voice %r", voice_id)
        await self.sweep()

    async def _delete_stored(self, voice_id: str) -> None:
        try:
            await self.registry.delete(voice_id)
        except (sqlite3.Error, OSError):
            log.exception("deleting voice %r failed", voice_id)
            raise _store_failed() from None

    def _sessions(self) -> list[Any]:
        connections = getattr(self.app_state, "connections", None) or ()
        return [s for s in (getattr(c, "session", None) for c in list(connections)) if s is not None]

    def _update_sessions(self, *, add: str | None = None, remove: str | None = None) -> None:
        """Open sockets may switch to a new voice, and no longer to a deleted one."""
        for session in self._sessions():
            voice_ids = getattr(session, "voice_ids", None)
            if isinstance(voice_ids, set):
                if add is not None:
                    voice_ids.add(add)
                if remove is not None:
                    voice_ids.discard(remove)

    def _held_voices(self) -> set[str]:
        held: set[str] = set()
        for session in self._sessions():
            options = getattr(session, "options", None)
            held.add(getattr(options, "voice", ""))
            for context in list(getattr(session, "contexts", {}).values()):
                held.add(getattr(getattr(context, "options", None), "voice", ""))
        return held

    async def sweep(self) -> None:
        """Forget retired voices that no socket holds any more."""
        async with self._lock:
            for voice_id in sorted(self.retired - self._held_voices()):
                self.retired.discard(voice_id)
                with contextlib.suppress(UnknownVoiceError):
                    await self.engine.run_in_worker(self.backend.remove_voice, voice_id)
                log.info("released deleted voice %r", voice_id)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            if self.retired:
                try:
                    await self.sweep()
                except Exception:  # the sweep retries; it must not die
                    log.exception("voice sweep failed")

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
            raise VoiceUploadError(409, "corrupt_voice", str(exc)) from None
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
        upload = await read_upload(request, service.config.limits)
        body = await service.register(upload)
    except VoiceUploadError as exc:
        return _error(exc.status, exc.code, exc.message)
    return JSONResponse(body, status_code=201)


async def get_voice(request: Request) -> Response:
    try:
        return JSONResponse(await _service(request).describe(request.path_params["voice_id"]))
    except VoiceUploadError as exc:
        return _error(exc.status, exc.code, exc.message)


async def delete_voice(request: Request) -> Response:
    voice_id = request.path_params["voice_id"]
    try:
        await _service(request).delete(voice_id)
    except VoiceUploadError as exc:
        return _error(exc.status, exc.code, exc.message)
    return JSONResponse({"id": voice_id, "deleted": True})


def voice_routes() -> list[Route]:
    return [
        Route("/v1/voices", list_voices, methods=["GET"]),
        Route("/v1/voices", create_voice, methods=["POST"]),
        Route("/v1/voices/{voice_id}", get_voice, methods=["GET"]),
        Route("/v1/voices/{voice_id}", delete_voice, methods=["DELETE"]),
    ]


__all__ = ["VOICE_ID_RE", "VoiceConfig", "VoiceService", "voice_routes"]
