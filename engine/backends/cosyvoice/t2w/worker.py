"""Flow + vocoder on their own thread (and CUDA stream), overlapping the LM's decode steps.

Run back to back on one thread, a flow batch of 64 streams (ten DiT passes on
128 CFG rows, then HiFT) holds every LM stream for its whole duration, and the
host syncs between them serialize the GPU too. Here the backend's worker
thread does the LM step and hands the streams with a ready chunk to this
thread; while the flow computes, the LM goes on decoding. At most one batch is
in flight (a bounded queue of one), so chunks of one stream never overtake
each other and the LM is never more than one flow batch ahead.

The result is the serial path's, chunk for chunk: a chunk's schedule and
content depend only on its stream's tokens (t2w/streams.py), not on when or
with whom it is computed (tests/unit/engine/cosyvoice/test_t2w.py). On a GPU the
thread runs its work on its own CUDA stream and brings each batch's audio to
the host in one copy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.backends.cosyvoice.t2w.streams import TokenToWave, WaveChunk


@dataclass(slots=True)
class HostChunk:
    """A chunk with its audio on the host: float32 [n] at 24 kHz."""

    stream_id: str
    pcm: np.ndarray
    is_final: bool


@dataclass(slots=True)
class _Job:
    stream_ids: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    chunks: list[HostChunk] = field(default_factory=list)
    error: BaseException | None = None


def chunks_to_host(chunks: list[WaveChunk]) -> list[HostChunk]:
    """Every chunk's audio to the host in ONE device-to-host copy (not one per chunk)."""
    if not chunks:
        return []
    joined = torch.cat([c.audio.detach().reshape(-1).float() for c in chunks]).cpu().numpy()
    out, at = [], 0
    for c in chunks:
        n = c.audio.numel()
        out.append(HostChunk(c.stream_id, joined[at:at + n], c.is_final))
        at += n
    return out


class FlowWorker:
    """One thread computing t2w batches; `submit` one batch, `collect` its chunks when done."""

    def __init__(self, t2w: TokenToWave, device: torch.device) -> None:
        self.t2w = t2w
        self.device = device
        self._job: _Job | None = None  # the one batch in flight (or done, not yet collected)
        self._wake = threading.Condition()
        self._next: _Job | None = None
        self._closed = False
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._loop, name="voxgate-cosyvoice-flow",
                                        daemon=True)
        self._thread.start()

    @property
    def is_busy(self) -> bool:
        """A batch was submitted and not collected yet."""
        return self._job is not None

    def submit(self, stream_ids: list[str]) -> None:
        """Start a batch (the streams' next chunks); one at a time: collect the last one first."""
        if self._job is not None:
            raise RuntimeError("expected the last flow batch collected before the next, "
                               "got one in flight")
        if self._closed:
            raise RuntimeError("expected an open flow worker, got a closed one")
        job = _Job(list(stream_ids))
        self._job = job
        with self._wake:
            self._next = job
            self._wake.notify()

    def collect(self, wait: bool = False, timeout: float | None = None) -> list[HostChunk]:
        """The chunks of the batch in flight if it is done (or, with `wait`, once it is); else
        []."""
        job = self._job
        if job is None or not (job.done.is_set() or (wait and job.done.wait(timeout))):
            return []
        self._job = None
        if job.error is not None:
            raise job.error
        return job.chunks

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._next is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                job, self._next = self._next, None
            assert job is not None
            try:
                job.chunks = self._run(job.stream_ids)
            except BaseException as exc:  # noqa: BLE001 - handed to the backend's thread by collect()
                job.error = exc
            job.done.set()

    def _run(self, stream_ids: list[str]) -> list[HostChunk]:
        if self._stream is None:
            return chunks_to_host(self.t2w.run(stream_ids))
        with torch.cuda.stream(self._stream):
            return chunks_to_host(self.t2w.run(stream_ids))  # .cpu() waits for this stream's work
