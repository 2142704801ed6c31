"""What a listener feels, as numbers: turn records and summaries.

Pure arithmetic with time passed in (seconds on the client's monotonic clock),
so every rule here is unit-tested with a fake clock and no server.

The playback clock that models the listener's player is the client's
(`voxgate_client.clock.PlaybackClock`): audio starts playing in real time
when the first frame of a turn arrives (plus an optional playout delay, a
player's jitter buffer; 0 by default) and plays each frame for its
`duration_ms`. When a frame arrives after the audio already received has run
out, the listener hears silence: that is a gap, of length arrival minus
run-out, and playback resumes from the late frame (docs/loadtest.md, "The
numbers"). Every gap is counted; `is_text_late` tells apart the ones no server
could have filled, because the text to speak came too late.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

PERCENTILES = (50.0, 90.0, 95.0, 99.0)
TTFA_TARGET_MS = 300.0  # the first-audio target when none is given (--ttfa-target-ms's default)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks.

    Same definition as numpy's default ("linear"), so results can be checked
    against numpy; NaN for an empty list.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"expected a percentile within 0-100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float | int]:
    """n, mean, min, max and the report's percentiles (ms values stay ms)."""
    out: dict[str, float | int] = {"n": len(values)}
    if not values:
        out.update({"mean": math.nan, "min": math.nan, "max": math.nan})
    else:
        out.update({"mean": sum(values) / len(values), "min": min(values), "max": max(values)})
    for q in PERCENTILES:
        out[f"p{q:g}"] = percentile(values, q)
    return out


class Outcome(str, Enum):
    """How a turn ended; every started turn ends in exactly one of these."""

    COMPLETED = "completed"  # context.done received
    CANCELLED = "cancelled"  # barge-in: cancelled received
    FAILED = "failed"  # an error ended it (busy, internal, fatal, connection lost)
    TIMED_OUT = "timed_out"  # no end within the turn timeout
    ABORTED = "aborted"  # still running when the run's drain period ended


@dataclass(slots=True)
class TurnRecord:
    """One turn (one context, one LLM answer) as the client saw it; times in ms."""

    session: int
    context_id: str
    num_tokens: int
    num_chars: int
    outcome: Outcome = Outcome.ABORTED
    ttfa_segment_ms: float | None = None  # first segment complete in input -> first frame
    ttfa_first_token_ms: float | None = None  # first token sent -> first frame
    audio_ms: float = 0.0
    num_frames: int = 0
    num_gaps: int = 0
    gap_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)
    gaps_at_ms: list[float] = field(default_factory=list)  # audio heard before each gap
    # Beside gaps_ms: how long before the listener ran out the text of the segment whose
    # first audio ended the gap was complete in the input (negative: after); None inside a
    # segment or unknown.
    gaps_text_lead_ms: list[float | None] = field(default_factory=list)
    cancel_latency_ms: float | None = None  # cancel sent -> cancelled received
    cancel_to_last_frame_ms: float | None = None  # cancel sent -> last frame (0: none after)
    played_ms_at_cancel: float | None = None
    is_cancelled_after_done: bool = False  # barge-in while the last audio still played
    error_codes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)  # protocol breaches seen
    server_audio_ms: float | None = None  # audio_ms reported by context.done / cancelled
    spoken_letters: dict[str, int] = field(default_factory=dict)  # of segment texts, by script
    skipped_chars: dict[str, int] = field(default_factory=dict)  # text.skipped, by language

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["outcome"] = self.outcome.value
        return out


@dataclass(slots=True)
class RunStats:
    """Facts about the run itself, beside the turns."""

    wall_s: float
    client_cpu_s: float
    num_sessions: int
    num_connect_failures: int = 0
    num_cores: int = 1

    @property
    def client_cpu_share(self) -> float:
        """The tool's CPU time over wall time: 1.0 means one core fully busy."""
        return self.client_cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def is_text_late(text_lead_ms: float | None, ttfa_target_ms: float) -> bool:
    """Whether a gap is the input's, not the server's.

    A segment gets the promise a turn's first audio gets: its text complete in
    the input at least the first-audio target before the listener runs out.
    When the text was complete later than that, the gap comes from the LLM's
    pace and from where the text lets the segmenter cut (a short "Sure!" plays
    out before the next sentence is written), and it happens at one session
    too. A gap inside a segment, or one whose segment text cannot be placed in
    the input (`None`), is the server's.
    """
    return text_lead_ms is not None and text_lead_ms < ttfa_target_ms


