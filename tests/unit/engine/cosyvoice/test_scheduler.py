"""The cosyvoice scheduler and its sequence table, driven synchronously with tables of cases: no
torch, no clock, no model (engine/backends/cosyvoice/scheduler.py, sequences.py)."""

from __future__ import annotations

import pytest

from engine.backends.cosyvoice.scheduler import Wait, plan_flow, plan_lm
from engine.backends.cosyvoice.sequences import SeqState, Sequence, SequenceTable

W, PF, D, PK, F, X = (SeqState.WAITING, SeqState.PREFILLING, SeqState.DECODING, SeqState.PARKED,
                      SeqState.FLUSHING, SeqState.DONE)


def table_of(*rows: tuple[str, SeqState, float]) -> SequenceTable:
    """A table of (key, state, due) rows."""
    table = SequenceTable()
    for key, state, due in rows:
        table.add(Sequence(key, seed=0, due=due, state=state))
    return table


def fits(n: int | None):  # type: ignore[no-untyped-def]
    """The flow cache holds `n` more new streams (None: any number)."""
    return lambda seqs: len(seqs) if n is None else min(n, len(seqs))


def keys(seqs: list[Sequence]) -> list[str]:
    return [s.key for s in seqs]


@pytest.mark.parametrize(("holders", "free", "preempted"), [
    # (key, due) of the slot holders outside the batch; the victims in order, due last first
    ([("a", 1.0), ("b", 9.0), ("c", 5.0)], 0, ["b"]),
    ([("a", 1.0), ("b", 9.0), ("c", 5.0)], 1, []),  # a free slot: nobody gives way
    ([("a", 7.0), ("b", 2.0)], 0, ["a"]),
    ([("a", 3.0), ("b", 3.0)], 0, ["a"]),  # a tie: the table's order
])
def test_preemption_takes_the_stream_due_last(holders: list[tuple[str, float]], free: int,
                                              preempted: list[str]) -> None:
    table = table_of(*[(key, D, due) for key, due in holders], ("new", W, 0.5))
    plan = plan_lm(table, [table.get("new")], free, fits(None))  # type: ignore[list-item]
    assert keys(plan.preempt) == preempted
    assert keys(plan.start) == ["new"] and plan.waiting == {}


def test_whoever_is_outside_the_batch_gives_way_the_one_due_last_first() -> None:
    # the batch is the engine's pick: whoever is outside it gives way, the one due last first
    table = table_of(("early", D, 0.1), ("later", PF, 0.2), ("new1", W, 5.0), ("new2", PK, 6.0))
    batch = [table.get("new1"), table.get("new2")]
    plan = plan_lm(table, batch, 0, fits(None))  # type: ignore[arg-type]
    assert keys(plan.preempt) == ["later", "early"]
    assert keys(plan.start) == ["new1", "new2"]  # a parked one resumes beside the new one


@pytest.mark.parametrize(("batch", "free", "room", "start", "waiting"), [
    # batch (key, state, due); free slots; new streams the flow cache holds -> starts and waits
    ([("a", W, 2.0), ("b", W, 1.0), ("c", W, 3.0)], 3, 2, ["b", "a"], {"c": Wait.FLOW_CACHE}),
    # a parked one has its stream already
    ([("a", W, 2.0), ("p", PK, 9.0)], 2, 0, ["p"], {"a": Wait.FLOW_CACHE}),
    ([("a", W, 2.0), ("b", W, 1.0)], 1, None, ["b"], {"a": Wait.LM_SLOT}),  # nobody to preempt
    ([("a", D, 2.0), ("b", F, 1.0), ("c", X, 0.0)], 0, 0, [], {}),  # nothing to start
])
def test_what_cannot_start_waits_with_its_reason(
        batch: list[tuple[str, SeqState, float]], free: int, room: int | None, start: list[str],
        waiting: dict[str, Wait]) -> None:
    table = table_of(*batch)
    seqs = [table.get(key) for key, _, _ in batch]
    plan = plan_lm(table, seqs, free, fits(room))  # type: ignore[arg-type]
    assert keys(plan.start) == start and plan.waiting == waiting and plan.preempt == []


def test_the_batchs_slot_holders_and_its_starts_decode_due_first() -> None:
    table = table_of(("a", D, 3.0), ("b", PF, 1.0), ("c", W, 2.0), ("f", F, 0.0), ("x", D, 0.5))
    batch = [table.get(k) for k in ("a", "b", "c", "f")]
    plan = plan_lm(table, batch, 1, fits(None))  # type: ignore[arg-type]
    assert keys(plan.decode) == ["b", "c", "a"]  # "f" has no slot; "x" is not in the batch
    assert plan.preempt == []


