"""Fair share of the engine: no one client holds every talking context.

The engine admits a context when its first segment goes to synthesis and
refuses new ones at capacity (engine/scheduler.py, "admission"). On its own
that is first come, first served: one socket that opens sixteen turns and
never finishes them holds all sixteen slots, and everyone else gets `busy`.
`FairShare` sits in front of the engine's `admit` / `release_context` and caps
what one *owner* may hold at `max_share` of the engine's contexts, so the rest
stays free for others.

An owner is who pays for the work: the API key when auth is on (its hash,
never the key itself, so owner ids are safe to log), the client's address when
auth is off, where any key passes and so a key would name nobody
(`owner_of`). The socket cap per key (`max_sockets_per_key`) uses the same
owner, so with auth off it applies per client address.

A cap and not a fair queue: a context cannot be taken back once it talks, so
the only fair thing to do at the door is to keep room for others. The cap is
recomputed at every admission from the engine's current capacity (which the
scheduler may measure and revise), and it is at least one context, so every
owner can always speak once. With `max_share` 1.0 the policy is off: a
client past the engine's capacity gets the engine's own `busy` (the engine is
full), not `rate_limited`, as it does whenever its share is the whole engine.

Plain Python, no I/O and no clock: tests/unit/gateway/access/test_fair_share.py drives it with a
fake engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import ShareExceededError

__all__ = ["FairShare", "FairShareConfig", "owner_of"]


def owner_of(key: str | None, client_host: str | None, *, is_auth_enabled: bool) -> str:
    """Who a request or socket counts against (see the module doc)."""
    if is_auth_enabled and key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return "addr:" + (client_host or "unknown")


@dataclass(slots=True)
class FairShareConfig:
    #: the part of the engine's talking contexts one owner may hold (1.0: no cap)
    max_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(f"max_share must be within (0, 1], got {self.max_share}")


@dataclass(slots=True)
class FairShare:
    """Admission per owner, in front of the engine's own (see the module doc).

    `admit` and `release` are the engine's (`Engine.admit`, which raises
    EngineBusyError when the engine is full, and `Engine.release_context`);
    `capacity` returns the engine's current limit on talking contexts.
    """

    admit_engine: Callable[[str], None]
    release_engine: Callable[[str], None]
    capacity: Callable[[], int]
    config: FairShareConfig = field(default_factory=FairShareConfig)
    num_refused: int = 0
    _owner_by_context: dict[str, str] = field(default_factory=dict)
    _num_held: dict[str, int] = field(default_factory=dict)

    def max_per_owner(self) -> int:
        return max(1, int(self.capacity() * self.config.max_share))

    def num_held(self, owner: str) -> int:
        return self._num_held.get(owner, 0)

    def admit(self, owner: str, context_key: str) -> None:
        """Take a context for `owner`; raises ShareExceededError or the engine's EngineBusyError.

        Admitting a context already held is a no-op, as the engine's is.
        """
        if context_key in self._owner_by_context:
            return
        held = self._num_held.get(owner, 0)
        capacity = self.capacity()
        limit = max(1, int(capacity * self.config.max_share))
        # A share that is the whole engine (one tenant, or a one-context engine) is no cap of
        # its own: past it the engine is simply full, and the engine says `busy`.
        if held >= limit and limit < capacity:
            self.num_refused += 1
            raise ShareExceededError(
                f"this client holds {held} of the engine's {capacity} talking contexts, "
                "its share; finish (flush) or cancel one first")
        self.admit_engine(context_key)  # raises when the engine is full: nothing recorded
        self._owner_by_context[context_key] = owner
        self._num_held[owner] = held + 1

    def release(self, context_key: str) -> None:
        """Let go of a context (idempotent; unknown keys are ignored)."""
        owner = self._owner_by_context.pop(context_key, None)
        if owner is None:
            return
        self.release_engine(context_key)
        left = self._num_held.get(owner, 0) - 1
        if left > 0:
            self._num_held[owner] = left
        else:
            self._num_held.pop(owner, None)  # one entry per owner holding something: bounded
