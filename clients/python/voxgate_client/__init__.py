"""voxgate-client: speak an LLM's token stream through a voxgate server, barge in, and learn
what the listener heard. docs/client.md is the guide; docs/protocol.md the wire contract.

    async with AsyncVoxgate("ws://127.0.0.1:8000/v1/stream") as vg:
        turn = vg.speak(deltas)
        async for chunk in turn:
            ...

Modules: session (AsyncVoxgate), turn (Turn, Heard, TurnListener), wire (frames and
events), audio (AudioChunk, decoders), player (Player, sinks), speakers (the sound
device, key_press), clock (PlaybackClock), backoff (Reconnect), errors, sync (Voxgate).
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
from voxgate_client.player import ListSink, Player, Sink
from voxgate_client.session import AsyncVoxgate
from voxgate_client.speakers import Speakers, key_press
from voxgate_client.sync import SyncTurn, Voxgate
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
    "ListSink",
    "MissingExtra",
    "NoAnswer",
    "PlaybackClock",
    "Player",
    "RateLimited",
    "Reconnect",
    "Segment",
    "ServerError",
    "Sink",
    "Speakers",
    "SyncTurn",
    "TextSkipped",
    "Turn",
    "TurnListener",
    "TurnState",
    "Unauthorized",
    "Voxgate",
    "VoxgateError",
    "Word",
    "key_press",
]
