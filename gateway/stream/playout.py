"""One context's audio on its way out: PCM chunks in, paced `audio` messages out (sans-I/O).

`Playout` owns the media half of a context, so that `Session` keeps only the
protocol half (which segment speaks next, what was heard). It hands PCM to
the context's encoder (gateway/audio/encoders.py: one encode per chunk, in
the context's output format), packs what comes out into `audio` messages of
up to `frames_per_message` frames (the session's option, `FRAMES_PER_MESSAGE` by
default) with gapless `seq` and `pts_ms`
(docs/protocol.md, "Rules the server keeps"), and holds them in an outbox
until pacing lets them go. Encoding is one self-contained call (`push` is
`encode`, then `pack`), so the two halves may run apart: a deferred playout
(`is_deferred`, the native socket's) only counts what it is handed and gives
it out as an `EncodeJob` (`take_job`) for a worker thread
(gateway/stream/encoding.py), and packs the job's frames when it is back
(`complete`), in the order the jobs were taken. Like the session it reads no
clock: `release` takes `now`.

Pacing. `asap` releases every message at once. `realtime` keeps the client at
most `REALTIME_LEAD_MS` of audio ahead of its playback clock, which starts
when the context's first message leaves (or when the audio of the contexts
before it ends, if later): a message whose `pts_ms` is due `REALTIME_LEAD_MS`
before its playback time is released.

The outbox is bounded by what it is fed: the session hands it the audio of at
most `synthesis.MAX_SEGMENTS_AHEAD` segments at a time (docs/architecture.md,
"The backpressure story").
"""

from __future__ import annotations

from collections import deque

import numpy as np

from gateway.audio.codecs import EncodedFrame
from gateway.audio.encoders import AudioEncoder
from gateway.stream.encoding import EncodeJob
from gateway.stream.events import AudioEvent
from gateway.stream.options import DEFAULT_FRAMES_PER_MESSAGE

#: the default of the session's `frames_per_message` (gateway/stream/options.py)
FRAMES_PER_MESSAGE = DEFAULT_FRAMES_PER_MESSAGE
REALTIME_LEAD_MS = 1500.0


