"""The piper window plan (plan.py): window sizes, and the pace the engine's plan gives a segment.

Pure policy: no model, no threads, the clock passed in. The paces are those
the backend chose when it counted lanes itself, situation by situation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.backend import StepPlan
from engine.backends.piper.config import PiperBackendConfig
from engine.backends.piper.plan import Pace

# urgent 0.1 s, behind 0.3 s, medium 0.3 s, catch-up 0.15 s
POLICY = PiperBackendConfig().pace_policy


@pytest.mark.parametrize(("lead", "is_contended", "is_lone", "pace"), [
    # due now, its step alone or beside look-ahead work: short pieces, smaller still for
    # the only talking session
    (0.0, False, True, Pace.LONE),
    (0.0, False, False, Pace.SHORT),
    (0.1, False, False, Pace.SHORT),  # the urgent lead's edge
    (-0.3, False, True, Pace.LONE),  # its listener waits, not yet long
    # due now beside another lane's work due soon: one medium first window, lone or not
    (0.0, True, True, Pace.MEDIUM),
    (0.0, True, False, Pace.MEDIUM),
    # due soon, not yet (its listener hears the turn): medium, whatever runs beside it
    (0.2, False, True, Pace.MEDIUM),
    (0.3, True, False, Pace.MEDIUM),
    # lead to spare, or a listener that waited longer than `behind_s`: long windows
    (0.31, False, True, Pace.LONG),
    (60.0, True, False, Pace.LONG),
    (-0.31, False, True, Pace.LONG),
    (-2.0, True, False, Pace.LONG),
])
def test_a_segments_pace_follows_its_lead_and_what_the_engine_says_runs_beside_it(
        lead: float, is_contended: bool, is_lone: bool, pace: Pace) -> None:
    now = 0.0  # leads exact in floats
    for is_alone in (True, False):  # whether its calls may take every core changes no size
        plan = StepPlan(now + lead, is_alone=is_alone, is_contended=is_contended, is_lone=is_lone)
        assert POLICY.pace(plan, now) is pace


@pytest.mark.parametrize(("lead", "is_catching_up"), [
    (0.0, True), (0.15, True), (-0.3, True), (0.16, False), (-0.31, False), (5.0, False)])
def test_a_later_window_is_cut_short_only_while_its_listener_is_about_to_run_dry(
        lead: float, is_catching_up: bool) -> None:
    assert POLICY.is_catching_up(StepPlan(lead, is_alone=False, is_contended=True),
                                 0.0) is is_catching_up
    never = dataclasses.replace(POLICY, catchup_lead_s=0.0)
    assert not never.is_catching_up(StepPlan(lead), 0.0)


def test_window_sizes_follow_the_pace() -> None:
    plan = PiperBackendConfig().window_plan
    assert [plan.size(i, Pace.LONE) for i in range(3)] == [plan.lone_first_frames,
                                                           plan.second_frames,
                                                            plan.frames]
    assert [plan.size(i, Pace.SHORT) for i in range(3)] == [plan.first_frames, plan.second_frames,
                                                            plan.frames]
    assert [plan.size(i, Pace.MEDIUM) for i in range(2)] == [plan.medium_first_frames, plan.frames]
    assert [plan.size(i, Pace.LONG) for i in range(2)] == [plan.frames, plan.frames]
    # a window due too soon is cut to a short one; a segment's end takes no sliver
    assert plan.window_end(0, 1, 1000, Pace.MEDIUM, is_catching_up=True) == plan.second_frames
    assert plan.window_end(0, 0, plan.frames + 3, Pace.LONG) == plan.frames + 3


def test_only_a_first_slice_the_second_recomputes_runs_on_the_short_context() -> None:
    plan = PiperBackendConfig().window_plan
    assert plan.first_flow_context_frames < plan.flow_context_frames
    assert plan.is_first_slice_provisional(plan.flow_context_frames)
    # A longer first slice (a medium first window) would be recomputed in part: work twice.
    assert not plan.is_first_slice_provisional(plan.flow_context_frames + 1)
    assert not dataclasses.replace(plan, first_flow_context_frames=32).is_first_slice_provisional(8)
    with pytest.raises(ValueError, match="first_flow_context_frames must be >= 0, got -1"):
        dataclasses.replace(plan, first_flow_context_frames=-1)


def _held_back_ms(frames: int) -> float:
    """Audio of a turn's first `frames` latent frames (joe: 22050 Hz, hop 256) that the
    gateway's real Opus encoder (48 kHz, 20 ms frames) holds back until more comes."""
    from gateway.audio.codecs import make_encoder

    encoder = make_encoder("opus", 48000, 20, None, 22050)
    pcm = (0.1 * np.sin(np.arange(frames * 256) * 0.05)).astype(np.float32)
    return frames * 256 / 22.05 - 20.0 * len(encoder.encode(pcm))


def test_a_turns_first_windows_end_just_past_the_encoders_frame_grid() -> None:
    # Each first window's end (short: first, first + second; medium: first; lone: first,
    # first + second) leaves at most 4 ms of its audio in the encoder, where a 12-frame
    # first window, or 12 + 36, or a 48-frame one, left 17-20 ms.
    plan = PiperBackendConfig().window_plan
    ends = [plan.first_frames, plan.first_frames + plan.second_frames, plan.medium_first_frames,
            plan.lone_first_frames, plan.lone_first_frames + plan.second_frames]
    assert max(_held_back_ms(end) for end in ends) <= 4.0
    assert min(_held_back_ms(end) for end in (12, 48)) >= 15.0
