"""Playback clocks (engine.clock) with a fake time: lead, a listener that ran dry, EDF across them,
and the engine's own due times from the order alone (a context's record, the one it plays after)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import clock
from engine.backend import BackendRequest
from engine.clock import PlaybackRecord, RequestHandle
from engine.scheduler import Scheduler, SchedulerConfig
from engine.types import AudioChunk, RequestId, SynthesisRequest, estimate_audio_s

RATE = 1000  # samples per second: a chunk of n samples is n ms


def handle(name: str, submitted: float, prev: RequestHandle | None = None,
           text: str = "text") -> RequestHandle:
    """A request submitted at `submitted`; `prev`: the one before it in its context."""
    return RequestHandle(SynthesisRequest(RequestId(name), text, "v"), submitted, prev=prev)


def make_and_take(h: RequestHandle, seconds: float, now: float) -> None:
    """The engine made `seconds` of audio and its consumer took it at `now`."""
    chunk = AudioChunk(h.request.request_id, np.zeros(round(seconds * RATE), np.float32), RATE,
                       False)
    h.made_s += seconds
    h.took(chunk, now)


def test_a_playing_listener_leads_by_the_audio_it_has_not_heard() -> None:
    h = handle("a", submitted=0.0)
    make_and_take(h, 2.0, now=0.0)
    assert h.lead(0.5) == pytest.approx(1.5)


def test_a_listener_that_ran_dry_has_a_negative_lead_of_how_long_it_waited() -> None:
    h = handle("a", submitted=0.0)
    make_and_take(h, 1.0, now=0.0)
    assert h.lead(1.0) == pytest.approx(0.0)
    assert h.lead(1.75) == pytest.approx(-0.75)


def test_a_first_piece_with_nothing_before_it_is_due_at_its_submission() -> None:
    h = handle("new", submitted=5.0)
    assert h.lead(4.0) == pytest.approx(1.0)
    assert h.lead(5.5) == pytest.approx(-0.5)  # late: due half a second ago


def test_after_a_gap_the_listener_resumes_where_it_stopped() -> None:
    h = handle("a", submitted=0.0)
    make_and_take(h, 1.0, now=0.0)
    make_and_take(h, 1.0, now=1.5)  # dry from 1.0 to 1.5: playback resumes at 1.5
    assert h.start() == pytest.approx(0.5)
    assert h.lead(1.5) == pytest.approx(1.0)
    assert h.lead(2.0) == pytest.approx(0.5)


def test_a_reader_that_stops_reading_stops_its_clock() -> None:
    h = handle("a", submitted=0.0)
    make_and_take(h, 1.0, now=0.0)
    h.made_s += 2.0  # made, never taken: the consumer stopped reading
    assert h.lead(10.0) == pytest.approx(2.0)  # not negative: nobody is waiting on the engine


def test_the_next_segment_starts_when_the_one_before_it_runs_out() -> None:
    first = handle("s0", submitted=0.0)
    make_and_take(first, 1.0, now=0.0)
    first.is_finished = first.is_done = True
    second = handle("s1", submitted=0.1, prev=first)
    assert second.lead(0.25) == pytest.approx(0.75)
    assert second.lead(1.5) == pytest.approx(-0.5)


def test_the_longest_waiting_listener_is_served_first_and_a_new_turn_before_none_waiting() -> None:
    now = 10.0
    dry = handle("dry", submitted=0.0)
    make_and_take(dry, 9.5, now=0.0)  # ran out at 9.5
    playing = handle("playing", submitted=0.0)
    make_and_take(playing, 11.0, now=0.0)  # 1 s of audio still to hear
    fresh = handle("fresh", submitted=9.9)  # a new turn's first segment, submitted at 9.9
    handles = {h.request.request_id: h for h in (playing, fresh, dry)}
    scheduler = Scheduler(SchedulerConfig(max_batch_size=1))
    for h in (playing, fresh, dry):  # arrival order: the dry stream is not the oldest
        scheduler.add(BackendRequest(h.request))
    clock.set_dues(scheduler.items(), handles, now)
    order = []
    for _ in range(3):
        (picked,) = scheduler.schedule(now)
        order.append(str(picked.request_id))
        scheduler.remove(picked.request_id)
    assert order == ["dry", "fresh", "playing"]


def test_a_later_segment_is_due_when_the_backends_length_of_the_one_before_runs_out() -> None:
    # A guess from the first segment's text would say 0.5 s (text in a script the voice
    # spells out); the backend knows it is 10 s long.
    first = handle("s0", submitted=0.0)
    first.est_s = 10.0
    make_and_take(first, 1.5, now=0.0)
    second = handle("s1", submitted=0.5, prev=first)
    assert second.start() == pytest.approx(10.0)
    assert second.lead(1.0) == pytest.approx(9.0)  # not due half a second ago


def test_a_later_segment_is_due_early_when_the_one_before_is_shorter_than_guessed() -> None:
    first = handle("s0", submitted=0.0)
    first.est_s = 1.0
    make_and_take(first, 1.0, now=0.0)
    second = handle("s1", submitted=0.2, prev=first)
    assert second.lead(0.25) == pytest.approx(0.75)


def test_a_segment_before_it_not_yet_prepared_counts_as_its_text_guessed() -> None:
    text = "A sentence of some length, still being phonemized."
    first = handle("s0", submitted=2.0, text=text)
    second = handle("s1", submitted=2.1, prev=first)
    assert second.start() == pytest.approx(2.0 + estimate_audio_s(text))
    first.is_cancelled = first.is_done = True  # cancelled: only what it made plays
    assert second.start() == pytest.approx(2.0)


def test_a_listener_about_to_run_dry_goes_before_a_later_segment_that_plays_in_seconds() -> None:
    now = 2.0
    dry_soon = handle("dry soon", submitted=0.0)
    make_and_take(dry_soon, 2.1, now=0.0)  # 0.1 s of audio left to hear
    long_first = handle("long s0", submitted=0.0)
    long_first.est_s = 12.0
    make_and_take(long_first, 3.0, now=0.0)
    later = handle("long s1", submitted=0.2, prev=long_first)
    handles = {h.request.request_id: h for h in (dry_soon, long_first, later)}
    scheduler = Scheduler(SchedulerConfig(max_batch_size=1))
    for h in (later, dry_soon):  # the later segment came first
        scheduler.add(BackendRequest(h.request))
    clock.set_dues(scheduler.items(), handles, now)
    (picked,) = scheduler.schedule(now)
    assert str(picked.request_id) == "dry soon"
    (later_item,) = (i for i in scheduler.items() if i.request_id == later.request.request_id)
    assert clock.is_ahead(later_item, now, horizon=2.0)  # ten seconds ahead: idle-time work
    assert not clock.is_ahead(picked, now, horizon=0.5)  # 0.1 s left: due now


def test_a_context_plays_after_the_one_before_it_never_before_its_own_submission() -> None:
    before = PlaybackRecord()
    talking = before.next_handle(SynthesisRequest(RequestId("a0"), "text", "v"), 0.0)
    talking.est_s = 4.0
    record = PlaybackRecord(after=before)
    first = record.next_handle(SynthesisRequest(RequestId("b0"), "text", "v"), 1.0)
    assert first.start() == pytest.approx(4.0)  # when the context before it runs out
    assert first.lead(1.0) == pytest.approx(3.0)  # look-ahead work, not "now"
    second = record.next_handle(SynthesisRequest(RequestId("b1"), "text", "v"), 1.5)
    first.est_s = 2.0
    assert second.start() == pytest.approx(6.0)  # its context's next: after its first
    late = PlaybackRecord(after=before).next_handle(
        SynthesisRequest(RequestId("c0"), "text", "v"), 9.0)
    assert late.start() == pytest.approx(9.0)  # the one before ended long ago: first audio now


@pytest.mark.parametrize(("text", "per_char_s"), [
    ("没问题关于存钱", 0.18),  # Mandarin: 4-5 syllables a second, one character each
    ("안녕하세요", 0.18),  # a Hangul block is a syllable
    ("こんにちは", 0.12),  # a kana is about one mora
    ("Hello there", 0.065),  # anything else: about 15 characters a second
])
def test_a_guess_counts_each_character_by_its_script(text: str, per_char_s: float) -> None:
    assert estimate_audio_s(text) == pytest.approx(len(text) * per_char_s)
    assert estimate_audio_s(text, speed=2.0) == pytest.approx(len(text) * per_char_s / 2)


def test_a_chinese_segment_is_not_guessed_three_times_shorter_than_its_english() -> None:
    # "No problem, about saving money," said in both: about two seconds of speech each
    chinese = estimate_audio_s("没问题，关于存钱，")
    english = estimate_audio_s("No problem, about saving money,")
    assert chinese == pytest.approx(7 * 0.18 + 2 * 0.065)
    assert 0.6 < chinese / english < 1.6
