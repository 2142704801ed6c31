"""A listener's playback clock: what has been heard by now, and every underrun.

Pure arithmetic with time passed in (seconds on one monotonic clock, the event
loop's for `Player`), so every rule is testable with a fake clock. It models a
player that starts playing when a turn's first audio arrives (plus an optional
`playout_delay_ms`, a jitter buffer) and plays each piece for its duration, in
order. When audio arrives after everything received so far has played, the
listener heard silence: a gap, as long as the audio was late; playback resumes
from the late piece. `Player` keeps one per turn and reports it to the server
(`playback`, `cancel`'s `played_ms`); the load tool measures gaps with it
(docs/loadtest.md, "The numbers").
"""

from __future__ import annotations


class PlaybackClock:
    """One turn's playback: where it is, and every underrun."""

    __slots__ = (
        "audio_ms",
        "gap_ms",
        "gaps",
        "gaps_at",
        "num_frames",
        "num_gaps",
        "playout_delay_s",
        "run_out_at",
        "started_at",
    )

    def __init__(self, playout_delay_ms: float = 0.0) -> None:
        if playout_delay_ms < 0:
            raise ValueError(f"expected playout_delay_ms >= 0, got {playout_delay_ms}")
        self.playout_delay_s = playout_delay_ms / 1000.0
        self.started_at: float | None = None
        self.run_out_at = 0.0  # the time at which the audio received so far has all played
        self.audio_ms = 0.0
        self.num_frames = 0
        self.num_gaps = 0
        self.gap_ms = 0.0
        self.gaps: list[float] = []
        self.gaps_at: list[float] = []  # where each gap fell: ms of the turn's audio before it

    def on_frame(self, now: float, duration_ms: float) -> float:
        """Account audio that arrived at `now`; return the gap it ended (0 if none)."""
        if duration_ms < 0:
            raise ValueError(f"expected duration_ms >= 0, got {duration_ms}")
        gap_ms = 0.0
        if self.started_at is None:
            self.started_at = now
            self.run_out_at = now + self.playout_delay_s
        elif now > self.run_out_at:
            gap_ms = (now - self.run_out_at) * 1000.0
            self.num_gaps += 1
            self.gap_ms += gap_ms
            self.gaps.append(gap_ms)
            self.gaps_at.append(self.audio_ms)
            self.run_out_at = now
        self.run_out_at += duration_ms / 1000.0
        self.audio_ms += duration_ms
        self.num_frames += 1
        return gap_ms

    def played_ms(self, now: float) -> float:
        """How much audio the listener has heard by `now` (it stalls during a gap)."""
        if self.started_at is None:
            return 0.0
        buffered_ms = max(0.0, (self.run_out_at - now) * 1000.0)
        return max(0.0, self.audio_ms - buffered_ms)

    def time_at_played(self, played_ms: float) -> float | None:
        """The time playback reaches `played_ms`, if that audio was received."""
        if self.started_at is None or played_ms > self.audio_ms:
            return None
        return self.run_out_at - (self.audio_ms - played_ms) / 1000.0
