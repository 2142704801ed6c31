"""Text-late gaps: a gap whose segment's text came too late for any server is told apart.

A turn is driven by hand with a fake clock: deltas noted as sent, `segment` and `audio`
events fed to `TurnState` as the client's reader would.
"""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from loadtest.client import SpeechRate, TurnPlan, TurnState, VoxgateSession
from loadtest.config import LoadConfig
from loadtest.corpus import Answer
from loadtest.metrics import Outcome, RunStats, TurnRecord, is_text_late, passes, summarize
from loadtest.report import format_table
from loadtest.runner import LevelResult
from voxgate_client import Audio, Segment, Turn


class _Turn:
    """Feeds `TurnState` as a server would: `seq` counts frames, `pts_ms` the audio so far."""

    def __init__(self) -> None:
        self.record = TurnRecord(0, "c", num_tokens=10, num_chars=40)
        self.state = TurnState(self.record, playout_delay_ms=0.0)
        self.seq = 0
        self.pts_ms = 0.0

    def send(self, text: str, at: float) -> None:
        self.state.text.sent(text, at)

    def segment(self, text: str, at: float, pts_ms: float | None = None) -> None:
        """A segment starting at `pts_ms`: by default where the audio sent so far ends."""
        pts = self.pts_ms if pts_ms is None else pts_ms
        self.state.on_segment(Segment("c", 0, text, pts, None, None, at))

    def audio(self, duration_ms: float, at: float) -> None:
        self.state.on_audio(Audio("c", self.seq, self.pts_ms, duration_ms, "pcm16", None,
                                  b"", at))
        self.seq += 1
        self.pts_ms += duration_ms


def _sure_then(complete_at: float) -> _Turn:
    """"Sure!" (360 ms of audio, heard 1.2-1.56), then a sentence whose last letters were
    sent at `complete_at` and whose audio comes at 1.9: a gap of 340 ms after "Sure!"."""
    turn = _Turn()
    turn.send("Sure", 1.0)
    turn.send("!", 1.025)
    turn.segment("Sure!", 1.15)
    turn.audio(360.0, 1.2)
    turn.send(" Here is the", complete_at - 0.05)
    turn.send(" recipe", complete_at)
    turn.send(".", complete_at + 0.025)
    turn.segment("Here is the recipe.", 1.85)
    turn.audio(500.0, 1.9)
    turn.state.finalize()
    return turn


def test_a_gap_after_a_segment_whose_text_came_after_the_run_out_is_text_late() -> None:
    record = _sure_then(complete_at=1.7).record
    assert record.gaps_ms == [pytest.approx(340.0)]
    assert record.gaps_at_ms == [360.0]
    assert record.gaps_text_lead_ms == [pytest.approx(-140.0)]  # 1.56 - 1.7
    assert is_text_late(record.gaps_text_lead_ms[0], ttfa_target_ms=300.0)


def test_a_gap_after_a_segment_complete_a_second_before_the_run_out_is_the_servers() -> None:
    record = _sure_then(complete_at=0.56).record
    assert record.gaps_text_lead_ms == [pytest.approx(1000.0)]
    assert not is_text_late(record.gaps_text_lead_ms[0], ttfa_target_ms=300.0)


def test_a_segment_starting_inside_the_late_frame_is_the_one_the_gap_waited_for() -> None:
    # "Sure!" is 372.5 ms of PCM: 18 whole 20 ms frames go out, the last 12.5 ms wait in the
    # encoder for the next segment's PCM, so the late message starts 12.5 ms before it
    turn = _Turn()
    turn.send("Sure!", 1.0)
    turn.segment("Sure!", 1.15)
    turn.audio(360.0, 1.2)  # heard 1.2-1.56
    turn.send(" Here is the recipe.", 1.7)
    turn.segment("Here is the recipe.", 1.85, pts_ms=372.5)
    turn.audio(100.0, 1.9)  # five frames: the tail of "Sure!", then "Here is..."
    assert turn.record.gaps_text_lead_ms == [pytest.approx(-140.0)]


def test_a_segment_starting_after_the_late_frame_does_not_place_the_gap() -> None:
    turn = _Turn()
    turn.send("Sure! Here is the recipe.", 1.0)
    turn.segment("Sure!", 1.15)
    turn.segment("Here is the recipe.", 1.16, pts_ms=500.0)
    turn.audio(360.0, 1.2)
    turn.audio(100.0, 1.9)  # 360-460 ms of the turn's audio: still "Sure!"
    assert turn.record.gaps_text_lead_ms == [None]


def test_a_gap_inside_a_segment_has_no_text_lead_and_is_the_servers() -> None:
    turn = _Turn()
    turn.send("Here is the recipe.", 1.0)
    turn.segment("Here is the recipe.", 1.15)
    turn.audio(200.0, 1.2)  # heard 1.2-1.4
    turn.audio(200.0, 1.6)  # the rest of the same segment, 200 ms late
    turn.state.finalize()
    assert turn.record.gaps_ms == [pytest.approx(200.0)]
    assert turn.record.gaps_text_lead_ms == [None]
    assert not is_text_late(None, ttfa_target_ms=300.0)


