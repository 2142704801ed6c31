"""Incremental sentence segmenter (first version; the interface is stable).

Fed text deltas of any size, it releases whole segments only once the text
after a boundary confirms it, so the segments do not depend on how the text
was split into deltas. Time is passed in; the segmenter has no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOUNDARY = re.compile(r"[.!?]+[\"')\]]*\s+(?=[A-Z0-9\"'(\[])|[。！？；]|\n\s*\n")


@dataclass(slots=True)
class SegmenterConfig:
    """`max_buffer_delay_ms` of 0 means only punctuation and flush release text."""

    max_segment_chars: int = 300
    first_segment_min_words: int = 4
    max_buffer_delay_ms: int = 0

    def __post_init__(self) -> None:
        if self.max_segment_chars < 20:
            raise ValueError(f"max_segment_chars must be >= 20, got {self.max_segment_chars}")
        if self.max_buffer_delay_ms < 0:
            raise ValueError(f"max_buffer_delay_ms must be >= 0, got {self.max_buffer_delay_ms}")


class Segmenter:
    """Cuts one context's text stream into speakable segments."""

    def __init__(self, config: SegmenterConfig | None = None) -> None:
        self.config = config or SegmenterConfig()
        self._buffer = ""
        self._last_input_at: float | None = None
        self.num_emitted = 0

    @property
    def pending_text(self) -> str:
        return self._buffer

    def push(self, delta: str, now: float) -> list[str]:
        """Append a delta; return the segments it completes."""
        self._buffer += delta
        self._last_input_at = now
        return self._release(final=False)

    def flush(self, now: float) -> list[str]:
        """No more text comes: release everything buffered."""
        return self._release(final=True)

    def poll(self, now: float) -> list[str]:
        """Release buffered text that waited `max_buffer_delay_ms` for more."""
        deadline = self.next_deadline()
        if deadline is None or now < deadline:
            return []
        return self._release(final=True)

    def next_deadline(self) -> float | None:
        delay = self.config.max_buffer_delay_ms
        if delay <= 0 or self._last_input_at is None or not self._buffer.strip():
            return None
        return self._last_input_at + delay / 1000.0

    def clear(self) -> None:
        self._buffer = ""
        self._last_input_at = None

    def _release(self, final: bool) -> list[str]:
        segments: list[str] = []
        while True:
            match = _BOUNDARY.search(self._buffer)
            cut = match.end() if match else None
            if cut is None and len(self._buffer) > self.config.max_segment_chars:
                space = self._buffer.rfind(" ", 0, self.config.max_segment_chars)
                cut = space + 1 if space > 0 else self.config.max_segment_chars
            if cut is None:
                break
            segments.append(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
        if final and self._buffer:
            segments.append(self._buffer)
            self._buffer = ""
        spoken = [" ".join(s.split()) for s in segments]
        spoken = [s for s in spoken if s]
        self.num_emitted += len(spoken)
        return spoken
