"""The piper window plan: how long each decoder window of a segment is, and which pace it takes.

This module is policy, no onnxruntime: `WindowPlan` (the sizes, in latent
frames, by pace and window index, and where the flow's slices end), `Pace`
(a segment's kind of windows, chosen at its first window) and `PacePolicy`
(which pace a segment takes, from the engine's `StepPlan`: its due time,
whether its step runs alone or beside work due soon, and whether its
session is the only one talking). The backend runs what they say
(engine/backends/piper/windows.py); the sizes and leads come from
`PiperBackendConfig`.

Flow and decoder are convolutional with finite receptive fields, so a slice
with enough context equals the whole. Measured on joe when windows were
introduced (1 thread, a 4.4 s sentence): the decoder is ~70-78% of the cost;
W=64, C=16 equals the whole decode exactly (max abs 0.0) and costs 1.16x the
whole decode, W=128, C=16 1.03x; C=8 differs by 1e-4; W=16 costs 2.6x. With
both cores, W=128, C=12 matches to 2e-8 and decodes ~10% faster than C=16. The
flow matches exactly with 32 frames of context and costs 36 ms over a whole
2.7 s sentence against 13 ms over the 72 frames a first window needs. So a
segment's first window is small (first audio = text part + a short flow
slice + one short decode), later ones large. The sizes chosen and the
measurements behind them now: docs/benchmarks.md, "Decoder windows".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from engine.backend import StepPlan


class Pace(Enum):
    """How a segment's windows are cut (WindowPlan), decided at its first window."""

    # due now, and its context is the only one with work (one talking session): a smaller
    # first window, then as SHORT; nobody else's work is there to delay the second
    LONE = "lone"
    SHORT = "short"  # due now and its step runs alone: small first windows, the flow sliced
    # due soon, not yet, beside work due soon: its listener hears the turn, and a long first
    # window would be late (a gap); one medium first window, the flow sliced
    MEDIUM = "medium"
    LONG = "long"  # anything else: long windows, the flow in long pieces


