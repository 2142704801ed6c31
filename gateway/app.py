"""The ASGI application: routes, the shared engine's lifespan, static web client."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from engine.backends import create_backend
from engine.client import EngineClient
from engine.engine import Engine, EngineConfig
from engine.errors import VoxgateError
from engine.scheduler import SchedulerConfig
from gateway.access.guard import AccessGuard
from gateway.access.redaction import install_log_redaction
from gateway.access.tokens import SessionTokens
from gateway.compat import compat_routes
from gateway.config import GatewayConfig, load_config
from gateway.http.speech import speech_endpoint
from gateway.http.tokens import create_session_token
from gateway.metrics import Metrics
from gateway.state import AppState
from gateway.stream.endpoint import stream_endpoint
from gateway.voices.routes import voice_routes
from gateway.voices.service import VoiceConfig, VoiceService

log = logging.getLogger("voxgate.gateway")

# The browser client: web/ beside the package in a source tree, gateway/web in an installed wheel.
_WEB_DIRS = (Path(__file__).resolve().parent.parent / "web",
             Path(__file__).resolve().parent / "web")
WEB_DIR = next((d for d in _WEB_DIRS if (d / "index.html").is_file()), _WEB_DIRS[0])


async def drain(state: AppState, grace_s: float) -> None:
    """Graceful shutdown: refuse new work, let open contexts finish, close sockets with 1001."""
    import asyncio
    import time

    state.is_shutting_down = True
    deadline = time.monotonic() + grace_s
    while state.num_open_contexts() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log.info("shutdown: %d contexts still open after the grace period", state.num_open_contexts())
    for connection in list(state.connections):
        connection.close_going_away()
    end = time.monotonic() + 2.0
    while state.connections and time.monotonic() < end:
        await asyncio.sleep(0.05)


class StartupErrors:
    """Startup failures the operator can fix (a bad model directory, a missing voice) are
    reported as their one-line message, not as a traceback (ASGI middleware).

    Starlette answers a failed lifespan startup with `lifespan.startup.failed`
    carrying the traceback, which uvicorn prints; this rewrites that message
    while the exception is being handled. Anything else keeps its traceback.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_plain(message: dict[str, Any]) -> None:
            exc = sys.exc_info()[1]
            if message["type"] == "lifespan.startup.failed" and isinstance(
                    exc, (VoxgateError, SystemExit)):
                message = {**message, "message": f"voxgate cannot start: {exc}"}
            await send(message)

        await self.app(scope, receive, send_plain)


class WebFiles(StaticFiles):
    """The web client, revalidated on every load so an upgrade reaches browsers at once."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def build_engine(config: GatewayConfig) -> Engine:
    options = dict(config.engine_options)
    if config.max_batch_size:  # else the engine's own default, sized for its device
        options.setdefault("max_batch_size", config.max_batch_size)
    if config.engine == "piper":  # Piper models dropped into <data_dir>/voices/ (docs/voices.md)
        voices_dir = config.data_dir / "voices"
        with contextlib.suppress(OSError):
            voices_dir.mkdir(parents=True, exist_ok=True)
        if voices_dir.is_dir():
            options.setdefault("voices_dir", voices_dir)
    backend = create_backend(config.engine, **options)
    scheduler = SchedulerConfig(policy=config.scheduler_policy,
                                max_batch_size=config.max_batch_size or backend.max_batch_size,
                                max_contexts=config.max_contexts)
    return Engine(backend, EngineConfig(scheduler=scheduler))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    state: AppState = request.app.state.voxgate
    ready = state.engine.is_ready and state.engine.is_healthy and not state.is_shutting_down
    body: dict[str, Any] = {"ready": ready, "engine": state.engine.backend_name}
    degraded = request.app.state.voice_service.degraded  # serving, but something needs a look
    if degraded:
        body["degraded"] = degraded
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.voxgate
    return PlainTextResponse(state.metrics.render(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(config: GatewayConfig | None = None,
               engine: EngineClient | None = None) -> Starlette:
    """The voxgate app. `engine` may be given (tests inject a scripted backend; Ray Serve and
    `--workers` a remote one)."""
    config = config or load_config()
    engine = engine or build_engine(config)
    state = AppState(config, engine, Metrics(engine),
                     session_tokens=SessionTokens(ttl_s=config.session_token_ttl_s))
    voice_service = VoiceService(VoiceConfig.from_gateway(config), engine, state.catalog)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        install_log_redaction()  # also under a plain `uvicorn --factory` (the CLI installs it too)
        await engine.start()
        await voice_service.start()  # registered voices join the engine's list
        voices = {v.voice_id for v in engine.voices}
        if config.voice not in voices:
            raise SystemExit(f"default voice {config.voice!r} is not loaded; have: "
                             f"{', '.join(sorted(voices))}")
        for language, voice in config.voice_for.items():
            if voice not in voices:
                raise SystemExit(f"--voice-for {language}={voice}: no voice {voice!r} is loaded; "
                                 f"have: {', '.join(sorted(voices))}")
        try:
            yield
        finally:
            state.is_shutting_down = True
            await voice_service.stop()
            await engine.stop()
            state.encoding.close()

    routes: list[Any] = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        *voice_routes(),
        Route("/v1/audio/speech", speech_endpoint, methods=["POST"]),
        Route("/v1/session-tokens", create_session_token, methods=["POST"]),
        WebSocketRoute("/v1/stream", stream_endpoint),
        *compat_routes(),  # ElevenLabs-, Cartesia- and Deepgram-compatible sockets (docs/compat.md)
    ]
    web_dir = config.web_dir or WEB_DIR
    if web_dir.is_dir():
        routes.append(Mount("/", WebFiles(directory=web_dir, html=True), name="web"))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(AccessGuard, state=state)
    app.add_middleware(StartupErrors)
    app.state.voxgate = state
    app.state.voice_service = voice_service
    return app
