"""The ASGI application: routes, the shared engine's lifespan, static web client."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from engine.backends import create_backend
from engine.engine import Engine, EngineConfig
from engine.scheduler import SchedulerConfig
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.speech import speech_endpoint
from gateway.ws import stream_endpoint

log = logging.getLogger("voxgate.gateway")

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


@dataclass(slots=True)
class AppState:
    config: GatewayConfig
    engine: Engine
    metrics: Metrics
    connections: set[Any] = field(default_factory=set)
    is_shutting_down: bool = False


def build_engine(config: GatewayConfig) -> Engine:
    options = dict(config.engine_options)
    options.setdefault("max_batch_size", config.max_batch_size)
    backend = create_backend(config.engine, **options)
    scheduler = SchedulerConfig(max_batch_size=config.max_batch_size, max_contexts=config.max_contexts)
    return Engine(backend, EngineConfig(scheduler=scheduler))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    state: AppState = request.app.state.voxgate
    ready = state.engine.is_ready and not state.is_shutting_down
    return JSONResponse({"ready": ready, "engine": state.engine.backend.name},
                        status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.voxgate
    return PlainTextResponse(state.metrics.render(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def list_voices(request: Request) -> Response:
    state: AppState = request.app.state.voxgate
    voices = [{"id": v.voice_id, "name": v.name, "language": v.language, "backend": v.backend,
               "sample_rate": v.sample_rate, "builtin": v.is_builtin,
               "supports_instructions": v.supports_instructions} for v in state.engine.voices]
    return JSONResponse({"voices": voices, "default": state.config.voice})


def create_app(config: GatewayConfig | None = None, engine: Engine | None = None) -> Starlette:
    """The voxgate app. `engine` may be given (tests inject a scripted backend)."""
    config = config or GatewayConfig.from_env()
    engine = engine or build_engine(config)
    state = AppState(config, engine, Metrics(engine))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        voices = {v.voice_id for v in engine.voices}
        if config.voice not in voices:
            raise SystemExit(f"default voice {config.voice!r} is not loaded; have: {', '.join(sorted(voices))}")
        try:
            yield
        finally:
            state.is_shutting_down = True
            await engine.stop()

    routes: list[Any] = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        Route("/v1/voices", list_voices, methods=["GET"]),
        Route("/v1/audio/speech", speech_endpoint, methods=["POST"]),
        WebSocketRoute("/v1/stream", stream_endpoint),
    ]
    web_dir = config.web_dir or WEB_DIR
    if web_dir.is_dir():
        routes.append(Mount("/", StaticFiles(directory=web_dir, html=True), name="web"))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.voxgate = state
    return app
