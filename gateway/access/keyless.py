"""Sockets still waiting for their key: a small pool of their own.

An ElevenLabs socket may send its key in its first message instead of its
handshake (gateway/access/admission.py, `defer_auth`). Until the key comes the
socket is nobody's: it speaks nothing and is closed with 1008 after
`VOXGATE_LIMIT_AUTH_TIMEOUT_S` (5 s). Counted in the server's session cap, a
few addresses reconnecting such sockets every 5 s would fill the server, and
keyed clients would get `busy`. So a waiting socket takes a place here
instead, and in nothing else: at most `max_sockets` in all, and at most
`max_per_address` from one client address, so one address cannot take the
pool from everyone else's first-message clients. When its key comes the
socket takes a place in the session cap and its key's socket count like any
keyed socket (`Admission.rekey`), and gives this one back
(docs/operations.md, "Auth").

Like `KeyCounter`, a place is taken before the handshake is answered, with no
await between the check and the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KeylessPool:
    """Places for sockets waiting for a key, in all and per client address (a bounded dict:
    one entry per address with a socket waiting)."""

    max_sockets: int = 64
    max_per_address: int = 8
    counts: dict[str, int] = field(default_factory=dict)
    num_open: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.max_per_address <= self.max_sockets:
            raise ValueError("expected 1 <= max_keyless_sockets_per_address <= "
                             f"max_keyless_sockets, got {self.max_per_address} and "
                             f"{self.max_sockets}")

    def acquire(self, address: str) -> str | None:
        """Take a place for a socket from `address`; None when taken, else why not: "busy"
        (the pool is full) or "rate_limited" (this address holds its share of it)."""
        if self.num_open >= self.max_sockets:
            return "busy"
        held = self.counts.get(address, 0)
        if held >= self.max_per_address:
            return "rate_limited"
        self.counts[address] = held + 1
        self.num_open += 1
        return None

    def release(self, address: str) -> None:
        held = self.counts.get(address, 0)
        if held <= 0:
            return
        self.num_open -= 1
        if held > 1:
            self.counts[address] = held - 1
        else:
            del self.counts[address]