def summarize(turns: list[TurnRecord], stats: RunStats,
              ttfa_target_ms: float = TTFA_TARGET_MS) -> dict[str, Any]:
    """The report's numbers; every count here adds up (tests check it).

    Gaps are counted all together and split in two: `text_late` ones, whose
    text came too late for any server (`is_text_late`, against the first-audio
    target `ttfa_target_ms`), and the `server`'s, the rest. The server's are
    split again: `server_at_segment_start`, where a segment's first audio came
    later than the target after its text (a first-audio miss inside a turn),
    and `server_inside_segment`, the rest (audio that stopped mid-segment, or
    a segment whose text the tool cannot place in the input).
    """
    outcomes = Counter(t.outcome.value for t in turns)
    errors = Counter(code for t in turns for code in t.error_codes)
    violations = Counter(v for t in turns for v in t.violations)
    with_audio = [t for t in turns if t.num_frames > 0]
    audio_ms = sum(t.audio_ms for t in turns)
    num_frames = sum(t.num_frames for t in turns)
    cpu_share = stats.client_cpu_share
    num_gaps = sum(t.num_gaps for t in turns)
    num_text_late = sum(1 for t in turns for lead in t.gaps_text_lead_ms
                        if is_text_late(lead, ttfa_target_ms))
    num_server_at_start = sum(1 for t in turns for lead in t.gaps_text_lead_ms
                              if lead is not None and not is_text_late(lead, ttfa_target_ms))
    return {
        "turns": {
            "started": len(turns),
            **{o.value: outcomes.get(o.value, 0) for o in Outcome},
            "with_audio": len(with_audio),
            # still silent when the drain ended: they waited longer than any TTFA measured
            "aborted_without_audio": sum(1 for t in turns if t.outcome is Outcome.ABORTED
                                         and t.num_frames == 0),
            "cancelled_after_done": sum(1 for t in turns if t.is_cancelled_after_done),
        },
        "ttfa_segment_ms": distribution(
            [t.ttfa_segment_ms for t in turns if t.ttfa_segment_ms is not None]),
        "ttfa_first_token_ms": distribution(
            [t.ttfa_first_token_ms for t in turns if t.ttfa_first_token_ms is not None]),
        "gaps": {
            "count": num_gaps,
            "text_late": num_text_late,
            "server": num_gaps - num_text_late,
            "server_at_segment_start": num_server_at_start,
            "server_inside_segment": num_gaps - num_text_late - num_server_at_start,
            "total_ms": sum(t.gap_ms for t in turns),
            "turns_with_gaps": sum(1 for t in turns if t.num_gaps > 0),
            "gap_ms": distribution([g for t in turns for g in t.gaps_ms]),
        },
        # cancels of a context still being spoken; after context.done there is nothing to stop
        "cancel_latency_ms": distribution([t.cancel_latency_ms for t in turns if
                                           t.cancel_latency_ms is not None
                                           and not t.is_cancelled_after_done]),
        "cancel_to_last_frame_ms": distribution([t.cancel_to_last_frame_ms for t in turns if
                                                 t.cancel_to_last_frame_ms is not None
                                                 and not t.is_cancelled_after_done]),
        "text": _text_summary(turns),
        "errors": dict(sorted(errors.items())),
        "violations": dict(sorted(violations.items())),
        "audio": {
            "seconds": audio_ms / 1000.0,
            "frames": num_frames,
            "per_wall_second": audio_ms / 1000.0 / stats.wall_s if stats.wall_s > 0 else 0.0,
        },
        "run": {
            "wall_s": stats.wall_s,
            "sessions": stats.num_sessions,
            "connect_failures": stats.num_connect_failures,
            "client_cpu_s": stats.client_cpu_s,
            "client_cpu_share_of_one_core": cpu_share,
            "client_cpu_share_of_machine": cpu_share / max(1, stats.num_cores),
            "cores": stats.num_cores,
        },
    }


def _text_summary(turns: list[TurnRecord]) -> dict[str, Any]:
    """What the voices said (letters of the `segment` texts, by script) and what the server
    skipped (`text.skipped`: no voice for its language), in characters."""
    spoken: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    for t in turns:
        spoken.update(t.spoken_letters)
        skipped.update(t.skipped_chars)
    return {"spoken_letters": sum(spoken.values()),
            "spoken_letters_by_script": dict(sorted(spoken.items())),
            "skipped_chars": sum(skipped.values()),
            "skipped_chars_by_language": dict(sorted(skipped.items()))}


def passes(summary: dict[str, Any], ttfa_p95_target_ms: float) -> bool:
    """A load level holds when TTFA p95 meets the target, no gap was the server's
    (text-late ones happen at one session too: `is_text_late`), no turn failed or
    timed out (a `busy` answer is a user turned away) and none was still waiting
    for its first audio when the run's drain period ended."""
    ttfa = summary["ttfa_segment_ms"]
    turns = summary["turns"]
    return bool(
        ttfa["n"] > 0
        and ttfa["p95"] <= ttfa_p95_target_ms
        and summary["gaps"]["server"] == 0
        and turns["failed"] == 0
        and turns["timed_out"] == 0
        and turns["aborted_without_audio"] == 0
    )
