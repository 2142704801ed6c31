"""voxgate-client: speak an LLM's token stream through a voxgate server, barge in, and learn
what the listener heard. docs/client.md is the guide; docs/protocol.md the wire contract.

    async with AsyncVoxgate("ws://127.0.0.1:8000/v1/stream") as vg:
        turn = vg.speak(deltas)
        async for chunk in turn:
            ...
"""

from __future__ import annotations

from voxgate_client.audio import AudioChunk, MissingExtra
from voxgate_client.backoff import Reconnect
from voxgate_client.clock import PlaybackClock
from voxgate_client.errors import (
    Busy,
    ConnectionLost,
    ContextClosed,
    NoAnswer,
    RateLimited,
    ServerError,
    Unauthorized,
    VoxgateError,
)
from voxgate_client.session import AsyncVoxgate
from voxgate_client.turn import Heard, Turn, TurnListener, TurnState
from voxgate_client.wire import Audio, Cancelled, Done, Segment, TextSkipped, Word

__version__ = "0.1.0"

__all__ = [
    "AsyncVoxgate",
    "Audio",
    "AudioChunk",
    "Busy",
    "Cancelled",
    "ConnectionLost",
    "ContextClosed",
    "Done",
    "Heard",
    "MissingExtra",
    "NoAnswer",
    "PlaybackClock",
    "RateLimited",
    "Reconnect",
    "Segment",
    "ServerError",
    "TextSkipped",
    "Turn",
    "TurnListener",
    "TurnState",
    "Unauthorized",
    "VoxgateError",
    "Word",
]
