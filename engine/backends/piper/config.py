"""The piper backend's options: `PiperBackendConfig`, what the CLI and `VOXGATE_PIPER_*` set.

This module owns every knob of the piper backend and its validation: where
extra voices live, batch size and onnxruntime threads, the fixed loudness
target, how a step's items are packed into onnxruntime calls (padding waste,
one call per item, calls in parallel), and the decoder window sizes and leads,
which it hands on as a `WindowPlan` and a `PacePolicy` (plan.py). The order of
its fields is the order of the option list (tests/unit/engine/test_options.py).
The measurements behind the defaults are in docs/benchmarks.md ("Decoder
windows", "Component costs").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.backends.piper.plan import PacePolicy, WindowPlan


def _default_num_threads() -> int:
    # Half the cores, so the event loop (Opus encoding, sockets) keeps the rest.
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclass(slots=True)
class PiperBackendConfig:
    """Options of the piper backend (CLI/`VOXGATE_PIPER_*` map onto these)."""

    voices_dir: Path | None = None
    max_batch_size: int = 8
    num_threads: int = field(default_factory=_default_num_threads)
    # Peak of the voice's noise-free reference sentence after its fixed gain; sampled
    # speech peaks up to ~1.8x higher (measured on joe), so 0.5 keeps it under 1.
    # None keeps the model's raw level (gain 1).
    target_peak: float | None = 0.5
    # Items of a step share one onnxruntime call only while the padding adds at most
    # this fraction of real phoneme ids (None: one call per voice and scales, however
    # ragged). On CPU the work is linear in audio and a ragged call pays for its
    # padding (1.7-2.7x the CPU of one call per item at 8-16 items), so only items of equal
    # length share a call by default (docs/benchmarks.md, "Component costs").
    max_padding_waste: float | None = 0.0
    # On a CPU, items in one call run on one core while separate calls run side by
    # side on the pool: measured when this default was set, 8 sentences took 6.0 s as one
    # padded call plus singles and 2.9 s as 8 separate calls over 2 cores (the CPU cost of
    # padding: docs/benchmarks.md, "Component costs"). So by default every item gets its
    # own call; False packs by `max_padding_waste`.
    one_call_per_item: bool = True
    # Calls that run side by side, each on `num_threads` cores: the engine's lanes (one
    # request per step, a step started whenever a lane is free), or, with
    # `one_call_per_item` False, the calls of one step. A call that runs alone uses every
    # core. 0 (default): as many as the cores hold, cores // num_threads
    # (docs/benchmarks.md, "Saturation against the raw limit": a 152-frame window took
    # 100 ms alone on one thread, 103-115 ms each with two side by side, 74 ms alone on
    # both cores).
    num_parallel_calls: int = 0
    # Decoder windows in latent frames (hop_length samples each; 256 at 22050 Hz, 11.6 ms):
    # an urgent segment whose step runs alone has a small first window (first audio soon)
    # and a medium second, a later segment due soon beside other work one medium first
    # window, and the rest are `window_frames` (see `window_urgent_lead_s`).
    # `window_context_frames` each side make each window equal the whole decode (10 matches
    # joe's to 1e-6 over 150 corpus sentences, 8 to only 3e-3; each frame of context less is
    # one less decoded twice: docs/benchmarks.md, "Decoder windows").
    # A turn's first windows end just past the gateway's 20 ms Opus frame grid: its
    # encoder sends whole frames and holds the rest (and its resampler 16 samples) until
    # the next window comes, so a window ending short of a frame boundary leaves its
    # listener up to 20 ms less to wait in. At 22050 Hz (hop 256) a 12-frame first window
    # (139 ms) reached the listener as 120 ms, 14 (163 ms) as 160; 12 + 36 as 540 ms,
    # 14 + 38 as 600; a 48-frame medium window as 540 ms, 52 as 600 (tests/unit/
    # engine/piper/test_windows.py; docs/benchmarks.md, "Decoder windows").
    windowed: bool = True
    window_first_frames: int = 14
    window_second_frames: int = 38
    window_medium_first_frames: int = 52
    window_frames: int = 128
    window_context_frames: int = 10
    # The flow runs on slices with this much context each side (its receptive field: exact
    # on joe): a short one for an urgent segment's first window, then `window_flow_frames`
    # frames at a time as the windows need them, so a segment's first window never pays
    # for the flow of audio due seconds later (docs/benchmarks.md, "Decoder windows").
    window_flow_context_frames: int = 32
    window_flow_frames: int = 256
    # A segment's first flow slice, when the second slice recomputes its frames anyway, runs
    # on this much context and only the first window's audio reads it: at 20 that audio is
    # as close to the whole as at 32 (1.6e-5 over 150 corpus sentences); at 16 up to
    # 1.1e-3, by the noise drawn (docs/benchmarks.md, "Decoder windows").
    window_first_flow_context_frames: int = 20
    # The first window of an urgent segment whose context is the only one with work (one
    # talking session; `Pace.LONE`): 7 frames (81 ms; 8 reached the listener as the same
    # 80 ms of whole frames). At 4 (46 ms) first audio came ~2 ms sooner, but at 4-8
    # sessions a turn that began alone and met another's turn before its second window left
    # 1-3 short gaps a run; with other sessions talking the first window stays
    # `window_first_frames` (docs/benchmarks.md, "Decoder windows"; docs/history.md,
    # "Piper: windows and their sizes").
    window_lone_first_frames: int = 7
    # A segment is urgent while its next audio is due within `window_urgent_lead_s` and is
    # not later than `window_behind_s` already (a new turn's first segment, on a box that
    # keeps up): if its step runs alone it gets the small windows and the flow slice; beside
    # another lane's step one medium first window (`window_medium_first_frames`), then long
    # ones. (Long windows there once measured better, while later segments were due early
    # by the gateway's guess from their text; with their due times from the backend's
    # length a medium first window brought 12-session TTFA p95 to 183-236 ms from 299:
    # docs/benchmarks.md, "Decoder windows".) One with more lead, or
    # whose listener has waited longer (the box is behind), takes `window_frames` windows
    # and the flow in `window_flow_frames` pieces, which makes more audio per second of
    # work (less context computed twice). A step beside look-ahead work (due later than
    # `window_busy_lead_s`: the engine's `StepPlan.is_contended` is false) counts as alone:
    # that work can wait, and a turn's second segment due 114 ms after its
    # text came, cut long beside it, was 23 ms late. (0.3 s here instead of 0.1 made more
    # urgent segments short and, at 12 sessions, 11-26 gaps where 0.1 had 1-3.)
    window_urgent_lead_s: float = 0.1
    window_behind_s: float = 0.3
    window_busy_lead_s: float = 0.5
    # A later segment due within this (not yet) that gets no short pieces gets a medium
    # first window (`window_medium_first_frames`, the flow sliced): a long one (100-150 ms
    # on this box) might be late, and its listener, hearing the turn already, would hear
    # a gap (a turn's second segment due 151 ms after its text came was 29 ms late so).
    window_medium_lead_s: float = 0.3
    # A segment's later window begun with its listener this close to running dry is cut
    # to at most `window_second_frames`, the flow sliced for it: a long one with its flow
    # piece took 110-160 ms beside another lane's step and came late (a gap 600 ms into a
    # turn, where a medium first window ends), a short one is ready in about a third of
    # that (docs/benchmarks.md, "Decoder windows"). 0: windows keep their pace's sizes.
    window_catchup_lead_s: float = 0.15

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.num_parallel_calls < 0:
            raise ValueError(f"num_parallel_calls must be >= 0 (0: cores // num_threads), "
                             f"got {self.num_parallel_calls}")
        if self.num_parallel_calls == 0:
            self.num_parallel_calls = max(1, (os.cpu_count() or 1) // self.num_threads)
        if self.voices_dir is not None:
            self.voices_dir = Path(self.voices_dir)
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.target_peak is not None and not 0.0 < self.target_peak <= 1.0:
            raise ValueError(f"target_peak must be within (0, 1] or None, got {self.target_peak}")
        self.window_plan  # noqa: B018 - validates the window sizes
        for name in ("window_urgent_lead_s", "window_behind_s", "window_busy_lead_s",
                     "window_medium_lead_s", "window_catchup_lead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_padding_waste is not None and self.max_padding_waste < 0:
            raise ValueError(
                f"max_padding_waste must be >= 0 or None, got {self.max_padding_waste}"
            )

    @property
    def window_plan(self) -> WindowPlan:
        return WindowPlan(self.window_first_frames, self.window_second_frames,
                          self.window_medium_first_frames, self.window_frames,
                          self.window_context_frames, self.window_flow_context_frames,
                          self.window_flow_frames, self.window_lone_first_frames,
                          self.window_first_flow_context_frames)

    @property
    def pace_policy(self) -> PacePolicy:
        return PacePolicy(self.window_urgent_lead_s, self.window_behind_s,
                          self.window_medium_lead_s, self.window_catchup_lead_s)
