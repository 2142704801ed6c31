"""Socket settings over a real voxgate: no permessage-deflate unless the operator turns it on,
and `frames_per_message` packing more Opus packets into each audio message, decoded by
voxgate-client."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import websockets

from gateway.stream.playout import FRAMES_PER_MESSAGE
from tests.support.server import ServerProcess, start_server
from voxgate_client import AsyncVoxgate, AudioChunk, Turn

TEXT = ("This is the first sentence of a longer answer, spoken in full. "
        "And here is a second sentence, so that the voice makes windows of some length.")
PRE_SKIP_MS = 312 / 48  # libopus' lookahead, dropped by the decoder


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


async def negotiated(url: str) -> tuple[str | None, list[Any]]:
    """What a client offering permessage-deflate (the websockets default, as browsers) got."""
    async with websockets.connect(url, compression="deflate") as ws:
        assert ws.response is not None
        await ws.recv()  # session.ready
        return ws.response.headers.get("Sec-WebSocket-Extensions"), list(ws.protocol.extensions)


def test_a_client_offering_deflate_gets_none_by_default(server: ServerProcess) -> None:
    header, extensions = run(negotiated(server.ws_url))
    assert header is None and extensions == []


def test_the_operator_may_turn_deflate_on(tmp_path: Path) -> None:
    server = start_server(tmp_path, env={"VOXGATE_WS_PER_MESSAGE_DEFLATE": "true"})
    try:
        header, extensions = run(negotiated(server.ws_url))
    finally:
        server.stop()
    assert header is not None and header.startswith("permessage-deflate")
    assert [e.name for e in extensions] == ["permessage-deflate"]


async def spoken(url: str, audio: str, **options: Any) -> tuple[Turn, list[AudioChunk]]:
    async with AsyncVoxgate(url, audio=audio, **options) as vg:
        turn = vg.speak(TEXT)
        chunks = [chunk async for chunk in turn]
        assert turn.done is not None
        return turn, chunks


@pytest.mark.parametrize("frames", [FRAMES_PER_MESSAGE, 25])
def test_packed_opus_messages_decode_to_the_whole_turn(server: ServerProcess, frames: int) -> None:
    _, raw = run(spoken(server.ws_url, "raw", frames_per_message=frames))
    sizes = [len(chunk.packets or []) for chunk in raw]
    assert max(sizes) == frames, sizes  # packed up to the option, never past it
    if frames > FRAMES_PER_MESSAGE:
        assert len(raw) < sum(sizes) / FRAMES_PER_MESSAGE  # fewer messages than by default
    turn, chunks = run(spoken(server.ws_url, "float32", frames_per_message=frames))
    assert turn.done is not None
    pcm = np.concatenate([c.pcm for c in chunks if c.pcm is not None])
    assert len(pcm) / 48 == pytest.approx(turn.done.audio_ms - PRE_SKIP_MS, abs=0.5)
    assert float(np.sqrt(np.mean(pcm**2))) > 0.01  # speech, not silence


def test_with_the_encode_thread_on_a_turn_decodes_whole_as_on_the_loop(tmp_path: Path) -> None:
    # off by default (docs/operations.md); the operator's switch gives the same audio
    threaded = start_server(tmp_path, env={"VOXGATE_ENCODE_ON_THREAD": "true"})
    try:
        turn, chunks = run(spoken(threaded.ws_url, "float32"))
    finally:
        threaded.stop()
    assert turn.done is not None
    pcm = np.concatenate([c.pcm for c in chunks if c.pcm is not None])
    assert len(pcm) / 48 == pytest.approx(turn.done.audio_ms - PRE_SKIP_MS, abs=0.5)
    assert [c.pts_ms for c in chunks] == sorted(c.pts_ms for c in chunks)
    assert float(np.sqrt(np.mean(pcm**2))) > 0.01  # speech, not silence
