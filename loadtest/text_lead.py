"""When each segment's text was complete in the input, to tell a text-late gap from the server's.

A gap that ends with a segment's first audio gets the segment's text lead: how
long before the listener ran out the segment's text was complete in the input
(docs/loadtest.md, "Text-late gaps"). Text is placed by its alphanumeric
characters: the server's cleanup changes whitespace, punctuation and markup,
rarely letters or digits. When it drops some (a link's URL, text no voice
speaks), the input seems to reach a segment's end early, which blames the
server for the gap, not the text.
"""

from __future__ import annotations

import bisect


class TextLead:
    """One turn's input progress and its segments' ends, in alphanumeric characters."""

    __slots__ = ("num_segment_alnum", "segment_ends", "sent_alnum", "sent_at")

    def __init__(self) -> None:
        # After each delta: the alphanumeric characters of the input sent so far, and when.
        self.sent_alnum: list[int] = []
        self.sent_at: list[float] = []
        self.num_segment_alnum = 0
        # Per segment: where its audio starts (ms) and the input's alphanumerics through it.
        self.segment_ends: list[tuple[float, int]] = []

    def sent(self, delta: str, now: float) -> None:
        """The input reached the end of `delta` at `now`."""
        total = self.sent_alnum[-1] if self.sent_alnum else 0
        self.sent_alnum.append(total + sum(map(str.isalnum, delta)))
        self.sent_at.append(now)

    def segment(self, text: str, pts_ms: float) -> None:
        """A `segment` event: `text` is spoken from `pts_ms` of the turn's audio."""
        self.num_segment_alnum += sum(map(str.isalnum, text))
        self.segment_ends.append((pts_ms, self.num_segment_alnum))

    def lead_ms(self, heard_ms: float, late_ms: float, run_out_at: float) -> float | None:
        """How long before `run_out_at` the text of the segment whose first audio ended the
        gap was complete in the input; negative when it came after. None when the late
        audio (`late_ms` of it, after `heard_ms` of the turn's) starts no segment (the gap
        fell inside one) or when the input never reached the segment's end.

        The segment starts within the late audio, not at `heard_ms` exactly: its `pts_ms`
        counts PCM to the sample, while audio comes in whole frames (20 ms by default), so
        the last part-frame of the segment before waits for the next segment's audio.
        Resolved at the gap, not at the `segment` event, so that a delta whose send was
        noted after the server had already answered it still counts.
        """
        for pts_ms, num_alnum in self.segment_ends:
            if heard_ms - 1.0 <= pts_ms < heard_ms + late_ms:  # 1 ms: pts_ms is rounded
                i = bisect.bisect_left(self.sent_alnum, num_alnum)
                if i == len(self.sent_at):
                    return None
                return (run_out_at - self.sent_at[i]) * 1000.0
        return None
