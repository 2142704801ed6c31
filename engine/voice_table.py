"""A backend's registered voices: the listed ones, and the retired ones sessions still hold.

Both backends keep registered voices the same way (docs/voices.md): `add`
lists a voice (and brings a retired one of that id back), `retire` unlists
it while requests and sessions that hold it keep speaking with it, and
`remove` forgets it. What a voice is (piper: its listing and the installed
voice that speaks for it; cosyvoice: its prompt features) is the backend's
own; the table only keeps the two dictionaries consistent and answers the
errors the `Backend` voice methods document. Like those methods it runs on
the engine's worker thread and takes no lock.

`add` over a retired id replaces the voice for everyone still holding it, on
either backend. The gateway relies on that being its owner's own new voice: it
registers a deleted voice's id again only for the tenant that owned it
(gateway/voices/service.py, `_check_free`; docs/voices.md, "Deleting a voice in
use"), so no holder hears another tenant's voice under an id it chose.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from engine.errors import UnknownVoiceError

V = TypeVar("V")


class VoiceTable(Generic[V]):
    """Registered voices by id: listed, or retired (unlisted, still speakable)."""

    def __init__(self) -> None:
        self._listed: dict[str, V] = {}
        self._retired: dict[str, V] = {}

    def add(self, voice_id: str, voice: V) -> None:
        """List `voice` under `voice_id`, replacing a listed or retired voice of that id (its
        holders speak with the new one: the same owner's, see the module doc)."""
        self._retired.pop(voice_id, None)
        self._listed[voice_id] = voice

    def retire(self, voice_id: str) -> None:
        """Unlist a registered voice; `get` still finds it. Raises UnknownVoiceError."""
        voice = self._listed.pop(voice_id, None)
        if voice is None:
            raise UnknownVoiceError(f"unknown registered voice {voice_id!r}")
        self._retired[voice_id] = voice

    def remove(self, voice_id: str) -> None:
        """Forget a registered voice, listed or retired. Raises UnknownVoiceError."""
        if self._listed.pop(voice_id, None) is None and self._retired.pop(voice_id, None) is None:
            raise UnknownVoiceError(f"unknown registered voice {voice_id!r}")

    def get(self, voice_id: str) -> V | None:
        """The voice registered under `voice_id`, listed or retired; None if there is none."""
        voice = self._listed.get(voice_id)
        return voice if voice is not None else self._retired.get(voice_id)

    def listed(self) -> list[V]:
        """The listed voices, in the order they were added."""
        return list(self._listed.values())

    def ids(self) -> list[str]:
        """The listed voices' ids (retired ones are not offered)."""
        return list(self._listed)
