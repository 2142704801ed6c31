"""voxgate-client against a real voxgate on loopback: real sockets, real Opus decoded back.

A token stream speaks; a cancel at a known `played_ms` returns the words the
server's timings put before it; two turns on one socket keep their audio
apart; `busy` raises `Busy`; a server killed and started again on its port is
survived with reconnect on and raises without; the sync twin speaks; a
`Player` barges in at what it played and reports playback to the server.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.server import ServerProcess, start_server
from voxgate_client import (
    AsyncVoxgate,
    AudioChunk,
    Busy,
    ConnectionLost,
    ListSink,
    Player,
    Reconnect,
    Turn,
    TurnState,
    Unauthorized,
    Voxgate,
)

ANSWER = "Sure! The capital of France is Paris. It has been the capital since the tenth century."
LONG = " ".join(f"This is sentence number {n} of a long answer, and it keeps the voice busy."
                for n in range(1, 9))
PRE_SKIP_MS = 312 / 48  # libopus' lookahead, dropped by the decoder


def run(coro: Any, timeout: float = 120) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def deltas(text: str, pause_s: float = 0.005) -> AsyncIterator[str]:
    """An LLM's stream: word-sized deltas, a little apart."""
    for token in re.findall(r"\S+\s*", text):
        yield token
        await asyncio.sleep(pause_s)


def words(text: str) -> str:
    return " ".join(text.split())


async def collect(turn: Turn) -> list[AudioChunk]:
    return [chunk async for chunk in turn]


def check_turn_audio(turn_text: str, done_ms: float, segments: list[Any],
                     chunks: list[AudioChunk], rate: int = 48000) -> np.ndarray:
    """The chunks are the turn's speech, contiguous and whole: its segments say its text, its
    decoded samples last what `context.done` says less the pre-skip, and it is not silence."""
    assert words(" ".join(s.text for s in segments)) == words(turn_text)
    assert chunks and all(c.pcm is not None and c.sample_rate == rate for c in chunks)
    for before, after in itertools.pairwise(chunks):
        assert after.pts_ms == pytest.approx(before.pts_ms + before.duration_ms)
    pcm = np.concatenate([c.pcm for c in chunks if c.pcm is not None])
    assert len(pcm) * 1000 / rate == pytest.approx(done_ms - PRE_SKIP_MS, abs=0.5)
    assert float(np.sqrt(np.mean((pcm / 32768.0) ** 2))) > 0.01
    return pcm


