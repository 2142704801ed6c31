"""Character and word timings for the vendor sockets, from the engine's word timings.

The engine times words within a segment (`AudioChunk.words`, ms from the
segment's start; piper's word spans tile the segment). ElevenLabs wants
characters: each word's span is spread evenly over its characters, the space
between two words takes the gap between them (zero when words tile), and a
segment after the first of a vendor context starts with the space that joins
it to the one before, so that the characters of a context, joined, equal its
spoken text. Cartesia wants words in seconds from the context's start.

A segment the engine gave no timings (or timings that do not match its words)
is timed as one word spanning its audio. The last character is stretched to
the segment's audio end, so successive alignments tile the audio exactly (a
client that adds each alignment's span to a running clock, as Pipecat does,
stays in step with the audio).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.types import WordTiming


@dataclass(slots=True, frozen=True)
class Tracked:
    """One spoken segment of a vendor context, its timings final (the session's
    `SegmentFramed` note): `base_ms` is where its audio starts in the vendor context."""

    text: str
    words: Sequence[WordTiming] | None
    audio_ms: float
    base_ms: float
    is_first: bool  # the first segment of its vendor context (no joining space)


@dataclass(slots=True)
class CharTimings:
    chars: list[str]
    start_ms: list[float]
    duration_ms: list[float]


def _word_spans(tracked: Tracked) -> list[tuple[str, float, float]]:
    tokens = tracked.text.split()
    total = tracked.audio_ms
    words = tracked.words
    if words and len(words) == len(tokens):
        return [(t, min(w.start_ms, total), min(max(w.end_ms, w.start_ms), total))
                for t, w in zip(tokens, words, strict=True)]
    return [(" ".join(tokens), 0.0, total)] if tokens else []


def segment_chars(tracked: Tracked) -> CharTimings:
    """The segment's characters, times relative to the segment's start (see module doc)."""
    spans = _word_spans(tracked)
    out = CharTimings([], [], [])
    if not tracked.is_first and spans:
        out.chars.append(" ")
        out.start_ms.append(0.0)
        out.duration_ms.append(0.0)
    previous_end = 0.0
    for index, (word, start, end) in enumerate(spans):
        if index:
            out.chars.append(" ")
            out.start_ms.append(previous_end)
            out.duration_ms.append(max(0.0, start - previous_end))
        step = (end - start) / len(word)
        for position, char in enumerate(word):
            out.chars.append(char)
            out.start_ms.append(start + position * step)
            out.duration_ms.append(step)
        previous_end = end
    if out.chars:  # tile the segment's audio: the last character ends where its audio does
        out.duration_ms[-1] = max(out.duration_ms[-1], tracked.audio_ms - out.start_ms[-1])
    return out


def segment_words(tracked: Tracked) -> tuple[list[str], list[float], list[float]]:
    """(words, start s, end s) from the vendor context's start (Cartesia's timestamps)."""
    spans = _word_spans(tracked)
    base = tracked.base_ms
    return ([w for w, _, _ in spans], [round((base + s) / 1000.0, 4) for _, s, _ in spans],
            [round((base + e) / 1000.0, 4) for _, _, e in spans])
