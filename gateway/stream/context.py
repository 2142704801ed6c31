"""One spoken turn: its text, its segments, its audio accounting.

A context owns a segmenter, the segments it released (each one engine
request), the audio chunks received and not yet framed, and its `Playout`
(encoder, outbox, the audio counters that `cancelled` and `context.done`
report). It knows no socket and no clock.

A segment speaks with one voice (the context's, or the one mapped for its
language) and may hold text no voice can say, skipped (docs/voices.md,
"Languages"): its `pieces`, spoken and skipped, rejoin to the segmenter's
text; a segment with nothing spoken is skipped whole and goes to no engine.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.types import AudioChunk, RequestId, WordTiming
from gateway.stream.events import Cancelled
from gateway.stream.options import SessionOptions
from gateway.stream.playout import Playout
from gateway.text.language import Piece
from gateway.text.segmenter import Segmenter


class ContextState(enum.Enum):
    OPEN = "open"            # taking text
    FLUSHED = "flushed"      # no more text; speaking what is left
    DONE = "done"            # all audio sent
    CANCELLED = "cancelled"  # barge-in
    FAILED = "failed"        # engine error


@dataclass(slots=True)
class Segment:
    segment_id: int
    text: str
    request_id: RequestId
    released_at: float            # when the segmenter released it: complete in the input
    is_submitted: bool = False    # handed to the engine (within the look-ahead window)
    chunks: deque[AudioChunk] = field(default_factory=deque)
    is_synthesized: bool = False
    is_started: bool = False
    is_sent: bool = False
    pts_ms: float = 0.0
    audio_ms: float = 0.0
    words: list[WordTiming] | None = None
    voice: str = ""               # who says it (a mapped voice where the language asked)
    pieces: tuple[Piece, ...] = ()  # the segmenter's text, spoken and skipped, in order
    is_skipped: bool = False      # nothing in it was spoken: no request, no `segment` event

    @property
    def skipped(self) -> list[Piece]:
        return [p for p in self.pieces if p.is_skipped]


@dataclass(slots=True)
class Context:
    context_id: str
    key: str
    segmenter: Segmenter
    playout: Playout
    options: SessionOptions
    created_at: float
    state: ContextState = ContextState.OPEN
    segments: list[Segment] = field(default_factory=list)
    num_text_chars: int = 0
    played_ms: float | None = None  # last `playback` report
    last_text_at: float = 0.0       # when text last came: an idle open context is flushed
    is_admitted: bool = False       # holds engine capacity (taken at its first segment)
    voice_for: dict[str, str] = field(default_factory=dict)  # language -> voice, this turn's
    has_started: bool = False       # its first audio went to the playout (TTFA is observed then)

    @property
    def voices(self) -> list[str]:
        """The voices it may speak with, held in the catalog while it lives."""
        return [self.options.voice, *self.voice_for.values()]

    @property
    def num_spoken(self) -> int:
        """Segments with audio (`context.done` counts these; skipped ones have none)."""
        return sum(1 for s in self.segments if not s.is_skipped)

    @property
    def is_closed(self) -> bool:
        return self.state in (ContextState.DONE, ContextState.CANCELLED, ContextState.FAILED)

    def segment_for(self, request_id: RequestId) -> Segment | None:
        for segment in self.segments:
            if segment.request_id == request_id:
                return segment
        return None

    def pending_requests(self) -> list[RequestId]:
        return [s.request_id for s in self.segments if s.is_submitted and not s.is_synthesized]

    @property
    def audio_ms_sent(self) -> float:
        """Whole frames sent: the audio the client has."""
        return self.playout.audio_ms_sent

    def is_spoken(self) -> bool:
        """No more text can come and every segment's audio went to the playout."""
        return (self.state is ContextState.FLUSHED and not self.segmenter.pending_text.strip()
                and all(s.is_sent for s in self.segments))

    def is_drained(self) -> bool:
        """Every segment synthesized and framed, and every message released."""
        return self.is_spoken() and self.playout.is_finished and self.playout.is_empty

    def heard_ms(self, played_ms: float | None) -> float:
        """What the listener heard: `played_ms` when given, else its last `playback`
        report, and never more than the audio sent."""
        heard = self.played_ms if played_ms is None else played_ms
        return self.audio_ms_sent if heard is None else min(heard, self.audio_ms_sent)

    def cancelled(self, played_ms: float | None) -> Cancelled:
        """The answer to a cancel here: the text split at `played_ms`, else at the last
        `playback` report, and where it was cut."""
        spoken, unspoken = self.split_heard(self.heard_ms(played_ms))
        heard_at = played_ms if played_ms is not None else self.played_ms
        return Cancelled(self.context_id, self.audio_ms_sent, heard_at, spoken, unspoken)

    def split_heard(self, heard_ms: float) -> tuple[str, str]:
        """(spoken_text, unspoken_text) for a cut at `heard_ms` of this context's audio.

        Whole words where the engine gave timings, whole segments otherwise: a
        segment counts as heard once its audio began playing (docs/protocol.md,
        "Barge-in"). Skipped text was never spoken: it is unspoken wherever it falls.
        """
        spoken: list[str] = []
        unspoken: list[str] = []
        for segment in self.segments:
            if segment.is_skipped or not segment.is_started or segment.pts_ms >= heard_ms:
                unspoken.append(_joined(p.text for p in segment.pieces) if segment.skipped
                                else segment.text)
                continue
            end_ms = segment.pts_ms + segment.audio_ms
            num_heard = None  # every word
            if not (segment.is_sent and heard_ms >= end_ms):
                num_heard = _num_words_heard(segment, heard_ms - segment.pts_ms)
            for piece, is_heard in _pieces_heard(segment, num_heard):
                (spoken if is_heard else unspoken).append(piece)
        pending = self.segmenter.pending_text.strip()
        if pending:
            unspoken.append(" ".join(pending.split()))
        return " ".join(spoken), " ".join(unspoken)


def _num_words_heard(segment: Segment, offset_ms: float) -> int | None:
    """Words of `segment.text` heard by `offset_ms` into it; None (all) without timings for
    each word: the segment counts as heard once its audio began."""
    words = segment.words
    if not words or len(words) != len(segment.text.split()):
        return None
    return sum(1 for w in words if w.end_ms <= offset_ms + 1e-6)


def _pieces_heard(segment: Segment, num_heard: int | None) -> list[tuple[str, bool]]:
    """The segment's text as (text, heard) runs, in order: its first `num_heard` spoken
    words heard (all when None), its skipped pieces never."""
    if not segment.skipped:  # nothing cut out: its text as the segmenter gave it
        if num_heard is None:
            return [(segment.text, True)]
        tokens = segment.text.split()
        halves = [(" ".join(tokens[:num_heard]), True), (" ".join(tokens[num_heard:]), False)]
        return [(text, heard) for text, heard in halves if text]
    runs: list[tuple[str, bool]] = []
    left = num_heard
    for piece in segment.pieces:
        if piece.is_skipped:
            runs.append((_joined([piece.text]), False))
            continue
        tokens = piece.text.split()
        cut = len(tokens) if left is None else min(left, len(tokens))
        if left is not None:
            left -= cut
        runs += [(" ".join(tokens[:cut]), True), (" ".join(tokens[cut:]), False)]
    return [(text, heard) for text, heard in runs if text]


def _joined(texts: Iterable[str]) -> str:
    return " ".join(" ".join(text.split()) for text in texts if text.strip())
