"""Vendor-compatible sockets (ElevenLabs, Cartesia, Deepgram) over the native session.

docs/compat.md: the one line each client changes, and what differs from the vendor.
"""

from __future__ import annotations

from starlette.routing import WebSocketRoute


def compat_routes() -> list[WebSocketRoute]:
    """The vendor sockets' routes, added beside `/v1/stream` by gateway/app.py."""
    from gateway.compat import cartesia, deepgram, elevenlabs

    return [
        WebSocketRoute("/v1/text-to-speech/{voice_id}/stream-input",
                       elevenlabs.stream_input_endpoint),
        WebSocketRoute("/v1/text-to-speech/{voice_id}/multi-stream-input",
                       elevenlabs.multi_stream_input_endpoint),
        WebSocketRoute("/tts/websocket", cartesia.websocket_endpoint),
        WebSocketRoute("/v1/speak", deepgram.speak_endpoint),
    ]


__all__ = ["compat_routes"]
