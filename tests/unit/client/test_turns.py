"""Turns on one socket, against a scripted WebSocket server on loopback.

The real server never interleaves two turns' audio and never sends more than a
player takes; a script can, so routing, the queue's bound and the client's own
messages are driven here (tests/e2e/test_client.py runs the real server).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest
from websockets.asyncio.server import ServerConnection, serve

from voxgate_client import AsyncVoxgate, Audio, TurnListener, TurnState

READY = json.dumps({"type": "session.ready", "session_id": "s1", "protocol": 1,
                    "options": {"codec": "opus", "sample_rate": 48000}, "limits": {}})
Script = Callable[[ServerConnection, list[dict[str, Any]]], Awaitable[None]]


def audio(context_id: str, seq: int, ms: float = 20.0) -> bytes:
    return msgpack.packb({"type": "audio", "context_id": context_id, "seq": seq,
                          "pts_ms": seq * ms, "duration_ms": ms, "codec": "opus",
                          "packets": [b"\x00"]})


def event(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"type": kind, **fields})


async def next_message(ws: ServerConnection, received: list[dict[str, Any]]) -> dict[str, Any]:
    frame = await ws.recv()
    message = msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame)
    received.append(message)
    return dict(message)


def play(script: Script, client: Callable[[AsyncVoxgate], Awaitable[None]],
         **options: Any) -> list[dict[str, Any]]:
    """Run `client` on a session to a server that runs `script`; return what it received."""
    received: list[dict[str, Any]] = []

    async def handler(ws: ServerConnection) -> None:
        await ws.send(READY)
        await script(ws, received)
        await ws.wait_closed()

    async def main() -> None:
        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            async with AsyncVoxgate(f"ws://127.0.0.1:{port}", audio="raw", **options) as vg:
                await client(vg)

    asyncio.run(asyncio.wait_for(main(), 30))
    return received


def test_interleaved_events_reach_their_own_turns() -> None:
    async def script(ws: ServerConnection, received: list[dict[str, Any]]) -> None:
        await next_message(ws, received)
        await next_message(ws, received)
        for seq in range(3):
            await ws.send(audio("a", seq))
            await ws.send(audio("b", seq))
        await ws.send(event("context.done", context_id="b", audio_ms=60.0, segments=1))
        await ws.send(event("context.done", context_id="a", audio_ms=60.0, segments=1))

    async def client(vg: AsyncVoxgate) -> None:
        a, b = vg.speak("one", context_id="a"), vg.speak("two", context_id="b")
        got_a = [(c.context_id, c.pts_ms) async for c in a]
        got_b = [(c.context_id, c.pts_ms) async for c in b]
        assert got_a == [("a", 0.0), ("a", 20.0), ("a", 40.0)]
        assert got_b == [("b", 0.0), ("b", 20.0), ("b", 40.0)]

    received = play(script, client)
    assert [m["context_id"] for m in received] == ["a", "b"]
    assert all(m["type"] == "text" and m["flush"] for m in received)


def test_a_turn_nobody_reads_holds_a_bounded_queue_and_the_reader_waits() -> None:
    sent = asyncio.Event()

    async def script(ws: ServerConnection, received: list[dict[str, Any]]) -> None:
        await next_message(ws, received)
        for seq in range(300):  # 30 s of audio, far past the bound
            await ws.send(audio("t1", seq, ms=100.0))
        await ws.send(event("context.done", context_id="t1", audio_ms=30000.0, segments=1))
        sent.set()

    async def client(vg: AsyncVoxgate) -> None:
        turn = vg.speak("a long answer")
        await asyncio.sleep(0.5)  # the server sends as fast as the socket takes it
        assert turn._queued_ms <= 1000.0 + 100.0  # the bound and one message
        assert len(turn._queue) <= 11
        seqs = [c.pts_ms async for c in turn]  # reading resumes the socket
        assert len(seqs) == 300 and seqs == [100.0 * n for n in range(300)]
        assert turn.state is TurnState.DONE and sent.is_set()

    play(script, client, max_queued_ms=1000.0)


def test_a_listener_gets_every_event_as_read_and_nothing_is_queued() -> None:
    class Recorder(TurnListener):
        def __init__(self) -> None:
            self.events: list[str] = []

        def on_audio(self, event: Audio) -> None:
            self.events.append(f"audio {event.seq} {event.received_at > 0}")

        def on_done(self, event: Any) -> None:
            self.events.append("done")

        def on_error(self, error: Any) -> None:
            self.events.append(f"error {error.code}")

    async def script(ws: ServerConnection, received: list[dict[str, Any]]) -> None:
        await next_message(ws, received)
        await ws.send(audio("t1", 0))
        await ws.send(audio("t1", 1))
        await ws.send(event("context.done", context_id="t1", audio_ms=40.0, segments=1))
        await ws.send(event("error", code="context_closed", message="late", context_id="t1",
                            fatal=False))

    async def client(vg: AsyncVoxgate) -> None:
        recorder = Recorder()
        turn = vg.speak("hi", listener=recorder)
        await turn.ended.wait()
        await asyncio.sleep(0.2)  # the late error too
        assert recorder.events == ["audio 0 True", "audio 1 True", "done", "error context_closed"]
        assert turn.state is TurnState.DONE and not turn._queue
        assert [c async for c in turn] == []

    play(script, client)


def test_a_cancel_before_any_text_sends_nothing_and_one_after_waits_for_the_answer() -> None:
    async def script(ws: ServerConnection, received: list[dict[str, Any]]) -> None:
        await next_message(ws, received)  # the second turn's text
        await ws.send(audio("t2", 0))
        cancel = await next_message(ws, received)
        await ws.send(audio("t2", 1))  # in flight when the cancel came: dropped by the client
        await ws.send(event("cancelled", context_id="t2", audio_ms_sent=40.0,
                            played_ms=cancel["played_ms"], spoken_text="Hello",
                            unspoken_text="there."))

    async def client(vg: AsyncVoxgate) -> None:
        silent = vg.speak()
        heard = await silent.cancel()
        assert (heard.spoken_text, silent.state) == ("", TurnState.CANCELLED)
        turn = vg.speak()
        await turn.push("Hello there.")
        async for _ in turn:
            break
        heard = await turn.cancel(played_ms=12.34)
        assert (heard.spoken_text, heard.unspoken_text, heard.played_ms) == (
            "Hello", "there.", 12.3)
        assert [c async for c in turn] == []
        with pytest.raises(Exception, match="context_closed"):
            await turn.push("more")

    received = play(script, client)
    assert [m["type"] for m in received] == ["text", "cancel"]
    assert received[1] == {"type": "cancel", "context_id": "t2", "played_ms": 12.3}


def test_a_text_source_that_raises_fails_its_turn_and_stops_it_on_the_server() -> None:
    async def script(ws: ServerConnection, received: list[dict[str, Any]]) -> None:
        await next_message(ws, received)
        await next_message(ws, received)

    async def broken() -> Any:
        yield "Hello"
        raise RuntimeError("the LLM stream broke")

    async def client(vg: AsyncVoxgate) -> None:
        turn = vg.speak(broken())
        with pytest.raises(RuntimeError, match="the LLM stream broke"):
            async for _ in turn:
                pass
        assert turn.state is TurnState.FAILED
        await asyncio.sleep(0.2)

    received = play(script, client)
    assert [m["type"] for m in received] == ["text", "cancel"]


def test_a_fatal_session_error_fails_the_open_turns_and_reaches_on_error() -> None:
    seen: list[str] = []

    async def script(ws: ServerConnection, received: list[dict[str, Any]]) -> None:
        await next_message(ws, received)
        await ws.send(event("error", code="slow_consumer", message="not reading", fatal=True,
                            context_id=None))
        await ws.close(4408)

    async def client(vg: AsyncVoxgate) -> None:
        vg.on_error = lambda error: seen.append(error.code)
        turn = vg.speak("hi")
        with pytest.raises(Exception, match="slow_consumer"):
            async for _ in turn:
                pass
        await asyncio.sleep(0.1)
        assert not vg.is_connected

    play(script, client)
    assert seen == ["slow_consumer"]


def test_a_late_cancel_of_a_long_finished_turn_finds_its_answer() -> None:
    async def script(ws: ServerConnection, received: list[dict[str, Any]]) -> None:
        for _ in range(12):
            text = await next_message(ws, received)
            await ws.send(audio(text["context_id"], 0))
            await ws.send(event("context.done", context_id=text["context_id"], audio_ms=20.0,
                                segments=1))
        cancel = await next_message(ws, received)  # the server no longer remembers it either
        await ws.send(event("cancelled", context_id=cancel["context_id"], audio_ms_sent=None,
                            played_ms=None, spoken_text=None, unspoken_text=None))

    async def client(vg: AsyncVoxgate) -> None:
        first = vg.speak("Hello there.", context_id="t2")
        turns = [first] + [vg.speak("Hello there.") for _ in range(11)]
        assert len({t.context_id for t in turns}) == 12  # "t2" was taken: the counter skips it
        for turn in turns:
            assert [c.pts_ms async for c in turn] == [0.0]
        heard = await asyncio.wait_for(first.cancel(), 5)
        assert heard.is_cancelled and heard.unspoken_text == ""

    play(script, client)
