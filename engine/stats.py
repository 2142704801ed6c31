"""The engine's counters: what one engine has done, as the gateway exports it to /metrics.

This module owns `EngineStats` (requests submitted, finished, cancelled and
failed; steps, audio and busy time; the step-time and first-audio histograms;
the items a backend could not run in a step, by reason) and the histograms'
bucket bounds, `STEP_BUCKETS` and `FIRST_AUDIO_BUCKETS`. It is plain data with
no engine behind it, so a remote gateway can build one from its replicas'
counters and sum them (gateway.ray_serve) without importing the engine's loop.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the engine step-time histogram's buckets.
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
#: Upper bounds (seconds) of the first-audio histogram's buckets: from when a context's first
#: audio was needed to the step that made it (the engine's share of first audio).
FIRST_AUDIO_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)


@dataclass(slots=True)
class EngineStats:
    """Counters the gateway exports to /metrics."""

    num_submitted: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_steps: int = 0
    audio_seconds: float = 0.0
    busy_seconds: float = 0.0
    last_step_seconds: float = 0.0
    last_batch_size: int = 0
    # Step durations as cumulative-ready bucket counts (STEP_BUCKETS; the last is +Inf),
    # so /metrics exports a histogram and a remote gateway can sum its replicas'.
    step_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    # A context's first audio: from when it was needed (its submission, or the end of the
    # context it plays after) to the step that made it, as bucket counts (FIRST_AUDIO_BUCKETS)
    # and their sum. TTFA (the gateway's histogram) less this is what the gateway added.
    first_audio_bucket_counts: list[int] = field(
        default_factory=lambda: [0] * (len(FIRST_AUDIO_BUCKETS) + 1))
    first_audio_seconds: float = 0.0
    # Items of a step the backend did not run, by its reason (`StepResult.waiting`): a request
    # the engine sends is run or counted here, never held inside the backend without a word.
    waits: dict[str, int] = field(default_factory=dict)

    def observe_step(self, seconds: float) -> None:
        self.step_bucket_counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1

    def observe_first_audio(self, seconds: float) -> None:
        self.first_audio_bucket_counts[bisect.bisect_left(FIRST_AUDIO_BUCKETS, seconds)] += 1
        self.first_audio_seconds += seconds

    def count_wait(self, reason: str) -> None:
        self.waits[reason] = self.waits.get(reason, 0) + 1
