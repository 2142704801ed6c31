"""`/v1/voices`: the voice registry's HTTP routes (docs/voices.md).

Each route acts for the principal the access guard found (gateway/access/guard.py),
which checked its key and Origin first: a tenant lists, reads and deletes its
own voices (and sees the operator's); an admin key reaches all. An upload's
body is read first, whole within `upload_timeout_s` (408 after); only then does
it take one of the service's upload places, so concurrent decodes stay bounded
(429 when full) and a body that never comes holds none.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.access.guard import principal
from gateway.errors import http_error
from gateway.voices.service import VoiceService
from gateway.voices.upload import VoiceUploadError, read_upload


def _service(request: Request) -> VoiceService:
    service: VoiceService = request.app.state.voice_service
    return service


async def list_voices(request: Request) -> Response:
    return JSONResponse(_service(request).listing(principal(request)))


async def create_voice(request: Request) -> Response:
    service = _service(request)
    try:
        upload = await read_upload(request, service.config.limits, service.config.upload_timeout_s)
        with service.upload_slot():
            body = await service.register(upload, owner=principal(request).tenant)
    except VoiceUploadError as exc:
        return http_error(exc.status, exc.code, exc.message)
    return JSONResponse(body, status_code=201)


async def get_voice(request: Request) -> Response:
    try:
        return JSONResponse(await _service(request).describe(request.path_params["voice_id"],
                                                             principal(request)))
    except VoiceUploadError as exc:
        return http_error(exc.status, exc.code, exc.message)


async def delete_voice(request: Request) -> Response:
    voice_id = request.path_params["voice_id"]
    try:
        await _service(request).delete(voice_id, principal(request))
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
