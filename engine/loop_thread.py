"""The engine loop's own thread, and the two hand-offs between it and the gateway's event loop.

`LoopThread` runs `StepLoop.run` (engine/loop.py) on a thread named
`voxgate-engine-loop`, with an event loop of its own, so the engine never
waits for a turn of the event loop that serves the sockets: a step's end, a
prepare and a release are awaited on the engine's loop. Two hand-offs cross
between the threads, and nothing else does (the request table and the
scheduler are shared under the table's lock, engine/requests.py):

- to the engine: `wake`, when a request was submitted, cancelled or read.
  Wakes are coalesced: while one is on its way, another adds nothing (the
  loop reads the table after it wakes, so it sees what the second was for).
- to the gateway: each batch the loop routed (`StepLoop.send_outbox`), as one
  `call_soon_threadsafe` onto the gateway's loop, where `engine.loop.deliver`
  puts each item into its request's bounded queue.

`stop` cancels the loop's task on its own loop and waits, without blocking
the gateway's loop, until the thread has ended; from then on a batch is
delivered at once (the caller is on the gateway's loop).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from engine.loop import Deliveries, StepLoop, deliver

log = logging.getLogger("voxgate.engine")

THREAD_NAME = "voxgate-engine-loop"


class LoopThread:
    """One `StepLoop` on its own thread and event loop (see module doc)."""

    def __init__(self, step_loop: StepLoop) -> None:
        self.step_loop = step_loop
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the engine's own
        self._task: asyncio.Task[None] | None = None
        self._home: asyncio.AbstractEventLoop | None = None  # the gateway's
        self._ended: asyncio.Future[None] | None = None  # on the gateway's loop
        self._is_wake_posted = False

    @property
    def is_running(self) -> bool:
        task = self._task
        return (self._thread is not None and self._thread.is_alive()
                and task is not None and not task.done())

    def start(self) -> None:
        """Start the thread; call on the gateway's event loop (its batches go there)."""
        self._home = asyncio.get_running_loop()
        self._ended = self._home.create_future()
        self.step_loop.send = self._send
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), name=THREAD_NAME,
                                        daemon=True)
        self._thread.start()
        ready.wait()  # a few microseconds: the thread has made its loop and task

    def _main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._task = loop.create_task(self.step_loop.run(), name=THREAD_NAME)
        ready.set()
        try:
            loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass  # stopped
        except Exception:  # the loop died: /readyz turns false (Engine.is_healthy)
            log.exception("the engine loop failed")
        finally:
            loop.close()
            self._signal_ended()

    def _signal_ended(self) -> None:
        home, ended = self._home, self._ended
        if home is None or ended is None:
            return
        try:
            home.call_soon_threadsafe(_settle, ended)
        except RuntimeError:  # the gateway's loop closed first: nobody waits
            pass

    def wake(self) -> None:
        """Wake the loop (from the gateway's event loop); coalesced (module doc)."""
        loop = self._loop
        if loop is None or self._is_wake_posted:
            return
        self._is_wake_posted = True
        try:
            loop.call_soon_threadsafe(self._woken)
        except RuntimeError:  # the engine's loop closed: stopped
            pass

    def _woken(self) -> None:  # on the engine's loop
        self._is_wake_posted = False
        self.step_loop.wake.set()

    def _send(self, batch: Deliveries) -> None:  # on the engine's loop
        home = self._home
        assert home is not None
        try:
            home.call_soon_threadsafe(deliver, batch)
        except RuntimeError:  # the gateway's loop closed: nobody reads
            pass

    async def stop(self) -> None:
        """End the loop and its thread; on the gateway's event loop."""
        loop, task, ended = self._loop, self._task, self._ended
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # it ended on its own
                pass
        if ended is not None:
            await ended
        if self._thread is not None:
            self._thread.join()  # at its last line already
        self.step_loop.send = deliver
        self._loop = None


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
