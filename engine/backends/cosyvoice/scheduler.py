"""The cosyvoice backend's scheduler: what one tick runs, decided from the sequence table alone.

Plain Python with no torch and no clock, like the engine's scheduler
(engine/scheduler.py), and driven by the same urgency: each sequence's `due`
is the engine's `due_of` for its request, refreshed before every tick. The
engine picks the batch (earliest due first); this module decides what the
batch needs from the backend's two memories:

- `plan_lm`: the LM's slots. A sequence of the batch without a slot (new, or
  parked by a preemption) starts now. A new one also needs a flow stream, so
  it starts only if the flow's K/V cache holds one more (`num_flows_fit`);
  the rest wait, reported (`Wait.FLOW_CACHE`). When the slots run short,
  holders outside the batch give theirs up, the one due last first
  (preemption by recomputation: it keeps its flow stream and tokens, and
  resumes from them); what still finds no slot waits (`Wait.LM_SLOT`).
- `plan_flow`: the flow's rows of the tick. Every sequence with a chunk ready,
  in the batch or not (a flushing stream's last chunks give its cache blocks
  back), the earliest due first, at most `max_rows`; and, with a horizon, a
  row due beyond it only while the tick has room under `min_rows`. A tick
  costs a fixed part and a part per row, and a row in it delays every other
  row of it. Without the horizon, in the model of an H200 (bench/gpu_shaped.py),
  a burst of new turns (first chunks due now, beside look-ahead chunks due up
  to 1.5 s on) ran ticks of 30-46 rows that took 75-120 ms, and a first chunk
  waited for one such tick and rode in the next. A quiet tick still carries
  look-ahead, up to `min_rows` (docs/cosyvoice-design.md, "What keeps a GPU
  busy").

A sequence of the batch that waits is never held silently: the backend
returns it as waiting, with its reason, and the engine counts it (engine/stats.py).
With a batch no larger than the LM's slots (`Resolved.batch_size`) and
admission within what the table holds (`Backend.context_capacity`), neither
wait happens in steady state; tests/unit/engine/cosyvoice/test_scheduler.py
drives every rule with tables of cases.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.backends.cosyvoice.sequences import SeqState, Sequence, SequenceTable


class Wait(enum.Enum):
    """Why a sequence of the batch did not run this tick (the engine's wait metric's label)."""

    LM_SLOT = "lm_slot"
    FLOW_CACHE = "flow_cache"


@dataclass(slots=True)
class LMPlan:
    """The LM's part of a tick, in the order the runs carry it out."""

    #: give their slots up first, the one due last first
    preempt: list[Sequence] = field(default_factory=list)
    #: prefill now (new, or resumed), the earliest due first
    start: list[Sequence] = field(default_factory=list)
    #: the batch's slot holders once the starts are in: one LM step each
    decode: list[Sequence] = field(default_factory=list)
    #: the batch's sequences held back this tick, and why
    waiting: dict[str, Wait] = field(default_factory=dict)


def plan_lm(table: SequenceTable, batch: list[Sequence], num_free_slots: int,
            num_flows_fit: Callable[[list[Sequence]], int]) -> LMPlan:
    """The LM's part of a tick for `batch` (sequences of `table`).

    `num_free_slots`: slots free now; `num_flows_fit(seqs)`: how many of these new
    sequences (in order) the flow's cache holds together now.
    """
    ordered = sorted(batch, key=lambda s: s.due)  # stable: a tie keeps the engine's order
    plan = LMPlan()
    wanting = [s for s in ordered if s.state in (SeqState.WAITING, SeqState.PARKED)]
    new = [s for s in wanting if s.state is SeqState.WAITING]
    num_fit = num_flows_fit(new) if new else 0
    for seq in new[num_fit:]:
        plan.waiting[seq.key] = Wait.FLOW_CACHE
    wanting = [s for s in wanting if s.key not in plan.waiting]
    in_batch = {s.key for s in batch}
    victims = sorted((s for s in table.in_state(SeqState.PREFILLING, SeqState.DECODING)
                      if s.key not in in_batch), key=lambda s: s.due, reverse=True)
    free = num_free_slots
    for victim in victims:
        if free >= len(wanting):
            break
        plan.preempt.append(victim)
        free += 1
    plan.start = wanting[:free]
    for seq in wanting[free:]:
        plan.waiting[seq.key] = Wait.LM_SLOT
    starting = {s.key for s in plan.start}
    plan.decode = [s for s in ordered if s.holds_slot or s.key in starting]
    return plan


def plan_flow(table: SequenceTable, ready: Iterable[str], max_rows: int, *,
              horizon: float | None = None, min_rows: int = 1) -> list[str]:
    """The flow rows of a tick: the sequences of `ready` (a chunk can be computed now) that are
    in the table, the earliest due first (a tie keeps `ready`'s order), at most `max_rows`.

    `horizon` (a time on the dues' clock: now plus the backend's `flow_horizon_s`): a row due
    after it is left for a later tick once the tick has `min_rows` rows (module doc); so a tick
    with nothing due soon still computes look-ahead, up to `min_rows`.
    """
    rows = [seq for key in ready if (seq := table.get(key)) is not None and seq.holds_flow]
    rows.sort(key=lambda s: s.due)
    if horizon is not None:
        num_soon = sum(1 for s in rows if s.due <= horizon)
        rows = rows[:max(num_soon, min_rows)]
    return [s.key for s in rows[:max_rows]]
