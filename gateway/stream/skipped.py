"""Text skipped for want of a voice, counted for one log line per turn (never the text).

The native socket tells its client what it skipped (`text.skipped`,
docs/voices.md, "Languages"); the shells that have no word for it (the HTTP
speech route, the vendor sockets) log it instead: once per request or vendor
context, the characters and pieces by language, however many pieces there
were. A request of `"中。" * 2000` is one line, not 2,000. The languages are
the detector's bounded set (gateway/text/language.py), so the tally is small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.stream.events import TextSkipped


@dataclass(slots=True)
class SkippedText:
    """Characters and pieces skipped, by language, in the order the languages came."""

    by_language: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(self, event: TextSkipped) -> None:
        chars, pieces = self.by_language.get(event.language, (0, 0))
        self.by_language[event.language] = (chars + len(event.text), pieces + 1)

    def __bool__(self) -> bool:
        return bool(self.by_language)

    def summary(self) -> str:
        """"17 characters of und-Cyrl in 1 piece, 4000 characters of zh in 2000 pieces"."""
        return ", ".join(f"{chars} characters of {language} in {pieces} "
                         f"{'piece' if pieces == 1 else 'pieces'}"
                         for language, (chars, pieces) in self.by_language.items())
