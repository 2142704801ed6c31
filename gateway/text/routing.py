"""Which voice says a segment, and what of it no voice can say (docs/voices.md, "Languages").

`route` decides one segment, sans-I/O: the context's voice keeps a segment
whose dominant script it can speak, and the runs in scripts it cannot speak
are cut out (an English sentence holding a Chinese name stays English; the
name is skipped). A segment whose dominant script the voice cannot speak goes
to the voice mapped for its language (`voice_for`: the server's
`--voice-for`, then the session's and the context's options), or, with no
voice for it, is skipped whole. Skipped text is sent to no voice: a voice
reads a script it does not know as junk (piper's English voice says "Chinese
letter" for every Han character).

A voice that declares no languages (a scripted test backend) speaks
everything, and is never routed from.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.text.language import (
    Piece,
    cut,
    dominant_script,
    language_of_script,
    primary_subtag,
    runs_of,
    scripts_of,
    spoken_text,
)

#: A `voice_for` key: a language tag (`zh`, `zh-CN`: the primary subtag counts) or
#: an undetermined one with its script (`und-Cyrl`).
LANGUAGE_KEY = re.compile(r"(?:[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8})*|und-[A-Za-z]{4})")
MAX_VOICE_FOR = 32

#: voice id -> the scripts it speaks, or None for a voice that declares no languages
ScriptsOf = Callable[[str], "frozenset[str] | None"]


@dataclass(slots=True, frozen=True)
class Route:
    """A segment's voice and its pieces, spoken and skipped, in order (they rejoin to it)."""

    voice: str
    pieces: tuple[Piece, ...]
    language: str | None  # of the segment, by its dominant script; None without letters

    @property
    def text(self) -> str:
        """What the voice says; "" when the segment is skipped whole."""
        return spoken_text(self.pieces)

    @property
    def skipped(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.is_skipped)


class _Listed(Protocol):
    @property
    def voice_id(self) -> str: ...

    @property
    def languages(self) -> tuple[str, ...]: ...


class Languages:
    """The server's half of routing, one per process: the languages each voice declares
    (`languages_of`: None for a voice it does not know) and the server's `--voice-for` map."""

    def __init__(self, languages_of: Callable[[str], tuple[str, ...] | None],
                 voice_for: Mapping[str, str] | None = None) -> None:
        self.languages_of = languages_of
        self.voice_for = merge_voice_for(normalize_voice_for(voice_for or {}))

    @classmethod
    def from_listing(cls, voices: Callable[[], Sequence[_Listed]],
                     voice_for: Mapping[str, str] | None = None) -> Languages:
        """Read from a listing that is replaced, not changed in place, when voices change (the
        engine's `voices`): the lookup is rebuilt when the listing is another one."""
        seen: list[object] = [None, -1]
        table: dict[str, tuple[str, ...]] = {}

        def languages_of(voice_id: str) -> tuple[str, ...] | None:
            listing = voices()
            if seen[0] is not listing or seen[1] != len(listing):
                table.clear()
                table.update((v.voice_id, tuple(v.languages)) for v in listing)
                seen[:] = [listing, len(listing)]
            return table.get(voice_id)

        return cls(languages_of, voice_for)


def normalize_voice_for(mapping: Mapping[str, str | None]) -> dict[str, str | None]:
    """Keys as primary subtags (`zh-CN` -> `zh`, `und-cyrl` -> `und-Cyrl`); a None voice
    stands for none (a session unmapping a language the server maps). Raises ValueError."""
    if len(mapping) > MAX_VOICE_FOR:
        raise ValueError(f"voice_for maps at most {MAX_VOICE_FOR} languages, got {len(mapping)}")
    out: dict[str, str | None] = {}
    for key, voice in mapping.items():
        if not isinstance(key, str) or not LANGUAGE_KEY.fullmatch(key):
            raise ValueError(f"voice_for keys must be language tags such as 'zh' or 'und-Cyrl', "
                             f"got {str(key)[:40]!r}")
        if voice is not None and (not isinstance(voice, str) or not voice):
            raise ValueError(f"voice_for[{key[:20]!r}] must be a voice id or null, "
                             f"got {str(voice)[:40]!r}")
        out[primary_subtag(key)] = voice
    return out


def merge_voice_for(*maps: Mapping[str, str | None]) -> dict[str, str]:
    """Later maps over earlier ones, key by key; a None voice removes the language."""
    merged: dict[str, str | None] = {}
    for mapping in maps:
        merged.update(mapping)
    return {key: voice for key, voice in merged.items() if voice is not None}


def parse_voice_for(items: Iterable[str]) -> dict[str, str]:
    """`["zh=NAME", "ru=OTHER"]` (CLI flags, or VOXGATE_VOICE_FOR split at commas)."""
    pairs: dict[str, str | None] = {}
    for item in items:
        key, sep, voice = item.strip().partition("=")
        if not sep:
            raise ValueError(f"expected LANGUAGE=VOICE such as zh=my-chinese-voice, got {item!r}")
        pairs[key.strip()] = voice.strip()
    return merge_voice_for(normalize_voice_for(pairs))


class VoiceScripts:
    """The scripts each voice speaks, from its declared languages; cached per voice."""

    def __init__(self, languages_of: Callable[[str], tuple[str, ...] | None]) -> None:
        self._languages_of = languages_of
        self._cache: dict[str, frozenset[str] | None] = {}

    def __call__(self, voice: str) -> frozenset[str] | None:
        if voice not in self._cache:
            languages = self._languages_of(voice)
            self._cache[voice] = scripts_of(languages) if languages else None
            if len(self._cache) > 1024:  # voice ids come from the listing: bounded, but be sure
                self._cache.pop(next(iter(self._cache)))
        return self._cache[voice]

    def forget(self) -> None:
        """Voices changed (registered, deleted): read their languages again."""
        self._cache.clear()


def route(text: str, voice: str, voice_for: Mapping[str, str], scripts: ScriptsOf) -> Route:
    """Decide `text`'s voice and cut out what that voice cannot say."""
    speakable = scripts(voice)
    if speakable is None:  # declares no languages: speaks everything
        return Route(voice, (Piece(text),), None)
    runs = runs_of(text)
    script = dominant_script(runs, speakable)
    if script is None:  # no letters: digits and punctuation are any voice's
        return Route(voice, (Piece(text),), None)
    language = language_of_script(script)
    if script not in speakable:
        mapped = _mapped_voice(language, script, voice_for, scripts)
        if mapped is None:
            return Route(voice, (Piece(text, language),), language)
        voice, speakable = mapped
    if speakable is None:
        return Route(voice, (Piece(text),), language)
    return Route(voice, tuple(cut(text, runs, speakable)), language)


def _mapped_voice(language: str, script: str, voice_for: Mapping[str, str],
                  scripts: ScriptsOf) -> tuple[str, frozenset[str] | None] | None:
    """The voice mapped for `language` that can speak `script`, with its scripts.

    A determined language (`zh`) needs its own key; an undetermined one
    (`und-Cyrl`) takes its own key, else the first key whose language is
    written in that script (`ru`, `uk`...).
    """
    candidates = [voice_for[language]] if language in voice_for else []
    if language.startswith("und-"):
        candidates += [voice for key, voice in voice_for.items()
                       if key != language and script in scripts_of([key])]
    for candidate in candidates:
        speakable = scripts(candidate)
        if speakable is None or script in speakable:
            return candidate, speakable
    return None
