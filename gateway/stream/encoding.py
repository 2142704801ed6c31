"""Encoding off the event loop: the sockets' encodes on one worker thread, a batch per loop turn.

PyAV lets go of the GIL while FFmpeg and libopus run, and that is most of an
encode (89% of an Opus encode's CPU is in the codec libraries, `python -m
bench.bench_encode_profile`), so an encode on another thread runs beside the
event loop that serves the sockets, on another core. The native socket's
session asks for it: in deferred mode a `Playout` (gateway/stream/playout.py)
only counts the PCM it is handed (sample-exact `pts_ms` stay on the loop)
and gives it out as an `EncodeJob`; the session returns the job in an
`Encode` action, the connection hands it to the `EncodeWorker`, and the
job's frames come back to the session (`Session.receive_encoded`), which
packs them (gapless `seq`, `pts_ms`) and paces them out as before.

Batches. The engine hands a step's chunks to the event loop at once
(engine/loop.py), so the jobs they make arrive in one turn of the loop: the
worker gathers a turn's jobs and runs them as one call on its thread, and
their results come back as one callback.

Order and bounds. One thread runs the jobs in the order they came, so a
context's encoder is used by one thread at a time and its frames come back
in order. A job holds the PCM of a few chunks; the connection stops taking
engine audio while more than `MAX_ENCODING_MS` of its PCM waits for the
worker (docs/architecture.md, "The backpressure story"), so a worker that
falls behind slows the engine's clock for that socket, as a slow client does.
"""

from __future__ import annotations

import asyncio
import logging
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


@dataclass(slots=True, eq=False)
class EncodeJob:
    """PCM a playout was handed, to encode in order (`None`: the encoder's flush)."""

    encoder: AudioEncoder
    pieces: list[np.ndarray | None]
    generation: int  # the playout's, when the job was taken: a cleared playout drops it
    pcm_ms: float
    #: each piece's frames, as the piece was encoded: packed piece by piece, as inline
    frames: list[list[EncodedFrame]] = field(default_factory=list)
    error: Exception | None = None

    def run(self) -> None:
        """Encode every piece (on the worker's thread); an error is kept for the session."""
        try:
            for piece in self.pieces:
                self.frames.append(self.encoder.flush() if piece is None
                                   else self.encoder.encode(piece))
        except Exception as exc:  # noqa: BLE001 - its context ends with it (Session)
            self.error = exc


OnDone = Callable[[EncodeJob], None]


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