@pytest.mark.parametrize(("rows", "ready", "cap", "want"), [
    # every sequence with a chunk ready, in the batch or not, the earliest due first, capped
    ([("a", D, 3.0), ("b", D, 1.0), ("c", F, 2.0)], ["a", "b", "c"], 8, ["b", "c", "a"]),
    ([("a", D, 3.0), ("b", D, 1.0), ("c", F, 2.0)], ["a", "b", "c"], 2, ["b", "c"]),
    ([("a", D, 1.0), ("b", D, 1.0)], ["b", "a"], 8, ["b", "a"]),  # a tie: the order ready in
    ([("a", PK, 2.0), ("w", W, 0.0)], ["a", "w", "gone"], 8, ["a"]),  # a parked stream flushes too
])
def test_the_flow_rows_of_a_tick(rows: list[tuple[str, SeqState, float]], ready: list[str],
                                 cap: int, want: list[str]) -> None:
    assert plan_flow(table_of(*rows), ready, cap) == want


BURST = [("new1", D, 10.0), ("new2", D, 10.05), ("ahead1", D, 11.2), ("ahead2", D, 10.9),
         ("ending", F, 12.0)]


@pytest.mark.parametrize(("horizon", "min_rows", "cap", "want"), [
    # no horizon: every ready row
    (None, 0, 8, ["new1", "new2", "ahead2", "ahead1", "ending"]),
    # rows due after the horizon wait for a later tick ...
    (10.3, 1, 8, ["new1", "new2"]),
    # ... unless the tick has room under min_rows: the earliest of them fill it
    (10.3, 3, 8, ["new1", "new2", "ahead2"]),
    (10.3, 9, 8, ["new1", "new2", "ahead2", "ahead1", "ending"]),
    # a horizon everything is within changes nothing, and the cap still holds
    (20.0, 0, 8, ["new1", "new2", "ahead2", "ahead1", "ending"]),
    (20.0, 0, 3, ["new1", "new2", "ahead2"]),
    # nothing due within the horizon: an idle flow still computes look-ahead, up to min_rows
    (9.0, 1, 8, ["new1"]),
    (9.0, 2, 8, ["new1", "new2"]),
])
def test_a_tick_takes_rows_due_beyond_its_horizon_only_to_fill_it(
        horizon: float | None, min_rows: int, cap: int, want: list[str]) -> None:
    """A burst of new turns (due now) beside look-ahead (due a second on): the look-ahead would
    make the tick that carries the new turns' first chunks longer (scheduler.py's module doc)."""
    table = table_of(*BURST)
    ready = [key for key, _, _ in BURST]
    assert plan_flow(table, ready, cap, horizon=horizon, min_rows=min_rows) == want


@pytest.mark.parametrize("path", [
    [],  # waiting
    [PF],  # prefilling (vLLM: the prompt is computed, no token yet)
    [PF, D],  # decoding
    [PF, D, PK],  # parked: preempted, its flow stream kept
    [PF, D, PK, PF],  # resumed
    [PF, D, F],  # flushing the flow
    [PF, D, F, X],  # done, its last audio not yet returned
])
def test_a_sequence_leaves_the_table_in_any_state_and_the_counters_return_to_zero(
        path: list[SeqState]) -> None:
    table = SequenceTable()
    seq = Sequence("s", seed=0)
    table.add(seq)
    for state in path:
        table.move(seq, state)
    assert (table.num_slots, table.num_flows) == (int(seq.holds_slot), int(seq.holds_flow))
    assert table.num_in(seq.state) == 1
    assert table.remove("s") is seq and table.remove("s") is None
    assert (len(table), table.num_slots, table.num_flows) == (0, 0, 0)
    assert all(table.num_in(state) == 0 for state in SeqState)


def test_a_move_off_the_diagram_is_refused_naming_the_moves_allowed() -> None:
    table = table_of(("s", W, 0.0))
    seq = table.get("s")
    assert seq is not None
    with pytest.raises(ValueError, match="expected a move from waiting to one of"):
        table.move(seq, SeqState.FLUSHING)
    with pytest.raises(ValueError, match="already in the table"):
        table.add(Sequence("s", seed=1))
