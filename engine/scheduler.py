"""Scheduling policy: which requests run in the next backend step.

Plain Python with the clock passed in, so a test drives it step by step.
Earliest deadline first (docs/architecture.md, "Deadline scheduling") over
pieces of audio: each request's `due` is when its next piece must exist (the
engine sets it from the request's playback clock; a turn's first piece is due
"now"). The batch grows while the step it makes still ends before the most
urgent deadline (a batch that would make the urgent request late is cut back);
it never shrinks below one, so the most urgent request always runs. Where a
step's items share no work (`serial_items`: the piper backend, one call per
item) a bigger batch is only a longer step, so a step takes one item per core.

Bounded look-ahead: a request already further ahead of its listener than the
engine's look-ahead (`is_ahead`) runs only when no other request is
runnable, and then alone, so idle time is used but a new turn's first piece
waits behind at most one short step of such work.

Lanes (a backend whose steps run side by side): `plan_step` tells each step
what runs beside it (`StepPlan`), so a backend that sizes its work by the load
reads the engine's view rather than counting steps of its own.

Admission control counts open contexts against a capacity estimated from the
measured step costs (`StepCostModel`): a context that cannot be served without
breaking the deadlines already held is refused with `busy` at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.backend import BackendRequest, StepPlan, due_of
from engine.types import RequestId, SynthesisRequest


@dataclass(slots=True)
class SchedulerConfig:
    """Policy knobs; `max_contexts` of 0 means "estimate from measured cost"."""

    #: "edf": earliest deadline first with adaptive batches; "fifo": one request
    #: at a time in arrival order (the naive server, kept as a benchmark baseline).
    policy: str = "edf"
    max_batch_size: int = 8
    #: items that run side by side in one step at the cost of one (Backend.parallelism)
    parallelism: int = 1
    #: items of a step share no work (Backend.serial_items): a step takes `parallelism`
    #: items, never more, so a new turn's first piece waits behind one item's work
    serial_items: bool = False
    #: a batch of work that is not yet due stops growing at this predicted step
    #: length, so a new turn's first segment never waits behind a long step of
    #: look-ahead work (a step cannot be interrupted once it runs)
    max_background_step_s: float = 0.25
    max_queued_requests: int = 4096
    max_contexts: int = 0
    min_contexts: int = 16
    target_utilization: float = 0.7
    #: a context is assumed to need this much audio per second of wall time
    #: (1.0: it talks all the time); lower values admit more listeners who pause.
    talk_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in ("edf", "fifo"):
            raise ValueError(f"policy must be 'edf' or 'fifo', got {self.policy!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_contexts < 0:
            raise ValueError(f"max_contexts must be >= 0, got {self.max_contexts}")
        if not 0.1 <= self.target_utilization <= 1.0:
            raise ValueError(
                f"target_utilization must be within 0.1-1.0, got {self.target_utilization}"
            )
        if not 0.05 <= self.talk_ratio <= 1.0:
            raise ValueError(f"talk_ratio must be within 0.05-1.0, got {self.talk_ratio}")


@dataclass(slots=True)
class StepCostModel:
    """Online estimate of a step's cost: seconds = fixed + per_item * batch.

    Kept as exponentially weighted sums of the quantities a least-squares fit
    needs, so it adapts when the machine's speed drifts.
    """

    decay: float = 0.9
    fixed_s: float = 0.02
    per_item_s: float = 0.05
    audio_s_per_item: float = 2.0
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    _audio: float = 0.0
    _items: float = 0.0

    def observe(self, batch_size: int, seconds: float, audio_s: float) -> None:
        d = self.decay
        x, y = float(batch_size), seconds
        self._n = d * self._n + 1.0
        self._sx = d * self._sx + x
        self._sy = d * self._sy + y
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * y
        self._audio = d * self._audio + audio_s
        self._items = d * self._items + x
        var = self._sxx / self._n - (self._sx / self._n) ** 2
        if var > 1e-6:
            slope = (self._sxy / self._n - self._sx * self._sy / self._n**2) / var
            self.per_item_s = max(slope, 1e-4)
            self.fixed_s = max(self._sy / self._n - self.per_item_s * self._sx / self._n, 0.0)
        else:
            self.per_item_s = max((self._sy / self._n) / max(self._sx / self._n, 1.0), 1e-4)
            self.fixed_s = 0.0
        if self._items > 0:
            self.audio_s_per_item = max(self._audio / self._items, 0.05)

    def step_seconds(self, batch_size: int) -> float:
        return self.fixed_s + self.per_item_s * batch_size

    def realtime_capacity(self, max_batch_size: int) -> float:
        """Audio seconds the backend makes per wall second at full batches."""
        return max_batch_size * self.audio_s_per_item / self.step_seconds(max_batch_size)


def context_of(request: SynthesisRequest) -> str:
    """The talking context a request belongs to (a request without one is its own)."""
    return request.context_key or f"request:{request.request_id}"


def is_busy(batch: list[BackendRequest], now: float, busy_lead_s: float) -> bool:
    """Whether a step of `batch` runs work due within `busy_lead_s` (not look-ahead that can
    wait)."""
    return min((due_of(item) for item in batch), default=now) - now <= busy_lead_s


def plan_step(batch: list[BackendRequest], now: float, beside: Iterable[bool],
              live_contexts: set[str]) -> list[StepPlan]:
    """Each item's `StepPlan` for a step of `batch` that starts at `now`.

    `beside`: for each step already running (another lane's), whether it is busy
    (`is_busy` when it started); `live_contexts`: the contexts (`context_of`) of every
    request prepared and not yet released, the batch's own among them.
    """
    beside = list(beside)
    is_alone, is_contended = not beside, any(beside)
    return [StepPlan(due_of(item), is_alone, is_contended,
                     live_contexts <= {context_of(item.request)}) for item in batch]


@dataclass(slots=True)
class _Entry:
    item: BackendRequest
    seq: int


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_deadline_misses: int = 0
    num_admitted: int = 0
    num_refused: int = 0
    last_batch_size: int = 0


class Scheduler:
    """Holds the runnable requests and picks each step's batch."""

    def __init__(self, config: SchedulerConfig | None = None,
                 memory_capacity: Callable[[], int] | None = None) -> None:
        """`memory_capacity`: talking contexts the backend's memory holds (0: no bound of its
        own; `Backend.context_capacity`), read at every admission."""
        self.config = config or SchedulerConfig()
        self.memory_capacity = memory_capacity or (lambda: 0)
        self.cost = StepCostModel()
        self.stats = SchedulerStats()
        self._entries: dict[RequestId, _Entry] = {}
        self._contexts: set[str] = set()
        self._seq = 0

    # -- requests -------------------------------------------------------
    @property
    def num_queued(self) -> int:
        return len(self._entries)

    def has_room(self) -> bool:
        return len(self._entries) < self.config.max_queued_requests

    def add(self, item: BackendRequest) -> None:
        if not self.has_room():
            raise OverflowError(
                f"scheduler queue is full ({self.config.max_queued_requests} requests)"
            )
        self._seq += 1
        self._entries[item.request_id] = _Entry(item, self._seq)

    def remove(self, request_id: RequestId) -> BackendRequest | None:
        """Drop a request (finished or cancelled); it is never scheduled again."""
        entry = self._entries.pop(request_id, None)
        return entry.item if entry else None

    def items(self) -> Iterable[BackendRequest]:
        return (e.item for e in self._entries.values())

    def schedule(
        self, now: float, is_runnable: Callable[[BackendRequest], bool] = lambda _: True,
        is_ahead: Callable[[BackendRequest], bool] = lambda _: False,
        due_by: float | None = None,
    ) -> list[BackendRequest]:
        """The next batch: earliest deadline first, sized so the urgent one is on time.

        With `due_by`, nothing unless the most urgent request is due by then (the
        engine's second lane takes only work that cannot wait for the first).
        """
        runnable = [e for e in self._entries.values() if is_runnable(e.item)]
        if due_by is not None:
            runnable = [e for e in runnable if due_of(e.item) <= due_by]
        ready = [e for e in runnable if not is_ahead(e.item)]
        if not ready:
            if not runnable:
                return []
            # Only look-ahead work is left: the most urgent of it, alone (one short step).
            ahead = min(runnable, key=lambda e: (due_of(e.item), e.seq))
            self.stats.num_steps += 1
            self.stats.last_batch_size = 1
            return [ahead.item]
        if self.config.policy == "fifo":
            oldest = min(ready, key=lambda e: e.seq)
            self.stats.num_steps += 1
            self.stats.last_batch_size = 1
            return [oldest.item]
        # Ties (e.g. many first segments due "now") go to the older request: no starvation.
        ready.sort(key=lambda e: (due_of(e.item), e.seq))
        urgent_deadline = due_of(ready[0].item)
        limit = min(self.config.max_batch_size, len(ready))
        if self.config.serial_items:
            limit = min(limit, self.config.parallelism)
        # Items up to the backend's parallelism ride along for free (another core).
        size = max(1, min(self.config.parallelism, limit))
        while size < limit:
            step_end = now + self.cost.step_seconds(size + 1)
            # Grow while the urgent request still makes its deadline, or while the
            # candidate is itself due before the step could end (then serving it
            # now, batched, beats making it wait a whole further step).
            is_due = due_of(ready[size].item) <= step_end
            fits = step_end <= urgent_deadline and (
                self.cost.step_seconds(size + 1) <= self.config.max_background_step_s)
            if is_due or fits:
                size += 1
            else:
                break
        batch = [e.item for e in ready[:size]]
        self.stats.num_steps += 1
        self.stats.last_batch_size = len(batch)
        return batch

    def record_step(self, batch: list[BackendRequest], seconds: float, audio_s: float,
                    now: float) -> None:
        self.cost.observe(len(batch), seconds, audio_s)
        self.stats.num_deadline_misses += sum(1 for b in batch if due_of(b) + seconds < now - 1e-3)

    # -- admission ------------------------------------------------------
    @property
    def num_contexts(self) -> int:
        return len(self._contexts)

    def max_contexts(self) -> int:
        """The admission limit: the configured one, else the estimate from measured step costs
        (at least `min_contexts`); either way never more than the backend's memory holds (a
        GPU's flow cache), so a context past it is refused as busy, never run out of memory."""
        limit = self.config.max_contexts
        if not limit:
            capacity = self.cost.realtime_capacity(self.config.max_batch_size)
            limit = max(self.config.min_contexts,
                        int(capacity * self.config.target_utilization / self.config.talk_ratio))
        memory = self.memory_capacity()
        return min(limit, memory) if memory > 0 else limit

    def is_admitted(self, context_key: str) -> bool:
        return context_key in self._contexts

    def admit(self, context_key: str) -> bool:
        if context_key in self._contexts:
            return True
        if len(self._contexts) >= self.max_contexts():
            self.stats.num_refused += 1
            return False
        self._contexts.add(context_key)
        self.stats.num_admitted += 1
        return True

    def release_context(self, context_key: str) -> None:
        self._contexts.discard(context_key)
