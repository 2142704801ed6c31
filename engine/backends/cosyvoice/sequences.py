"""The cosyvoice backend's sequence table: every stream's state in one place.

A sequence is one request on its way through the LM and the flow. The table
holds all of them, and with each what it holds and what it made: its LM slot,
its flow stream (and so its share of the flow's K/V cache), its speech tokens
and its audio. The scheduler (scheduler.py) reads the table to decide a tick;
the runs (tick.py) move sequences from state to state as the work is done;
`release` takes a sequence out in any state. Plain Python, no torch: the
counters (`num_slots`, `num_flows`, `num_in`) are what the tests check after
every cancel, and what admission counts.

    WAITING --start--> PREFILLING --tokens--> DECODING --LM done--> FLUSHING --last chunk--> DONE
       |                   |  ^                  |                     (no token: DONE at once)
       |                   +--|-----preempt------+--> PARKED --start (resume from its tokens)--+
       +-- cancel from any state: `SequenceTable.remove` frees what the state holds

| state      | LM slot | flow stream | what it waits for |
|------------|---------|-------------|-------------------|
| WAITING    |         |             | a slot, and room in the flow's cache for its stream |
| PREFILLING | yes     | yes         | its first speech token (vLLM: the prompt is being computed) |
| DECODING   | yes     | yes         | its LM's next tokens; the flow's chunks as they are ready |
| PARKED     |         | yes         | a slot again (preempted: it resumes from its tokens) |
| FLUSHING   |         | yes         | the flow's last chunks (the LM is done) |
| DONE       |         |             | its last audio to be returned (`outbox`) |

docs/cosyvoice-design.md, "Backend design", draws the same.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PARKED = "parked"
    FLUSHING = "flushing"
    DONE = "done"


HOLDS_SLOT = frozenset({SeqState.PREFILLING, SeqState.DECODING})
HOLDS_FLOW = frozenset({SeqState.PREFILLING, SeqState.DECODING, SeqState.PARKED, SeqState.FLUSHING})


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's stream. `inputs` are the backend's (its voice, LM input, speed, tick.py):
    the scheduler never reads them."""

    key: str
    seed: int  # the LM's sampling and the flow's noise; kept across preemption
    inputs: Any = None
    due: float = 0.0  # when its next audio must exist (the engine's `due_of`), refreshed every tick
    state: SeqState = SeqState.WAITING
    tokens: list[int] = field(default_factory=list)  # made so far: a parked one resumes from them
    num_samples: int = 0  # audio returned
    outbox: deque[np.ndarray] = field(default_factory=deque)  # audio made, not yet returned
    is_last_out: bool = False  # the outbox holds its last audio

    @property
    def holds_slot(self) -> bool:
        return self.state in HOLDS_SLOT

    @property
    def holds_flow(self) -> bool:
        return self.state in HOLDS_FLOW

    def take_audio(self) -> np.ndarray:
        """The audio made since it was last returned, as one array (empty: none)."""
        if not self.outbox:
            return np.zeros(0, dtype=np.float32)
        pcm = self.outbox[0] if len(self.outbox) == 1 else np.concatenate(list(self.outbox))
        self.outbox.clear()
        self.num_samples += len(pcm)
        return pcm


class SequenceTable:
    """Every live sequence by key, with counters kept as states change (never recounted)."""

    def __init__(self) -> None:
        self._seqs: dict[str, Sequence] = {}
        self._counts = dict.fromkeys(SeqState, 0)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, key: object) -> bool:
        return key in self._seqs

    def get(self, key: str) -> Sequence | None:
        return self._seqs.get(key)

    def num_in(self, state: SeqState) -> int:
        return self._counts[state]

    @property
    def num_slots(self) -> int:
        """LM slots the table's sequences hold."""
        return sum(self._counts[s] for s in HOLDS_SLOT)

    @property
    def num_flows(self) -> int:
        """Flow streams (each with its K/V cache blocks) the table's sequences hold."""
        return sum(self._counts[s] for s in HOLDS_FLOW)

    def add(self, seq: Sequence) -> None:
        if seq.key in self._seqs:
            raise ValueError(f"expected a new sequence key, got {seq.key!r} (already in the table)")
        self._seqs[seq.key] = seq
        self._counts[seq.state] += 1

    def remove(self, key: str) -> Sequence | None:
        """Take a sequence out in whatever state (finished or cancelled); None if unknown.
        The caller frees what the state held (`holds_slot`, `holds_flow`) before or after."""
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self._counts[seq.state] -= 1
        return seq

    def move(self, seq: Sequence, state: SeqState) -> None:
        """Set a sequence's state, checking the transition against the diagram above."""
        if state not in _NEXT[seq.state]:
            raise ValueError(f"expected a move from {seq.state.value} to one of "
                             f"{sorted(s.value for s in _NEXT[seq.state])}, got {state.value}")
        self._counts[seq.state] -= 1
        self._counts[state] += 1
        seq.state = state

    def in_state(self, *states: SeqState) -> list[Sequence]:
        return [s for s in self._seqs.values() if s.state in states]


_NEXT: dict[SeqState, frozenset[SeqState]] = {
    SeqState.WAITING: frozenset({SeqState.PREFILLING, SeqState.DONE}),
    SeqState.PREFILLING: frozenset({SeqState.DECODING, SeqState.PARKED, SeqState.FLUSHING,
                                    SeqState.DONE}),
    SeqState.DECODING: frozenset({SeqState.PARKED, SeqState.FLUSHING}),
    SeqState.PARKED: frozenset({SeqState.PREFILLING}),
    SeqState.FLUSHING: frozenset({SeqState.DONE}),
    SeqState.DONE: frozenset(),
}
