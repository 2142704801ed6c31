"""The fair-share policy, driven synchronously with a stand-in engine (a set with a limit).

The stand-in keeps the engine's admission contract (admit raises EngineBusyError
at capacity, release is idempotent) so that the policy's own rules are what is
tested; the real engine behind it is tests/e2e/test_hardening.py's.
"""

from __future__ import annotations

import pytest

from engine.errors import EngineBusyError
from gateway.access.fair_share import FairShare, FairShareConfig, owner_of
from gateway.errors import ShareExceededError


class Engine:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.contexts: set[str] = set()

    def admit(self, key: str) -> None:
        if key not in self.contexts and len(self.contexts) >= self.capacity:
            raise EngineBusyError("full")
        self.contexts.add(key)

    def release(self, key: str) -> None:
        self.contexts.discard(key)


def make(capacity: int = 16, share: float = 0.5) -> tuple[FairShare, Engine]:
    engine = Engine(capacity)
    return FairShare(
        engine.admit, engine.release, lambda: engine.capacity, FairShareConfig(share)), engine


def test_one_owner_holds_at_most_its_share_and_the_rest_stays_for_others() -> None:
    policy, engine = make(16, 0.5)
    for n in range(8):
        policy.admit("hoarder", f"h{n}")
    with pytest.raises(ShareExceededError, match="holds 8 of the engine's 16"):
        policy.admit("hoarder", "h8")
    assert policy.num_refused == 1 and len(engine.contexts) == 8
    for n in range(8):
        policy.admit("other", f"o{n}")  # another owner still gets the other half
    assert len(engine.contexts) == 16


def test_a_full_engine_still_refuses_with_busy_and_records_nothing() -> None:
    policy, _ = make(2, 1.0)
    policy.admit("a", "a0")
    policy.admit("b", "b0")
    with pytest.raises(EngineBusyError):
        policy.admit("c", "c0")
    assert policy.num_held("c") == 0


def test_release_gives_the_slot_back_to_its_owner_and_is_idempotent() -> None:
    policy, engine = make(4, 0.5)
    policy.admit("a", "a0")
    policy.admit("a", "a1")
    policy.release("a0")
    policy.release("a0")
    policy.release("never-admitted")
    assert policy.num_held("a") == 1 and engine.contexts == {"a1"}
    policy.admit("a", "a2")
    policy.release("a1")
    policy.release("a2")
    assert policy.num_held("a") == 0 and engine.contexts == set()


def test_admitting_a_context_twice_counts_it_once() -> None:
    policy, _ = make(4, 0.5)
    policy.admit("a", "a0")
    policy.admit("a", "a0")
    assert policy.num_held("a") == 1


def test_every_owner_may_speak_once_however_small_the_engine() -> None:
    policy, _ = make(1, 0.25)
    assert policy.max_per_owner() == 1
    policy.admit("a", "a0")


def test_the_cap_follows_the_engines_capacity_as_it_is_remeasured() -> None:
    policy, engine = make(4, 0.5)
    policy.admit("a", "a0")
    policy.admit("a", "a1")
    with pytest.raises(ShareExceededError):
        policy.admit("a", "a2")
    engine.capacity = 10
    policy.admit("a", "a2")
    assert policy.max_per_owner() == 5


def test_owners_are_keys_with_auth_on_and_client_addresses_with_auth_off() -> None:
    key = "sk-test-0123456789"
    assert owner_of(key, "10.0.0.1", is_auth_enabled=True) == owner_of(
        key, "10.0.0.2", is_auth_enabled=True)
    assert key not in owner_of(key, "10.0.0.1", is_auth_enabled=True)  # a hash: safe to log
    # auth off: any key passes, so a key names nobody; the address does
    assert owner_of("made-up-1", "127.0.0.1", is_auth_enabled=False) == owner_of(
        "made-up-2", "127.0.0.1", is_auth_enabled=False) == "addr:127.0.0.1"
    assert owner_of(None, "127.0.0.2", is_auth_enabled=False) != "addr:127.0.0.1"


def test_a_share_outside_zero_to_one_is_refused() -> None:
    for share in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="max_share"):
            FairShareConfig(share)


def test_with_the_whole_engine_as_the_share_one_client_past_capacity_gets_busy() -> None:
    policy, engine = make(16, 1.0)  # one tenant (loopback mode): the share is no cap of its own
    for n in range(16):
        policy.admit("addr:127.0.0.1", f"c{n}")
    with pytest.raises(EngineBusyError):  # the engine is full: the code back-off logic knows
        policy.admit("addr:127.0.0.1", "c16")
    assert policy.num_refused == 0 and len(engine.contexts) == 16
    small, _ = make(1, 0.5)  # a one-context engine: its share of one is the whole of it
    small.admit("a", "a0")
    with pytest.raises(EngineBusyError):
        small.admit("a", "a1")