def test_a_token_stream_speaks_with_real_opus_decoded(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncVoxgate(server.ws_url) as vg:
            turn = vg.speak(deltas(ANSWER))
            chunks = await collect(turn)
            assert turn.state is TurnState.DONE and turn.done is not None
            assert turn.text == ANSWER
            check_turn_audio(ANSWER, turn.done.audio_ms, turn.segments, chunks)
            # every word timing comes out with the chunk it starts in
            attached = [w for c in chunks for w in c.words]
            assert [w.word for w in attached] == ANSWER.split()
            for chunk in chunks:
                for w in chunk.words:
                    assert chunk.pts_ms <= w.start_ms + 1e-6 or chunk is chunks[0]
                    assert w.start_ms < chunk.pts_ms + chunk.duration_ms
            assert chunks[0].segment is not None and chunks[0].segment.text == "Sure!"

    run(scenario())


def test_float32_at_24_khz_resamples_the_opus_and_keeps_its_length(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncVoxgate(server.ws_url, audio="float32", sample_rate=24000) as vg:
            assert vg.options["sample_rate"] == 24000
            turn = vg.speak(ANSWER)
            chunks = await collect(turn)
            assert turn.done is not None
            pcm = np.concatenate([c.pcm for c in chunks if c.pcm is not None])
            assert pcm.dtype == np.float32 and 0.01 < float(np.abs(pcm).max()) <= 1.0
            assert len(pcm) / 24 == pytest.approx(turn.done.audio_ms - PRE_SKIP_MS, abs=0.5)

    run(scenario())


def test_cancel_at_a_known_played_ms_returns_the_heard_text_the_server_reports(
        server: ServerProcess) -> None:
    played_ms = 2600.0

    async def scenario() -> None:
        async with AsyncVoxgate(server.ws_url) as vg:
            turn = vg.speak(LONG)
            received = 0.0
            async for chunk in turn:
                received += chunk.duration_ms
                if received >= played_ms + 1000:
                    break
            heard = await turn.cancel(played_ms=played_ms)
            assert [c async for c in turn] == []  # no audio after the cancel
            assert turn.state is TurnState.CANCELLED
            assert heard.is_cancelled and heard.played_ms == played_ms
            assert heard.audio_ms_sent is not None and heard.audio_ms_sent >= played_ms
            # the words the segments' timings put before played_ms, as the protocol says
            expected: list[str] = []
            for segment in turn.segments:
                if segment.pts_ms >= played_ms:
                    continue
                assert segment.words is not None  # piper gives timings
                num_heard = sum(1 for w in segment.words if w.end_ms <= played_ms + 1e-6)
                expected += segment.text.split()[:num_heard]
            assert expected and heard.spoken_text == " ".join(expected)
            assert words(f"{heard.spoken_text} {heard.unspoken_text}") == words(LONG)

    run(scenario())


def test_two_turns_on_one_socket_keep_their_audio_apart(server: ServerProcess) -> None:
    first = "The first answer is about apples."
    second = "The second answer, which is longer, talks about oranges, pears and plums."

    async def scenario() -> None:
        async with AsyncVoxgate(server.ws_url) as vg:
            a = vg.speak(deltas(first))
            b = vg.speak(deltas(second))
            chunks_a, chunks_b = await asyncio.gather(collect(a), collect(b))
            assert a.done is not None and b.done is not None
            assert {c.context_id for c in chunks_a} == {a.context_id}
            assert {c.context_id for c in chunks_b} == {b.context_id}
            pcm_a = check_turn_audio(first, a.done.audio_ms, a.segments, chunks_a)
            pcm_b = check_turn_audio(second, b.done.audio_ms, b.segments, chunks_b)
            assert len(pcm_b) > len(pcm_a)
            # one after the other on the playback timeline: b's audio came after a's end
            assert chunks_b[0].received_at >= a.done.received_at

    run(scenario())


def test_busy_raises_busy_with_retry_advice(tmp_path: Path) -> None:
    proc = start_server(tmp_path, "--max-contexts", "1")

    async def scenario() -> None:
        async with AsyncVoxgate(proc.ws_url) as vg:
            holder = vg.speak()
            await holder.push("Hold this. And")  # reaches the engine, stays open
            advice = []
            for _ in range(2):
                refused = vg.speak()
                await refused.push("Hold this. And")
                with pytest.raises(Busy) as caught:
                    await collect(refused)
                assert caught.value.code == "busy"
                assert caught.value.context_id == refused.context_id
                assert refused.state is TurnState.FAILED
                advice.append(caught.value.retry_after_s)
            assert 0.5 <= advice[0] <= 1.0 <= advice[1] <= 2.0  # it grows, with jitter
            await holder.cancel()
            after = vg.speak("The engine is free again.")
            assert (await collect(after)) and after.state is TurnState.DONE

    try:
        run(scenario())
    finally:
        proc.stop()


@pytest.mark.parametrize("reconnect", [True, False], ids=["reconnect-on", "reconnect-off"])
def test_a_server_restart_mid_session(tmp_path: Path, reconnect: bool) -> None:
    """Killed with a turn in flight: that turn raises ConnectionLost either way; with
    reconnect on, the next turn speaks on the server started again on the same port."""
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    proc = start_server(tmp_path / "first")
    port = proc.port
    policy = Reconnect(max_attempts=None, base_s=0.2, max_s=1.0) if reconnect else False

    async def scenario() -> None:
        nonlocal proc
        async with AsyncVoxgate(proc.ws_url, reconnect=policy) as vg:
            first_id = vg.session_id
            assert (await collect(vg.speak("Before the restart."))) is not None
            in_flight = vg.speak()
            await in_flight.push(LONG[:200])
            async for _ in in_flight:
                break  # audio is coming: kill the server now
            proc.process.kill()
            proc.process.wait()
            with pytest.raises(ConnectionLost):
                await collect(in_flight)
            proc = await asyncio.to_thread(start_server, tmp_path / "second", port=port)
            after = vg.speak("After the restart.")
            if reconnect:
                chunks = await collect(after)
                assert chunks and after.state is TurnState.DONE
                assert vg.is_connected and vg.session_id != first_id
            else:
                with pytest.raises(ConnectionLost):
                    await collect(after)
                assert not vg.is_connected

    try:
        run(scenario(), timeout=180)
    finally:
        proc.stop()


def test_the_sync_twin_speaks_a_token_stream(server: ServerProcess) -> None:
    def sync_deltas() -> Iterator[str]:  # a blocking SDK's stream
        yield from re.findall(r"\S+\s*", ANSWER)

    with Voxgate(server.ws_url) as vg:
        turn = vg.speak(sync_deltas())
        chunks = list(turn)
        assert turn.state is TurnState.DONE and turn.done is not None
        check_turn_audio(ANSWER, turn.done.audio_ms, turn.segments, chunks)
        long_turn = vg.speak(LONG)
        for chunk in long_turn:
            if chunk.pts_ms > 1500:
                break
        heard = long_turn.cancel(played_ms=1000.0)
        assert heard.is_cancelled and heard.spoken_text and LONG.startswith(heard.spoken_text[:20])
    assert not vg.is_connected


def test_a_player_plays_a_turn_out_and_barges_in_at_what_it_played(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncVoxgate(server.ws_url) as vg:
            sink = ListSink()
            player = Player(sink, lead_ms=100)
            heard = await player.play(vg.speak("A short answer."))
            assert not heard.is_cancelled and heard.spoken_text == "A short answer."
            assert sum(c.duration_ms for c in sink.chunks) > 500
            # reports reach the server: a cancel without played_ms is answered with the last
            # (paced in real time, so that the turn is still being spoken when it comes)
            loop = asyncio.get_running_loop()
            await vg.update(pacing="realtime")
            turn = vg.speak(LONG)
            player = Player(ListSink(), report_every_ms=200)
            stop = loop.create_future()
            playing = asyncio.ensure_future(player.play(turn, until=stop))
            while player.played_ms() < 800:
                await asyncio.sleep(0.05)
            heard = await turn.cancel()
            assert heard.played_ms is not None and 200 <= heard.played_ms <= player.played_ms()
            stop.set_result(None)
            await asyncio.gather(playing, return_exceptions=True)
            # a barge-in: cancelled at the clock's position, the sink cleared
            sink = ListSink()
            player = Player(sink, lead_ms=100)

            async def a_second_into_the_audio() -> None:
                while player.played_ms() <= 0:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(1.0)

            heard = await player.play(vg.speak(LONG), until=a_second_into_the_audio())
            assert heard.is_cancelled and sink.cleared == 1
            # ~1 s; more on a busy box
            assert heard.played_ms is not None and 500 < heard.played_ms <= 3000
            assert heard.spoken_text and words(LONG).startswith(heard.spoken_text)
            written_ms = sum(c.duration_ms for c in sink.chunks)
            largest_ms = max(c.duration_ms for c in sink.chunks)  # a message: several frames
            # no more than its lead ahead (and a timer's few ms of slack: a write at the lead's
            # edge and the cancel's clock reading are two reads of the loop's time)
            assert written_ms <= heard.played_ms + 100 + largest_ms + 10

    run(scenario())


def test_a_key_goes_in_the_header_and_a_missing_one_raises_unauthorized(tmp_path: Path) -> None:
    key = "sk-client-0123456789"
    proc = start_server(tmp_path, env={"VOXGATE_API_KEYS": key})

    async def scenario() -> None:
        with pytest.raises(Unauthorized) as caught:
            async with AsyncVoxgate(proc.ws_url):
                pass
        assert caught.value.code == "unauthorized" and caught.value.fatal
        async with AsyncVoxgate(proc.ws_url, api_key=key) as vg:
            turn = vg.speak("With a key.")
            assert await collect(turn) and turn.state is TurnState.DONE

    try:
        run(scenario())
    finally:
        proc.stop()
    assert key not in proc.log()  # the header's key is never logged