class Playout:
    """Encodes, packetizes and paces one context's audio (see module doc).

    Counters the protocol reports: `pcm_ms_framed` (PCM handed to the
    encoder, sample-exact: segment `pts_ms` values), `audio_ms_queued` (whole
    frames packed into messages), `audio_ms_sent` (whole frames released: what
    the client has), `play_started_at` (when its playback clock started, on the
    caller's monotonic clock; None before the first release).
    """

    def __init__(self, context_id: str, encoder: AudioEncoder, *, is_realtime: bool,
                 frames_per_message: int = FRAMES_PER_MESSAGE, is_deferred: bool = False) -> None:
        if frames_per_message < 1:
            raise ValueError(f"expected frames_per_message >= 1, got {frames_per_message}")
        self.context_id = context_id
        self.encoder = encoder
        self.is_realtime = is_realtime
        self.frames_per_message = frames_per_message
        self.seq = 0
        self.pcm_ms_framed = 0.0
        self.audio_ms_queued = 0.0
        self.audio_ms_sent = 0.0
        self.play_started_at: float | None = None
        self.run_out_at = 0.0  # when the listener has played all that was sent, gaps resumed
        self.is_finished = False
        self.is_deferred = is_deferred
        self._outbox: deque[AudioEvent] = deque()
        self._pieces: list[np.ndarray | None] = []  # deferred: PCM (None: flush) not yet taken
        self._pieces_ms = 0.0
        self._jobs: deque[EncodeJob] = deque()  # deferred: jobs taken and not yet complete
        self._last_due = 0.0  # deferred: the due time of the last job taken
        self._generation = 0  # moves on at `clear`: a job taken before is dropped

    @property
    def is_empty(self) -> bool:
        """Nothing waits for release (what was pushed so far is out, encoded)."""
        return not self._outbox and not self._pieces and not self._jobs

    def push(self, pcm: np.ndarray) -> None:
        """Encode mono PCM at the encoder's input rate; its whole frames join the outbox
        (deferred: once its job is back)."""
        ms = 1000.0 * len(pcm) / self.encoder.sample_rate_in
        self.pcm_ms_framed += ms
        if self.is_deferred:
            self._pieces.append(pcm)
            self._pieces_ms += ms
        else:
            self.pack(self.encoder.encode(pcm))

    def finish(self) -> None:
        """No more PCM: the encoder's padded tail joins the outbox (once)."""
        if not self.is_finished:
            self.is_finished = True
            if self.is_deferred:
                self._pieces.append(None)
            else:
                self.pack(self.encoder.flush())

    def take_job(self, now: float, playback_end: float = 0.0) -> EncodeJob | None:
        """Deferred: what was pushed since the last job, to encode off the loop (None: nothing).

        Its `due` is when the listener runs out of the audio before it: of what was sent, as
        the listener plays it (`run_out_at`: after a gap it resumes when audio comes, so a
        late context is not due forever in the past), then of what waits before the job; a
        context not playing yet starts now, or when the contexts before it end. Never before
        the context's previous job, so its jobs run in order.
        """
        if not self._pieces:
            return None
        waiting_ms = self.pcm_ms_framed - self._pieces_ms - self.audio_ms_sent
        start = max(now, playback_end if self.play_started_at is None else self.run_out_at)
        due = max(start + waiting_ms / 1000.0, self._last_due)
        self._last_due = due
        job = EncodeJob(self.encoder, self._pieces, self._generation, self._pieces_ms, due)
        self._pieces, self._pieces_ms = [], 0.0
        self._jobs.append(job)
        return job

    def complete(self, job: EncodeJob) -> None:
        """A job is back (in the order taken): its frames join the outbox. Raises the job's
        error; a job of a cleared playout is dropped."""
        if job.generation != self._generation:
            return
        if self._jobs and self._jobs[0] is job:
            self._jobs.popleft()
        if job.error is not None:
            raise job.error
        for frames in job.frames:  # piece by piece: the messages an inline playout sends
            self.pack(frames)

    def clear(self) -> None:
        """Drop what waits (cancel): no audio of this context leaves after this."""
        self._outbox.clear()
        self._pieces, self._pieces_ms = [], 0.0
        for job in self._jobs:  # still waiting for the encoder: not run (EncodeQueue)
            job.is_dropped = True
        self._jobs.clear()
        self._generation += 1

    def release(self, now: float, playback_end: float) -> list[AudioEvent]:
        """The messages pacing lets go at `now`, in order.

        `playback_end`: when the audio of the contexts before this one ends
        playing; this one's playback clock starts no earlier.
        """
        out: list[AudioEvent] = []
        while self._outbox:
            message = self._outbox[0]
            if self.is_realtime and self._due_at(message.pts_ms) > now:
                break
            self._outbox.popleft()
            if self.play_started_at is None:
                # Contexts play one after another: this one starts when the last ends.
                self.play_started_at = max(now, playback_end)
            self.audio_ms_sent += message.duration_ms
            self.run_out_at = (max(self.run_out_at, self.play_started_at, now)
                               + message.duration_ms / 1000.0)
            out.append(message)
        return out

    def next_release(self) -> float | None:
        """When the next waiting message is due under realtime pacing; None if none waits."""
        if not self.is_realtime or not self._outbox:
            return None
        return self._due_at(self._outbox[0].pts_ms)

    def _due_at(self, pts_ms: float) -> float:
        start = self.play_started_at
        if start is None:
            return 0.0  # the first message leaves at once and starts the clock
        return start + (pts_ms - REALTIME_LEAD_MS) / 1000.0

    def pack(self, frames: list[EncodedFrame]) -> None:
        """Encoded frames join the outbox, up to `frames_per_message` to a message, in order."""
        size = self.frames_per_message
        for start in range(0, len(frames), size):
            group = frames[start:start + size]
            duration = sum(f.duration_ms for f in group)
            event = AudioEvent(self.context_id, self.seq, self.audio_ms_queued, duration,
                               self.encoder.codec, tuple(f.data for f in group))
            self._outbox.append(event)
            self.seq += 1
            self.audio_ms_queued += duration
