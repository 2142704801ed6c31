"""The voices sessions may choose, and who holds each: one catalog per process.

Sessions and HTTP requests validate a voice id against `listed` (instead of
each keeping a copy of the list) and `hold` the voices they speak with: a
session its current voice and each open context's voice, an HTTP speech
request its voice until its body ends. They `release` them on change, at a
context's end and on disconnect, as they `admit` and `release_context`
engine capacity.

A deleted voice is `retire`d: it leaves the listing at once (new choices get
`unknown_voice`), but whoever holds it keeps speaking with it. It is removed
from the engine when its last holder lets go: the catalog calls `on_unheld`
with its id, and the voice service removes it (gateway/voices/service.py). A voice in
use is a reference count, not a sweep.

Plain Python, no I/O and no engine: `VoiceService` keeps the listing in step
with the engine's, and unit tests drive the catalog directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class VoiceCatalog:
    """Listed voices, hold counts, and retired voices waiting for their last holder."""

    def __init__(self, voice_ids: Iterable[str] = (),
                 on_unheld: Callable[[str], None] | None = None) -> None:
        self._listed = frozenset(voice_ids)
        self._holds: dict[str, int] = {}  # voice id -> holders (entries > 0 only)
        self._retired: set[str] = set()
        self.on_unheld = on_unheld

    # -- the listing ---------------------------------------------------------

    @property
    def listed(self) -> frozenset[str]:
        """The voices a session or request may choose now."""
        return self._listed

    def set_listed(self, voice_ids: Iterable[str]) -> None:
        """Replace the listing (start-up: the engine's voices)."""
        self._listed = frozenset(voice_ids)
        self._retired -= self._listed

    def add(self, voice_id: str) -> None:
        """List a voice (registered, or registered again after a delete)."""
        self._listed |= {voice_id}
        self._retired.discard(voice_id)

    def retire(self, voice_id: str) -> bool:
        """Unlist a deleted voice; True when nobody holds it (the caller removes it now).

        Otherwise it waits for its last holder, and `on_unheld` fires then.
        """
        self._listed -= {voice_id}
        if self._holds.get(voice_id, 0) == 0:
            return True
        self._retired.add(voice_id)
        return False

    def is_retired(self, voice_id: str) -> bool:
        """Deleted, and still held or not yet removed from the engine."""
        return voice_id in self._retired

    def forget(self, voice_id: str) -> None:
        """A retired voice is gone from the engine: stop tracking it."""
        self._retired.discard(voice_id)

    # -- holders ---------------------------------------------------------------

    def hold(self, voice_id: str) -> None:
        """One more holder. Validating the choice is the caller's (against `listed`)."""
        self._holds[voice_id] = self._holds.get(voice_id, 0) + 1

    def release(self, voice_id: str) -> None:
        """One holder fewer; the last holder of a retired voice triggers `on_unheld`."""
        count = self._holds.get(voice_id, 0)
        if count <= 0:
            raise ValueError(f"expected a held voice, got {voice_id!r}, which nobody holds")
        if count > 1:
            self._holds[voice_id] = count - 1
            return
        del self._holds[voice_id]
        if voice_id in self._retired and self.on_unheld is not None:
            self.on_unheld(voice_id)

    def num_holders(self, voice_id: str) -> int:
        return self._holds.get(voice_id, 0)
