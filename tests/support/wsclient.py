"""A small protocol client for tests: a real `websockets` connection, decoded frames."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import websockets

from gateway.audio.codecs import decode_opus_packets


@dataclass
class Received:
    events: list[dict[str, Any]] = field(default_factory=list)
    audio: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str, context_id: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind
                and (context_id is None or e.get("context_id") == context_id)]

    def audio_of(self, context_id: str) -> list[dict[str, Any]]:
        return [a for a in self.audio if a["context_id"] == context_id]

    def opus_of(self, context_id: str) -> np.ndarray:
        """The context's Opus packets decoded: float PCM at 48 kHz."""
        return decode_opus_packets(
            [p for frame in self.audio_of(context_id) for p in frame["packets"]], 48000)


class Client:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.received = Received()

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> Client:
        ws = await websockets.connect(url, max_size=None, **kwargs)
        client = cls(ws)
        ready = await client.next_event()
        assert ready["type"] == "session.ready", ready
        return client

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(message))

    async def send_raw(self, frame: str | bytes) -> None:
        await self.ws.send(frame)

    async def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        frame = await asyncio.wait_for(self.ws.recv(), timeout)
        if isinstance(frame, bytes):
            message = msgpack.unpackb(frame, raw=False)
        else:
            message = json.loads(frame)
        if message["type"] == "audio":
            self.received.audio.append(message)
        else:
            self.received.events.append(message)
        return dict(message)

    async def next_event(self, timeout: float = 30.0) -> dict[str, Any]:
        while True:
            message = await self.recv(timeout)
            if message["type"] != "audio":
                return message

    async def until(self, kind: str, context_id: str | None = None,
                    timeout: float = 60.0) -> dict[str, Any]:
        """Read (recording everything) until an event of `kind` arrives."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            message = await self.recv(max(0.1, deadline - loop.time()))
            if message["type"] == kind and (context_id is None
                                            or message.get("context_id") == context_id):
                return message

    async def close(self) -> None:
        await self.ws.close()


async def speak(client: Client, context_id: str, text: str, *,
                words: bool = True) -> dict[str, Any]:
    """Send `text` as one-word deltas (or whole), flush, wait for context.done."""
    if words:
        parts = text.split(" ")
        for i, part in enumerate(parts):
            await client.send({"type": "text", "context_id": context_id,
                               "text": part + (" " if i < len(parts) - 1 else "")})
    else:
        await client.send({"type": "text", "context_id": context_id, "text": text})
    await client.send({"type": "flush", "context_id": context_id})
    return await client.until("context.done", context_id)


async def one_turn(url: str, context_id: str, text: str) -> Client:
    """Connect, speak `text` as one turn, close: the client holds what came back."""
    client = await Client.connect(url)
    await speak(client, context_id, text)
    await client.close()
    return client


def assert_lasts(received: Received, context_id: str, want_ms: float) -> None:
    """The context's audio lasts `want_ms`, to one 40 ms frame, by its context.done and by its
    decoded Opus, and is not silence."""
    done = received.of("context.done", context_id)[0]
    assert abs(done["audio_ms"] - want_ms) <= 40, (done["audio_ms"], want_ms)
    audio = received.opus_of(context_id)
    assert abs(len(audio) / 48 - want_ms) <= 40
    assert float(np.sqrt(np.mean(audio**2))) > 1e-3  # not silence
