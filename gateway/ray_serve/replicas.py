"""The gateway's view of the engine replicas: their room, and their reports summed.

`RemoteEngine` (remote.py) polls every engine replica for its capacity; this
module owns what it keeps of each answer and what it reads from them: a
`Replica`'s room (its free contexts less those placed there since its last
answer), the replica with the most room (`roomiest`, where a context goes), and
the replicas' scheduler and engine counters summed into the one view that
/metrics reads (`sum_reports`). It makes no calls: the polling, placement and
requests are remote.py's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.stats import EngineStats
from engine.wire import SchedulerCounters


@dataclass(slots=True)
class Replica:
    replica_id: str
    is_ready: bool = False  # answered a poll and holds every voice
    max_contexts: int = 0
    num_contexts: int = 0
    num_placed: int = 0  # contexts placed here since its last answer
    last_seen: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def room(self) -> int:
        return self.max_contexts - self.num_contexts - self.num_placed


def roomiest(replicas: Iterable[Replica],
             exclude: frozenset[str] | set[str] = frozenset()) -> Replica | None:
    """The ready replica with the most room, outside `exclude`; None when none has room."""
    ready = [r for r in replicas if r.is_ready and r.replica_id not in exclude and r.room > 0]
    return max(ready, key=lambda r: r.room, default=None)


def sum_reports(reports: list[dict[str, Any]]) -> tuple[SchedulerCounters, EngineStats]:
    """The replicas' capacity reports summed (the `last_*` stats: their maximum)."""
    totals = SchedulerCounters()
    stats = EngineStats()
    for report in reports:
        totals.num_queued += report["num_queued"]
        totals.num_contexts += report["num_contexts"]
        totals.total_contexts += report["max_contexts"]
        for name, value in report["scheduler"].items():
            setattr(totals.stats, name, getattr(totals.stats, name) + value)
        for name, value in report["stats"].items():
            if name.endswith("_bucket_counts"):
                # a replica of another version may count other buckets: the common ones add up
                pairs = zip(getattr(stats, name), value, strict=False)
                setattr(stats, name, [a + b for a, b in pairs])
            elif name == "waits":
                for reason, count in value.items():
                    stats.waits[reason] = stats.waits.get(reason, 0) + count
            elif name.startswith("last_"):
                setattr(stats, name, max(getattr(stats, name), value))
            else:
                setattr(stats, name, getattr(stats, name) + value)
    return totals, stats