@dataclass(slots=True, frozen=True)
class WindowPlan:
    """Window sizes in latent frames, by a segment's pace (`Pace`).

    A segment whose first audio is due now and whose step runs alone (no other
    lane busy: light load) takes a small first window and a medium second one,
    so first audio comes soon; one due soon (not yet: its listener hears the
    turn) beside other work one medium first window, which is ready in time
    where a long one might not be; any other takes long windows throughout. Small
    windows cost context decoded twice and a step each, and under load every
    other stream pays for that (docs/benchmarks.md, "Decoder windows"). A segment
    due now whose context is the only one with work (`Pace.LONE`) starts with a
    smaller window (`lone_first_frames`): no other stream's work is there to come
    before its second (docs/history.md, "Piper: windows and their sizes"). A
    short first flow slice runs on `first_flow_context_frames` where the second
    recomputes its frames anyway.
    The sizes come from `PiperBackendConfig` (its `window_*` options, where the
    defaults and their measurements are); its defaults end a turn's first
    windows just past the 20 ms frame grid of the gateway's Opus encoder at
    22050 Hz and hop 256: what does not fill a frame reaches the listener only
    with the next window (docs/benchmarks.md, "Decoder windows").
    """

    first_frames: int
    second_frames: int
    medium_first_frames: int
    frames: int
    context_frames: int
    flow_context_frames: int
    flow_frames: int
    lone_first_frames: int
    first_flow_context_frames: int

    def __post_init__(self) -> None:
        for name in ("first_frames", "second_frames", "medium_first_frames", "frames",
                     "flow_frames", "lone_first_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("context_frames", "flow_context_frames", "first_flow_context_frames"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def flow_end(self, done: int, needed: int, total: int) -> int:
        """Where the flow's next run ends: at least `needed`, `flow_frames` past `done`, no sliver
        left."""
        end = min(total, max(needed, done + self.flow_frames))
        if total - end < self.flow_frames // 2:
            end = total  # one call over the last short stretch costs less than two
        return end

    def is_first_slice_provisional(self, needed: int) -> bool:
        """Whether a segment's first flow slice, `needed` frames, may run on the short context.

        The next slice begins at frame 0 anyway (`needed` is within the flow's context), so
        its frames are recomputed there exactly and only the first window's audio reads
        them: the flow's error at the slice's end stays in the decoder's context, cut off.
        """
        return (self.first_flow_context_frames < self.flow_context_frames
                and needed <= self.flow_context_frames)

    @staticmethod
    def is_flow_sliced(pace: Pace, index: int) -> bool:
        """Whether window `index` at `pace` runs only the flow it needs (the short windows)."""
        return index < {Pace.LONE: 2, Pace.SHORT: 2, Pace.MEDIUM: 1, Pace.LONG: 0}[pace]

    def size(self, index: int, pace: Pace) -> int:
        """Frames of window `index` (from 0) at `pace`, before a segment's end cuts it."""
        if pace in (Pace.SHORT, Pace.LONE) and index < 2:
            first = self.lone_first_frames if pace is Pace.LONE else self.first_frames
            return first if index == 0 else self.second_frames
        if pace is Pace.MEDIUM and index == 0:
            return self.medium_first_frames
        return self.frames

    def can_catch_up(self, index: int, pace: Pace) -> bool:
        """Whether window `index` at `pace`, if due too soon, would be cut shorter
        (`window_end`)."""
        return index > 0 and self.size(index, pace) > self.second_frames

    def window_end(self, start: int, index: int, total: int, pace: Pace = Pace.SHORT,
                   is_catching_up: bool = False) -> int:
        """Where window `index` (from 0) that begins at frame `start` ends, at `pace`.

        A later window `is_catching_up` (due too soon for a long one: `can_catch_up`)
        is at most `second_frames`: ready sooner, and its listener's wait for the next longer.
        """
        size = self.size(index, pace)
        if is_catching_up:
            size = min(size, self.second_frames)
        end = min(total, start + size)
        if total - end < max(1, size // 4):
            end = total  # no sliver of a last window: it would cost a whole call
        return end


@dataclass(slots=True, frozen=True)
class PacePolicy:
    """Which pace a segment takes (`pace`) and when a later window is cut short (`is_catching_up`).

    The leads, in seconds, come from `PiperBackendConfig` (`window_urgent_lead_s`,
    `window_behind_s`, `window_medium_lead_s`, `window_catchup_lead_s`). What the rest
    of the box is doing comes from the engine's `StepPlan`: the backend never counts
    lanes or talking sessions itself.
    """

    urgent_lead_s: float
    behind_s: float
    medium_lead_s: float
    catchup_lead_s: float

    def pace(self, step: StepPlan, now: float) -> Pace:
        """How a segment's windows are cut, decided at its first window (WindowPlan).

        Short pieces (a small first window, a flow slice) only for a segment whose
        next audio is due soon (`step.due`, `urgent_lead_s` from `now`) and whose step
        runs alone or beside look-ahead work only (not `step.is_contended`): light load,
        where first audio is what counts. Beside another lane's step of work due soon,
        small windows cost every stream (context decoded twice, a step each, and a
        stream with 0.1 s of audio back for more while others wait), so such a
        segment, urgent or due within `medium_lead_s` (its lead is positive: its
        listener hears the turn), gets one medium first window, the flow sliced for
        it, then long ones: its audio comes in half the time of a long first window
        (docs/benchmarks.md, "Decoder windows": 12-session TTFA p95 183-236 ms
        against 299). A segment with lead to spare, or whose
        listener has waited longer than `behind_s` already, takes long
        windows: the box is behind, and long windows, more audio per second of
        work, catch up sooner. An urgent segment whose context is the only one
        with work (`step.is_lone`: one talking session) starts with a smaller window:
        no other stream's work is there to delay its second.
        """
        lead = step.due - now
        is_urgent = -self.behind_s <= lead <= self.urgent_lead_s
        if is_urgent and not step.is_contended:
            return Pace.LONE if step.is_lone else Pace.SHORT
        if is_urgent or 0.0 < lead <= self.medium_lead_s:
            return Pace.MEDIUM
        return Pace.LONG

    def is_catching_up(self, step: StepPlan, now: float) -> bool:
        """Whether a later window, its audio due at `step.due`, is due too soon for a long one.

        Where its listener runs dry within `catchup_lead_s` (or ran dry no longer than
        `behind_s` ago). The backend cuts such a window to at most `second_frames`
        where it would be longer (`WindowPlan.can_catch_up`), once per segment, so a
        box behind keeps the long windows that make more audio per second of work
        (docs/benchmarks.md, "Decoder windows"; why once: docs/history.md, "Piper:
        windows and their sizes"). A `catchup_lead_s` of 0 never cuts.
        """
        lead = step.due - now
        return self.catchup_lead_s > 0 and -self.behind_s <= lead <= self.catchup_lead_s
