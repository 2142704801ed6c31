"""`Voxgate`: the sync twin of `AsyncVoxgate`, the same API, blocking.

    with Voxgate("ws://127.0.0.1:8000/v1/stream") as vg:
        turn = vg.speak(openai_stream_deltas)     # a str, or any iterable of deltas
        for chunk in turn:
            out.write(chunk.pcm.tobytes())
        heard = turn.cancel(played_ms=1840)

Each `Voxgate` runs an `AsyncVoxgate` on an event loop of its own, on a
background thread; every call runs there and waits for its result. A plain
iterable given to `speak` is read on a thread of its own, so an SDK's blocking
stream never stalls the loop (the async client reads a plain iterable on the
loop: give it an async iterable when reading blocks).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterable, Coroutine, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from voxgate_client.audio import AudioChunk
from voxgate_client.errors import VoxgateError
from voxgate_client.session import AsyncVoxgate
from voxgate_client.turn import Heard, TextSource, Turn, TurnState
from voxgate_client.wire import Done, Segment, TextSkipped

if TYPE_CHECKING:
    from typing_extensions import Self

T = TypeVar("T")


class Voxgate:
    """The blocking twin of `AsyncVoxgate` (same arguments; see its doc)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="voxgate-loop",
                                        daemon=True)
        self._thread.start()

        async def make() -> AsyncVoxgate:
            return AsyncVoxgate(url, **kwargs)

        try:
            self.aio = self._call(make())  # the async session underneath
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a Voxgate call from its own event loop would wait for itself; "
                               "use the AsyncVoxgate (vg.aio) there")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> Self:
        self.connect()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def session_id(self) -> str | None:
        return self.aio.session_id

    @property
    def options(self) -> dict[str, Any]:
        return self.aio.options

    @property
    def limits(self) -> dict[str, Any]:
        return self.aio.limits

    @property
    def is_connected(self) -> bool:
        return self.aio.is_connected

    def connect(self) -> None:
        self._call(self.aio.connect())

    def close(self) -> None:
        """Close the socket and stop the background loop."""
        if self._loop.is_closed():
            return
        try:
            self._call(self.aio.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def update(self, **options: Any) -> dict[str, Any]:
        return self._call(self.aio.update(**options))

    def speak(self, text: TextSource | None = None, *, context_id: str | None = None,
              ) -> SyncTurn:
        """A new turn (see `AsyncVoxgate.speak`); a plain iterable is read on its own thread."""
        is_blocking = (text is not None and not isinstance(text, str)
                       and not isinstance(text, AsyncIterable))

        async def speak() -> Turn:
            return self.aio.speak(None if is_blocking else text, context_id=context_id)

        turn = SyncTurn(self, self._call(speak()))
        if is_blocking:
            assert isinstance(text, Iterable)
            threading.Thread(target=turn._feed, args=(text,), daemon=True,
                             name=f"voxgate-feed-{turn.context_id}").start()
        return turn


class SyncTurn:
    """The blocking twin of `Turn`: iterate it for `AudioChunk`s; `push`, `flush`, `cancel`."""

    def __init__(self, owner: Voxgate, turn: Turn) -> None:
        self._owner = owner
        self.aio = turn  # the async turn underneath

    def __repr__(self) -> str:
        return f"<SyncTurn {self.aio.context_id} {self.aio.state.value}>"

    @property
    def context_id(self) -> str:
        return self.aio.context_id

    @property
    def state(self) -> TurnState:
        return self.aio.state

    @property
    def segments(self) -> list[Segment]:
        return self.aio.segments

    @property
    def skipped(self) -> list[TextSkipped]:
        return self.aio.skipped

    @property
    def done(self) -> Done | None:
        return self.aio.done

    @property
    def error(self) -> BaseException | None:
        return self.aio.error

    @property
    def text(self) -> str:
        return self.aio.text

    def __iter__(self) -> Iterator[AudioChunk]:
        while True:
            try:
                yield self._owner._call(_next(self.aio))
            except StopAsyncIteration:
                return

    def push(self, text: str, *, flush: bool = False) -> None:
        self._owner._call(self.aio.push(text, flush=flush))

    def flush(self) -> None:
        self._owner._call(self.aio.flush())

    def report(self, played_ms: float) -> None:
        self._owner._call(self.aio.report(played_ms))

    def cancel(self, played_ms: float | None = None, *, timeout: float = 10.0) -> Heard:
        return self._owner._call(self.aio.cancel(played_ms, timeout=timeout))

    def heard_all(self) -> Heard:
        return self.aio.heard_all()

    def _feed(self, source: Iterable[str | None]) -> None:
        """Send a blocking iterable's deltas (on a thread of its own), then flush."""
        turn = self.aio
        try:
            for delta in source:
                if turn._is_stopped:
                    return
                if delta is not None:
                    self.push(delta)
            if not turn._is_stopped and turn.state is TurnState.OPEN:
                self.flush()
        except VoxgateError:
            pass  # the turn ended: its iteration says how
        except RuntimeError:
            pass  # the session was closed and its loop stopped
        except Exception as exc:  # noqa: BLE001  (the source raised: the turn fails with it)
            self._owner._loop.call_soon_threadsafe(_fail_and_cancel, turn, exc)


async def _next(turn: Turn) -> AudioChunk:
    return await turn.__anext__()


def _fail_and_cancel(turn: Turn, exc: BaseException) -> None:
    turn._fail(exc)
    turn._session._cancel_quietly(turn)
