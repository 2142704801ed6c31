"""Reconnects and retry advice: capped exponential backoff with full jitter.

Attempt n (from 0) waits a uniform random time in [0, min(max_s, base_s * 2**n)]
("full jitter"): a fleet of clients dropped by one server restart spreads its
reconnects over the whole window instead of knocking all at once, and the
window stops growing at `max_s`. Randomness comes from a `random.Random` that
tests seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Reconnect:
    """Opt-in reconnection (`AsyncVoxgate(reconnect=Reconnect())`, or `reconnect=True`).

    After the socket drops, the session reconnects for the next turns: at most
    `max_attempts` tries in a row (None: no limit), waiting `Backoff` delays between
    them. A turn in flight when the socket dropped is not replayed: it raises
    `ConnectionLost` (its text may have been half spoken; the caller decides).
    """

    max_attempts: int | None = 8
    base_s: float = 0.5
    max_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"expected max_attempts >= 1 or None, got {self.max_attempts}")
        if not 0 < self.base_s <= self.max_s:
            raise ValueError(f"expected 0 < base_s <= max_s, got {self.base_s}, {self.max_s}")

    def delay_s(self, attempt: int) -> float:
        """How long to wait before attempt `attempt` (0: the first retry)."""
        return backoff_s(attempt, self.base_s, self.max_s, self.rng)


def backoff_s(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in [0, min(max_s, base_s * 2**attempt)]."""
    if attempt < 0:
        raise ValueError(f"expected attempt >= 0, got {attempt}")
    window = min(max_s, base_s * 2.0 ** min(attempt, 62))
    return rng.uniform(0.0, window)


def retry_advice_s(streak: int, rng: random.Random, base_s: float = 1.0,
                   max_s: float = 30.0) -> float:
    """Advice for `Busy.retry_after_s` after `streak` refusals in a row (1: the first):
    at least half the window, so that a retry is never immediate, jittered over the rest."""
    window = min(max_s, base_s * 2.0 ** min(max(streak - 1, 0), 62))
    return window / 2 + rng.uniform(0.0, window / 2)
