"""Exchanges on the vendor-compatible sockets that several end-to-end tests make."""

from __future__ import annotations

import asyncio
import json
from typing import Any


async def deepgram_speak(ws: Any, text: str, timeout: float = 60.0) -> bytes:
    """Send `text` as a Deepgram Speak, then Flush; the audio that came before Flushed."""
    await ws.send(json.dumps({"type": "Speak", "text": text}))
    await ws.send(json.dumps({"type": "Flush"}))
    audio = b""
    while True:
        frame = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(frame, bytes):
            audio += frame
        elif json.loads(frame)["type"] == "Flushed":
            return audio
