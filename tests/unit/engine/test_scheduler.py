"""Scheduling policy with a fake clock: EDF order, batch sizing, cancellation, admission."""

from __future__ import annotations

import pytest

from engine.backend import BackendRequest, StepPlan, due_of
from engine.scheduler import (
    Scheduler,
    SchedulerConfig,
    StepCostModel,
    context_of,
    is_busy,
    plan_step,
)
from engine.types import RequestId, SynthesisRequest


def item(name: str, due: float, context: str = "") -> BackendRequest:
    """A prepared request whose next audio is due at `due` (as the engine's clock would set it)."""
    return BackendRequest(SynthesisRequest(RequestId(name), "text", "v", context_key=context),
                          due=due)


def scheduler(max_batch_size: int = 4, fixed: float = 0.01, per_item: float = 0.05) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_batch_size=max_batch_size))
    s.cost.fixed_s, s.cost.per_item_s = fixed, per_item
    return s


def test_batch_is_picked_earliest_deadline_first() -> None:
    s = scheduler(max_batch_size=2)
    for name, deadline in [("late", 9.0), ("now", 0.0), ("soon", 0.05), ("later", 5.0)]:
        s.add(item(name, deadline))
    assert [b.request_id for b in s.schedule(now=0.0)] == ["now", "soon"]


def test_batch_stops_growing_when_it_would_make_the_urgent_request_late() -> None:
    s = scheduler(max_batch_size=8, fixed=0.01, per_item=0.05)
    s.add(item("urgent", 0.12))   # a batch of 2 ends at 0.11, of 3 at 0.16
    for n in range(5):
        s.add(item(f"relaxed{n}", 10.0))
    assert len(s.schedule(now=0.0)) == 2


def test_requests_already_due_are_batched_together() -> None:
    s = scheduler(max_batch_size=8)
    for n in range(6):
        s.add(item(f"due{n}", 0.0))   # six first segments, all due now
    assert len(s.schedule(now=0.5)) == 6


def test_work_far_from_its_deadline_fills_whole_batches() -> None:
    s = scheduler(max_batch_size=4)
    for n in range(10):
        s.add(item(f"r{n}", 100.0 + n))
    assert len(s.schedule(now=0.0)) == 4


def test_a_removed_request_is_never_scheduled_again() -> None:
    s = scheduler()
    s.add(item("keep", 1.0))
    s.add(item("gone", 0.0))
    assert s.remove(RequestId("gone")) is not None
    assert [b.request_id for b in s.schedule(now=0.0)] == ["keep"]
    assert s.remove(RequestId("gone")) is None


def test_equal_deadlines_are_served_in_arrival_order_so_none_starves() -> None:
    s = scheduler(max_batch_size=1)
    for n in range(5):
        s.add(item(f"r{n}", 0.0))
    served = []
    for _ in range(5):
        (picked,) = s.schedule(now=1.0)
        served.append(picked.request_id)
        s.remove(picked.request_id)
        s.add(item(f"new{len(served)}", 1.0))  # newcomers keep arriving, due later
    assert served == [f"r{n}" for n in range(5)]


def test_requests_that_cannot_run_are_skipped() -> None:
    s = scheduler()
    s.add(item("blocked", 0.0))
    s.add(item("free", 1.0))
    batch = s.schedule(now=0.0, is_runnable=lambda b: b.request_id != "blocked")
    assert [b.request_id for b in batch] == ["free"]


def test_admission_refuses_past_the_configured_limit_and_frees_on_release() -> None:
    s = Scheduler(SchedulerConfig(max_contexts=2))
    assert s.admit("a") and s.admit("b") and s.admit("a")
    assert not s.admit("c")
    assert s.stats.num_refused == 1
    s.release_context("a")
    assert s.admit("c")


def test_estimated_capacity_follows_measured_step_cost() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=8, target_utilization=1.0, min_contexts=1))
    for _ in range(50):  # 8 items of 2 s audio in 0.4 s: 40x realtime
        s.cost.observe(8, 0.4, 16.0)
        s.cost.observe(4, 0.22, 8.0)
    assert s.max_contexts() == pytest.approx(40, rel=0.15)
    for _ in range(50):  # the machine got 4x slower
        s.cost.observe(8, 1.6, 16.0)
        s.cost.observe(4, 0.88, 8.0)
    assert s.max_contexts() == pytest.approx(10, rel=0.15)


def test_cost_model_fits_fixed_and_per_item_cost() -> None:
    cost = StepCostModel()
    for size in (1, 2, 4, 8) * 20:
        cost.observe(size, 0.02 + 0.03 * size, size * 2.0)
    assert cost.fixed_s == pytest.approx(0.02, abs=0.005)
    assert cost.per_item_s == pytest.approx(0.03, abs=0.005)


