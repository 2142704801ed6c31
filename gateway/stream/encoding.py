"""The sockets' encodes (native and vendor), most urgent first: on the event loop (the default),
or on one worker thread beside it.

Deadlines. A socket's audio is encoded as it comes from the engine, and the engine
runs ahead of every listener by up to its look-ahead (1.5 s), so under load most of
what waits to be encoded is audio nobody needs yet, while a new turn's first chunk is
needed now. Encoded in arrival order, that first chunk waits behind other sockets'
look-ahead: at 128 GPU-shaped sessions whose turns started together, first audio p95
was over 500 ms with the event loop's time mostly in Opus (docs/benchmarks.md, "The
process around a GPU, on the CPU"). So each `EncodeJob` carries `due`, when its
listener runs out of the audio before it (a context not yet playing: the moment its
job was taken; one that had a gap: from where its listener resumed, so a late
context is not forever due in the past, ahead of every other), and the `EncodeQueue`
runs jobs earliest due first, a few milliseconds at a time, giving the loop back in
between so the sockets' reads and the engine's hand-offs go on; audio due within a
quarter second goes first, in arrival order, for up to 20 ms at a time, so an
overloaded loop still spends itself on what is needed now, and past its core it
serves the turns as they came rather than letting new turns' first audio keep
jumping ahead of the turns already playing (at 256 sessions on one process, strict
earliest-due-first spread the same silence over five times as many gaps). What it
has not reached waits, its PCM counted against the socket (below). One context's
jobs come due in the order they were taken (`Playout.take_job`), so its encoder runs
them in order.

PyAV lets go of the GIL while FFmpeg and libopus run, and that is most of an
encode (89% of an Opus encode's CPU is in the codec libraries, `python -m
bench.bench_encode_profile`), so an encode on another thread runs beside the
event loop that serves the sockets, on another core. The sockets' sessions
defer their encodes: in deferred mode a `Playout` (gateway/stream/playout.py)
only counts the PCM it is handed (sample-exact `pts_ms` stay on the loop)
and gives it out as an `EncodeJob`; the session returns the job in an
`Encode` action, the connection hands it to the app's encoder (`EncodeQueue` on
the loop, or `EncodeWorker` with `VOXGATE_ENCODE_ON_THREAD=true`), and the
job's frames come back to the session (`Session.receive_encoded`), which
packs them (gapless `seq`, `pts_ms`) and paces them out as before.

The thread is off by default: it needs the GIL back after each call into
FFmpeg, and first audio under load came later with it than on the loop.

Batches (the thread). The engine hands a step's chunks to the event loop at once
(engine/loop.py), so the jobs they make arrive in one turn of the loop: the
worker gathers a turn's jobs and runs them as one call on its thread, and
their results come back as one callback.

Order and bounds. One thread runs the jobs in the order they came (the queue: in
due order), so a context's encoder is used by one thread at a time and its frames
come back in order. A job of a context cancelled while it waited is not run
(`is_dropped`): its frames would be thrown away. A job holds the PCM of a few
chunks; the connection stops taking engine audio while more than `MAX_ENCODING_MS`
of its PCM waits to be encoded (docs/architecture.md, "The backpressure story"), so
an encoder that falls behind slows the engine's clock for that socket, as a slow
client does.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from gateway.audio.codecs import EncodedFrame
from gateway.audio.encoders import AudioEncoder

log = logging.getLogger("voxgate.gateway")

#: PCM (ms) a socket may have waiting for the worker before it stops taking engine audio
MAX_ENCODING_MS = 5000.0

THREAD_PREFIX = "voxgate-encode"

#: how long the queue encodes before it gives the event loop back (one job at least) ...
SLICE_S = 0.002
#: ... unless a job is due this soon: urgent audio (in arrival order) before anything else runs,
URGENT_S = 0.25
#: ... up to this long, so that reads (text, a cancel) are never held for long
MAX_SLICE_S = 0.02


@dataclass(slots=True, eq=False)
class EncodeJob:
    """PCM a playout was handed, to encode in order (`None`: the encoder's flush)."""

    encoder: AudioEncoder
    pieces: list[np.ndarray | None]
    generation: int  # the playout's, when the job was taken: a cleared playout drops it
    pcm_ms: float
    #: when the listener runs out of the audio before this job (monotonic s): its deadline
    due: float = 0.0
    #: its context was cancelled or failed while it waited: not run, its frames unwanted
    is_dropped: bool = False
    #: each piece's frames, as the piece was encoded: packed piece by piece, as inline
    frames: list[list[EncodedFrame]] = field(default_factory=list)
    error: Exception | None = None

    def run(self) -> None:
        """Encode every piece (on the worker's thread); an error is kept for the session."""
        if self.is_dropped:
            return
        try:
            for piece in self.pieces:
                self.frames.append(self.encoder.flush() if piece is None
                                   else self.encoder.encode(piece))
        except Exception as exc:  # noqa: BLE001 - its context ends with it (Session)
            self.error = exc


OnDone = Callable[[EncodeJob], None]


class EncodeQueue:
    """The jobs of every socket on the event loop: what is needed soon first (module doc)."""

    def __init__(self) -> None:
        #: due within `URGENT_S`, in arrival order; and the rest, earliest due first
        self._urgent: list[tuple[int, EncodeJob, OnDone]] = []
        self._later: list[tuple[float, int, EncodeJob, OnDone]] = []
        self._order = itertools.count()
        self._is_scheduled = False
        self.num_batches = 0  # turns of the loop that encoded
        self.num_jobs = 0

    def __len__(self) -> int:
        return len(self._urgent) + len(self._later)

    def submit(self, job: EncodeJob, on_done: OnDone) -> None:
        """Queue `job` by its due time; `on_done(job)` runs on the event loop once it ran."""
        heapq.heappush(self._later, (job.due, next(self._order), job, on_done))
        if not self._is_scheduled:
            self._is_scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        """Encode the most urgent jobs for one slice, then let the loop's other callbacks run:
        after `SLICE_S`, or, while urgent jobs wait, `MAX_SLICE_S`."""
        self._is_scheduled = False
        self.num_batches += 1
        started = time.perf_counter()
        while self._take_urgent() or self._later:
            _, job, on_done = (heapq.heappop(self._urgent) if self._urgent
                               else heapq.heappop(self._later)[1:])
            job.run()
            self.num_jobs += 1
            _finish([(job, on_done)])
            spent = time.perf_counter() - started
            if spent >= MAX_SLICE_S or (spent >= SLICE_S and not self._take_urgent()):
                break
        if len(self) and not self._is_scheduled:
            self._is_scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _take_urgent(self) -> bool:
        """Move the jobs now due within `URGENT_S` to the urgent ones; whether any waits.

        Among urgent jobs, arrival order: when more is due than the loop can encode in time
        (past its core), first audio does not keep jumping ahead of the turns already
        playing, whose listeners would each hear a short gap; they are served as they came.
        """
        horizon = time.monotonic() + URGENT_S
        later = self._later
        while later and later[0][0] <= horizon:
            _, order, job, on_done = heapq.heappop(later)
            heapq.heappush(self._urgent, (order, job, on_done))
        return bool(self._urgent)

    def close(self) -> None:
        """Forget what waits: the app is stopping, and its sockets are closed."""
        self._urgent.clear()
        self._later.clear()


class EncodeWorker:
    """One thread running the jobs of each turn of the event loop as one call (module doc)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=THREAD_PREFIX)
        self._batch: list[tuple[EncodeJob, OnDone]] = []
        self.num_batches = 0
        self.num_jobs = 0

    def submit(self, job: EncodeJob, on_done: OnDone) -> None:
        """Queue `job` for this turn's batch; `on_done(job)` runs on the event loop after it."""
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._run_batch)
        self._batch.append((job, on_done))

    def _run_batch(self) -> None:
        batch, self._batch = self._batch, []
        self.num_batches += 1
        self.num_jobs += len(batch)
        jobs = [job for job, _ in batch]
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, _run_all, jobs)
        except RuntimeError:  # shut down (the app is stopping): encode here, as before
            _run_all(jobs)
            _finish(batch)
            return
        future.add_done_callback(lambda _: _finish(batch))

    def close(self) -> None:
        """End the thread once what it was given is done."""
        self._executor.shutdown(wait=True)


def _run_all(jobs: list[EncodeJob]) -> None:
    for job in jobs:
        job.run()


def _finish(batch: list[tuple[EncodeJob, OnDone]]) -> None:
    for job, on_done in batch:
        try:
            on_done(job)
        except Exception:  # one socket's fault ends no other's audio
            log.exception("an encoded batch could not be handed back")
