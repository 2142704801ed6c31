"""`Player`: plays turns into a sink, keeps the playback clock, tells the server what was heard.

    async with Player(Speakers()) as player:          # or any sink: write(chunk), clear()
        heard = await player.play(turn, until=key_press())
        history.append(heard.spoken_text)             # what the listener heard

The clock is the listener's (clock.py): a turn starts playing when its first
audio arrives and plays in real time; a chunk that comes late is a gap. The
player hands each chunk to the sink `lead_ms` before the clock reaches it, so
a sink holds little more than that (a barge-in clears it at once and the
listener stops hearing within `lead_ms`), and sends `playback` reports every
`report_every_ms` of audio heard, so that the server's own numbers and a
cancel without `played_ms` speak of what was heard (docs/protocol.md,
"Barge-in"). A sink that plays audio itself (a device, a WebRTC track, a
telephony bridge) starts playing what it is given at once; the clock assumes
so, and a device's own output latency (tens of ms) is not counted.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from voxgate_client.audio import AudioChunk
from voxgate_client.clock import PlaybackClock
from voxgate_client.errors import VoxgateError
from voxgate_client.turn import Heard, Turn

if TYPE_CHECKING:
    from typing_extensions import Self


class Sink(Protocol):
    """Where a `Player` puts audio. `write` queues a chunk for playback (it may return an
    awaitable, which is awaited); `clear` drops what is queued (a barge-in)."""

    def write(self, chunk: AudioChunk) -> Any: ...
    def clear(self) -> None: ...


class Player:
    """Plays one turn at a time into `sink` (see the module doc)."""

    def __init__(self, sink: Sink, *, lead_ms: float = 200.0, report_every_ms: float = 500.0,
                 playout_delay_ms: float = 0.0) -> None:
        if lead_ms < 0 or report_every_ms <= 0:
            raise ValueError(f"expected lead_ms >= 0 and report_every_ms > 0, got {lead_ms}, "
                             f"{report_every_ms}")
        self.sink = sink
        self.lead_ms = lead_ms
        self.report_every_ms = report_every_ms
        self.playout_delay_ms = playout_delay_ms
        self.clock = PlaybackClock(playout_delay_ms)  # the current (or last) turn's
        self.turn: Turn | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        close = getattr(self.sink, "close", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result

    def played_ms(self) -> float:
        """How much of the current turn's audio the listener has heard by now."""
        return self.clock.played_ms(asyncio.get_running_loop().time())

    async def play(self, turn: Turn, *, until: Awaitable[Any] | None = None) -> Heard:
        """Play `turn` to its end, or until `until` completes (a barge-in: the turn is
        cancelled at what was heard, the sink cleared). Returns what was heard. Raises the
        turn's error if it failed."""
        loop = asyncio.get_running_loop()
        self.clock = clock = PlaybackClock(self.playout_delay_ms)
        self.turn = turn
        stop = asyncio.ensure_future(until) if until is not None else None
        feeding = loop.create_task(self._feed(turn, clock))
        try:
            waiting = {feeding} if stop is None else {feeding, stop}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if feeding.done():
                feeding.result()  # the turn's error, if it failed
                tail_s = clock.run_out_at - loop.time()  # the last audio is still playing
                if stop is None:
                    await asyncio.sleep(max(0.0, tail_s))
                elif tail_s > 0:
                    await asyncio.wait({stop}, timeout=tail_s)
                if stop is None or not stop.done():
                    return turn.heard_all()
            return await self._barge_in(turn, clock)
        finally:
            feeding.cancel()
            await asyncio.gather(feeding, return_exceptions=True)
            if stop is not None and not stop.done():
                stop.cancel()

    async def _barge_in(self, turn: Turn, clock: PlaybackClock) -> Heard:
        played = clock.played_ms(asyncio.get_running_loop().time())
        self.sink.clear()
        return await turn.cancel(played_ms=played)

    async def _feed(self, turn: Turn, clock: PlaybackClock) -> None:
        loop = asyncio.get_running_loop()
        lead_s = self.lead_ms / 1000.0
        next_report = self.report_every_ms
        async for chunk in turn:
            # where this chunk starts on the clock: after what came before, or at once
            # after a gap (the clock's rule)
            starts_at = (chunk.received_at + clock.playout_delay_s if clock.started_at is None
                         else max(clock.run_out_at, chunk.received_at))
            clock.on_frame(chunk.received_at, chunk.duration_ms)
            wait_s = starts_at - lead_s - loop.time()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            written = self.sink.write(chunk)
            if inspect.isawaitable(written):
                await written
            played = clock.played_ms(loop.time())
            if played >= next_report:
                next_report = played + self.report_every_ms
                try:
                    await turn.report(played)
                except VoxgateError:
                    pass  # the turn ended meanwhile; the iteration says how


class ListSink:
    """A sink that keeps what it is given (tests, files): `chunks`, and `cleared` counts
    the barge-ins it saw."""

    def __init__(self) -> None:
        self.chunks: list[AudioChunk] = []
        self.cleared = 0

    def write(self, chunk: AudioChunk) -> None:
        self.chunks.append(chunk)

    def clear(self) -> None:
        self.cleared += 1