def test_full_queue_refuses_more_requests() -> None:
    s = Scheduler(SchedulerConfig(max_queued_requests=2))
    s.add(item("a", 0))
    s.add(item("b", 0))
    with pytest.raises(OverflowError, match="full"):
        s.add(item("c", 0))


def test_bad_config_says_what_was_expected() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        SchedulerConfig(max_batch_size=0)


def test_fifo_policy_serves_one_request_at_a_time_in_arrival_order() -> None:
    s = Scheduler(SchedulerConfig(policy="fifo", max_batch_size=8))
    s.add(item("first", 5.0))
    s.add(item("urgent", 0.0))
    assert [b.request_id for b in s.schedule(now=0.0)] == ["first"]


def test_look_ahead_work_runs_in_short_steps_so_a_new_turn_waits_little() -> None:
    s = scheduler(max_batch_size=8, fixed=0.01, per_item=0.1)
    for n in range(8):
        s.add(item(f"ahead{n}", 100.0))   # far from due: background work
    assert len(s.schedule(now=0.0)) == 2  # 0.21 s fits the 0.25 s cap, 0.31 s would not


@pytest.mark.parametrize("parallelism", [1, 2])
def test_items_that_share_no_work_run_one_per_core_per_step(parallelism: int) -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=8, parallelism=parallelism, serial_items=True))
    s.cost.fixed_s, s.cost.per_item_s = 0.0, 0.05
    for n in range(6):
        s.add(item(f"due{n}", 0.0))  # all due: a batching backend would take all six
    assert len(s.schedule(now=0.5)) == parallelism


def test_due_by_holds_back_work_that_can_wait_for_a_running_step() -> None:
    scheduler = Scheduler(SchedulerConfig(max_batch_size=4))
    scheduler.add(item("soon", due=100.2))
    scheduler.add(item("later", due=102.0))
    assert [str(i.request_id) for i in scheduler.schedule(100.0, due_by=100.5)] == ["soon"]
    scheduler.remove(RequestId("soon"))
    assert scheduler.schedule(100.0, due_by=100.5) == [], "work due in 2 s took a second lane"
    assert [str(i.request_id) for i in scheduler.schedule(100.0)] == ["later"]


def test_a_request_stepped_without_an_engine_is_due_at_zero_until_a_clock_says_otherwise() -> None:
    first = BackendRequest(SynthesisRequest(RequestId("first"), "text", "v"))
    assert due_of(first) == 0.0  # every item equally and long overdue
    first.due = 3.5  # the engine's playback clock, set before each schedule
    assert due_of(first) == 3.5


def test_a_step_is_busy_only_with_work_due_within_the_backends_lead() -> None:
    assert is_busy([item("now", 10.0), item("later", 30.0)], now=10.0, busy_lead_s=0.5)
    assert is_busy([item("soon", 10.5)], now=10.0, busy_lead_s=0.5)
    assert not is_busy([item("ahead", 10.6)], now=10.0, busy_lead_s=0.5)


def test_each_item_is_planned_with_what_runs_beside_its_step_and_who_talks() -> None:
    mine = item("a", 1.0, context="s1")
    own = item("b", 2.0)  # no context: its own
    assert context_of(own.request) == "request:b"
    # nothing beside it, its context the only one with work: alone, the one talking session
    assert plan_step([mine], 0.0, [], {"s1"}) == [StepPlan(1.0, is_alone=True, is_lone=True)]
    # beside look-ahead work of another lane, another session talking
    assert plan_step([mine], 0.0, [False], {"s1", "s2"}) == [StepPlan(1.0, is_alone=False)]
    # beside work due soon: contended; each item of a step has its own due and context
    plans = plan_step([mine, own], 0.0, [False, True], {"s1", "request:b"})
    assert plans == [StepPlan(1.0, is_alone=False, is_contended=True),
                     StepPlan(2.0, is_alone=False, is_contended=True)]


def test_admission_never_passes_what_the_backends_memory_holds() -> None:
    memory = [3]
    s = Scheduler(SchedulerConfig(max_contexts=10), memory_capacity=lambda: memory[0])
    assert s.max_contexts() == 3
    assert s.admit("a") and s.admit("b") and s.admit("c")
    assert not s.admit("d")
    memory[0] = 0  # no bound of its own (piper): the configured limit alone
    assert s.max_contexts() == 10 and s.admit("d")
    estimated = Scheduler(SchedulerConfig(min_contexts=16), memory_capacity=lambda: 5)
    assert estimated.max_contexts() == 5  # the floor for a CPU's estimate yields to memory
