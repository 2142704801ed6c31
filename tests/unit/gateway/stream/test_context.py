"""One spoken turn's bookkeeping: what was heard, how long its audio lasts, when it is drained."""

from __future__ import annotations

import numpy as np

from engine.types import RequestId, WordTiming
from gateway.audio.codecs import make_encoder
from gateway.stream.context import Context, ContextState, Segment
from gateway.stream.options import SessionOptions
from gateway.stream.playout import Playout
from gateway.text.segmenter import Segmenter

RATE = 16000


def make_context(speed: float = 1.0) -> Context:
    options = SessionOptions(codec="pcm16", sample_rate=16000, speed=speed)
    playout = Playout("c", make_encoder("pcm16", 16000, 20, None, RATE), is_realtime=False)
    return Context("c", "s/c", Segmenter(), playout, options, created_at=0.0)


def add_segment(context: Context, text: str, *, audio_ms: float | None = None,
                words: list[WordTiming] | None = None) -> Segment:
    """A segment; with `audio_ms` it was synthesized and sent, starting where the last ended."""
    index = len(context.segments)
    segment = Segment(index, text, RequestId(f"r{index}"), released_at=0.0, is_submitted=True)
    if audio_ms is not None:
        segment.pts_ms = sum(s.audio_ms for s in context.segments)
        segment.audio_ms = audio_ms
        segment.is_synthesized = segment.is_started = segment.is_sent = True
        segment.words = words
    context.segments.append(segment)
    return segment


def heard(context: Context, ms: float) -> tuple[str, str]:
    context.playout.audio_ms_sent = sum(s.audio_ms for s in context.segments)
    return context.split_heard(ms)


def test_without_word_timings_a_segment_counts_as_heard_once_it_began_playing() -> None:
    context = make_context()
    add_segment(context, "First sentence.", audio_ms=1000)
    add_segment(context, "Second sentence.", audio_ms=1000)
    add_segment(context, "Not spoken yet.")
    assert heard(context, 1500) == ("First sentence. Second sentence.", "Not spoken yet.")
    assert heard(context, 1000) == ("First sentence.", "Second sentence. Not spoken yet.")


def test_word_timings_split_a_segment_at_the_last_word_heard_whole() -> None:
    context = make_context()
    words = [WordTiming("Alpha", 0, 100), WordTiming("beta", 100, 200),
             WordTiming("gamma.", 200, 300)]
    add_segment(context, "Alpha beta gamma.", audio_ms=300, words=words)
    assert heard(context, 150) == ("Alpha", "beta gamma.")
    assert heard(context, 300) == ("Alpha beta gamma.", "")


def test_text_still_in_the_segmenter_is_unspoken() -> None:
    context = make_context()
    add_segment(context, "Spoken.", audio_ms=500)
    context.segmenter.push("and   the rest", 0.0)
    assert heard(context, 500) == ("Spoken.", "and the rest")


def test_what_was_heard_is_the_report_else_the_last_playback_and_never_past_what_was_sent() -> None:
    context = make_context()
    context.playout.audio_ms_sent = 800.0
    assert context.heard_ms(None) == 800.0
    context.played_ms = 300.0
    assert context.heard_ms(None) == 300.0
    assert context.heard_ms(500.0) == 500.0
    assert context.heard_ms(5000.0) == 800.0


def test_a_context_is_drained_only_when_flushed_spoken_finished_and_sent() -> None:
    context = make_context()
    add_segment(context, "Only one.", audio_ms=200)
    assert not context.is_spoken()  # still open: more text may come
    context.state = ContextState.FLUSHED
    assert context.is_spoken() and not context.is_drained()  # the encoder tail is not out
    context.playout.push(np.zeros(RATE // 10, np.float32))
    context.playout.finish()
    assert not context.is_drained()  # messages wait for release
    context.playout.release(0.0, 0.0)
    assert context.is_drained()


def test_pending_requests_are_the_submitted_segments_not_yet_synthesized() -> None:
    context = make_context()
    add_segment(context, "Done.", audio_ms=100)
    pending = add_segment(context, "With the engine.")
    add_segment(context, "Waiting for the window.").is_submitted = False
    assert context.pending_requests() == [pending.request_id]
    assert context.segment_for(pending.request_id) is pending
    assert context.segment_for(RequestId("nope")) is None
    assert not context.is_closed
    context.state = ContextState.CANCELLED
    assert context.is_closed