def test_a_segment_with_more_letters_than_the_input_sent_has_no_text_lead() -> None:
    turn = _Turn()
    turn.send("Sure!", 1.0)
    turn.segment("Sure!", 1.15)
    turn.audio(360.0, 1.2)
    turn.send(" See", 1.3)
    turn.segment("See the code block.", 1.85)  # words the input never sent
    turn.audio(500.0, 1.9)
    assert turn.record.gaps_text_lead_ms == [None]


def test_text_leads_stay_beside_the_gaps_through_a_playout_delay_and_a_barge_in() -> None:
    turn = _Turn()
    turn.state = TurnState(turn.record, playout_delay_ms=100.0)
    turn.send("One. Two.", 1.0)
    turn.segment("One.", 1.1)
    turn.audio(200.0, 1.2)  # plays 1.3-1.5: the delay is no gap
    turn.audio(100.0, 1.35)
    turn.segment("Two.", 1.9)
    turn.audio(200.0, 2.0)  # a gap of 400 ms before "Two."
    turn.audio(200.0, 2.1)
    turn.state.cancel_sent_at = 2.2
    turn.audio(200.0, 3.0)  # after the barge-in: the listener hears nothing more
    record = turn.state.finalize()
    assert record.gaps_ms == [pytest.approx(400.0)]
    assert record.gaps_text_lead_ms == [pytest.approx(600.0)]  # text at 1.0, run-out 1.6
    assert len(record.to_dict()["gaps_text_lead_ms"]) == record.num_gaps


def test_the_session_notes_the_inputs_alphanumerics_after_each_delta() -> None:
    class FakeTurn:
        async def push(self, text: str) -> None:
            pass

        async def flush(self) -> None:
            pass

    tokens = ["Sure", "!", " **Here**", " is", " 42", "."]
    plan = TurnPlan(Answer("a", "en", "".join(tokens)), tokens, [0.0] * len(tokens), 2, None)
    session = VoxgateSession(0, LoadConfig(url="http://127.0.0.1:9"), [], [], SpeechRate(), [1])
    state = TurnState(TurnRecord(0, "c", len(tokens), len(plan.answer.text)), 0.0)
    asyncio.run(session._stream_text(state, plan, cast(Turn, FakeTurn())))
    assert state.text.sent_alnum == [4, 4, 8, 10, 12, 12]
    assert len(state.text.sent_at) == len(tokens)
    assert state.text.sent_at == sorted(state.text.sent_at)


def _gapped(leads: list[float | None]) -> TurnRecord:
    r = TurnRecord(0, "c", 10, 40, outcome=Outcome.COMPLETED, ttfa_segment_ms=100.0,
                   audio_ms=1000.0, num_frames=50)
    r.gaps_ms = [50.0] * len(leads)
    r.num_gaps, r.gap_ms = len(leads), 50.0 * len(leads)
    r.gaps_text_lead_ms = list(leads)
    return r


def test_text_late_and_server_gaps_add_up_to_the_count() -> None:
    turns = [_gapped([-140.0, 250.0]), _gapped([1000.0, None]), _gapped([])]
    gaps = summarize(turns, RunStats(10.0, 0.5, 3))["gaps"]
    assert (gaps["count"], gaps["text_late"], gaps["server"]) == (4, 2, 2)
    assert gaps["text_late"] + gaps["server"] == gaps["count"]
    stricter = summarize(turns, RunStats(10.0, 0.5, 3), ttfa_target_ms=200.0)["gaps"]
    assert (stricter["text_late"], stricter["server"]) == (1, 3)  # 250 ms was lead enough


def test_the_servers_gaps_split_into_late_segment_starts_and_gaps_inside_a_segment() -> None:
    turns = [_gapped([-140.0, 250.0]), _gapped([1000.0, None]), _gapped([None])]
    gaps = summarize(turns, RunStats(10.0, 0.5, 3))["gaps"]
    # 1000 ms of lead and still late: a segment's first audio missed the target
    assert (gaps["server"], gaps["server_at_segment_start"], gaps["server_inside_segment"]) \
        == (3, 1, 2)
    stricter = summarize(turns, RunStats(10.0, 0.5, 3), ttfa_target_ms=200.0)["gaps"]
    assert (stricter["server_at_segment_start"], stricter["server_inside_segment"]) == (2, 2)
    summary = summarize(turns, RunStats(10.0, 0.5, 3))
    report = format_table(LevelResult("voxgate", 3, turns, summary))
    assert "3 server (1 at a segment's start, 2 inside one)" in report


def test_a_level_holds_with_text_late_gaps_but_not_with_a_server_gap() -> None:
    text_late = summarize([_gapped([-140.0]), _gapped([250.0])], RunStats(10.0, 0.5, 2))
    assert text_late["gaps"]["count"] == 2
    assert passes(text_late, ttfa_p95_target_ms=1000.0)
    for lead in (1000.0, None):
        server = summarize([_gapped([-140.0]), _gapped([lead])], RunStats(10.0, 0.5, 2))
        assert server["gaps"]["server"] == 1
        assert not passes(server, ttfa_p95_target_ms=1000.0)
