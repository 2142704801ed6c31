"""What language a segment is in, and which of its pieces a voice can say.

Cheap and local, by Unicode script (docs/voices.md, "Languages"): a segment's
letters are counted per script (digits, punctuation, spaces and emoji count
for none), and the script with the most weight decides. A script that one
main language writes gives that language (Han: `zh`, or `ja` when the segment
holds kana; Hangul: `ko`; Greek: `el`...); a script many languages share gives
an undetermined tag with the script (`und-Cyrl`, `und-Arab`, `und-Deva`,
`und-Latn`). Latin-script languages are not told apart: the one small package
measured for it (py3langid) flipped short English segments to other
languages; docs/voices.md gives the figures.

A voice speaks the scripts its languages are written in (`scripts_of`). Where a
voice can speak a segment's dominant script, the segment stays on it and the
runs in scripts it cannot speak (a Chinese name in an English sentence) are cut
out: `cut` splits the text into `Piece`s, spoken or skipped, that rejoin to it
exactly. The scan is one regular expression over the text, so a segment costs
tens of microseconds (bench/bench_language.py).
"""

from __future__ import annotations

import re
import sys
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.text.segmenter import CJK_WEIGHT

#: Japanese: Han and kana in a segment that holds kana (Han alone is `Hani`).
JAPANESE = "Jpan"
LATIN = "Latn"

# Script -> the blocks that hold its letters. Blocks marked whole hold letters
# only and are taken as they are; in the others only letters and combining
# marks count (categories L and M), so a block's digits and punctuation
# (Arabic comma, Devanagari danda, Thai digits) count for no script.
_BLOCKS: dict[str, tuple[tuple[int, int, bool], ...]] = {
    "Latn": ((0x41, 0x5A, True), (0x61, 0x7A, True), (0xAA, 0xAA, True), (0xBA, 0xBA, True),
             (0xC0, 0x24F, False), (0x250, 0x2AF, True), (0x1D00, 0x1DBF, False),
             (0x1E00, 0x1EFF, True), (0x2C60, 0x2C7F, False), (0xA720, 0xA7FF, False),
             (0xAB30, 0xAB6F, False), (0xFB00, 0xFB06, True), (0xFF21, 0xFF3A, True),
             (0xFF41, 0xFF5A, True)),
    "Grek": ((0x370, 0x3FF, False), (0x1F00, 0x1FFF, False)),
    "Cyrl": ((0x400, 0x52F, False), (0x1C80, 0x1C8F, False), (0x2DE0, 0x2DFF, False),
             (0xA640, 0xA69F, False)),
    "Armn": ((0x531, 0x58F, False),),
    "Hebr": ((0x591, 0x5FF, False), (0xFB1D, 0xFB4F, False)),
    "Arab": ((0x600, 0x6FF, False), (0x750, 0x77F, False), (0x8A0, 0x8FF, False),
             (0xFB50, 0xFDFF, False), (0xFE70, 0xFEFF, False)),
    "Syrc": ((0x700, 0x74F, False),),
    "Thaa": ((0x780, 0x7BF, False),),
    "Deva": ((0x900, 0x97F, False), (0xA8E0, 0xA8FF, False)),
    "Beng": ((0x980, 0x9FF, False),),
    "Guru": ((0xA00, 0xA7F, False),),
    "Gujr": ((0xA80, 0xAFF, False),),
    "Orya": ((0xB00, 0xB7F, False),),
    "Taml": ((0xB80, 0xBFF, False),),
    "Telu": ((0xC00, 0xC7F, False),),
    "Knda": ((0xC80, 0xCFF, False),),
    "Mlym": ((0xD00, 0xD7F, False),),
    "Sinh": ((0xD80, 0xDFF, False),),
    "Thai": ((0xE00, 0xE7F, False),),
    "Laoo": ((0xE80, 0xEFF, False),),
    "Tibt": ((0xF00, 0xFFF, False),),
    "Mymr": ((0x1000, 0x109F, False),),
    "Geor": ((0x10A0, 0x10FF, False), (0x1C90, 0x1CBF, False), (0x2D00, 0x2D2F, False)),
    "Hang": ((0x1100, 0x11FF, False), (0x3130, 0x318F, False), (0xA960, 0xA97F, False),
             (0xAC00, 0xD7A3, True), (0xD7B0, 0xD7FF, False), (0xFFA0, 0xFFDC, False)),
    "Ethi": ((0x1200, 0x139F, False), (0x2D80, 0x2DDF, False)),
    "Khmr": ((0x1780, 0x17FF, False), (0x19E0, 0x19FF, False)),
    "Mong": ((0x1800, 0x18AF, False),),
    "Kana": ((0x3040, 0x309F, False), (0x30A0, 0x30FF, False), (0x31F0, 0x31FF, False),
             (0xFF66, 0xFF9F, False)),
    # Han, with bopomofo (Chinese phonetic letters) and the iteration mark 々
    "Hani": ((0x3005, 0x3007, False), (0x3021, 0x3029, False), (0x3038, 0x303B, False),
             (0x3100, 0x312F, False), (0x31A0, 0x31BF, False), (0x3400, 0x4DBF, True),
             (0x4E00, 0x9FFF, True), (0xF900, 0xFAFF, False), (0x20000, 0x3134F, True)),
}

#: A script one main language writes -> that language; the others give `und-<Script>`.
_SCRIPT_LANGUAGE = {
    "Hani": "zh", JAPANESE: "ja", "Kana": "ja", "Hang": "ko", "Grek": "el", "Hebr": "he",
    "Thai": "th", "Armn": "hy", "Geor": "ka", "Khmr": "km", "Laoo": "lo", "Mymr": "my",
    "Sinh": "si", "Taml": "ta", "Telu": "te", "Knda": "kn", "Mlym": "ml", "Gujr": "gu",
    "Guru": "pa", "Orya": "or", "Thaa": "dv",
}

#: Language (primary subtag) -> the scripts it is written in; a language not
#: listed is written in Latin (most of piper's ~40 languages are).
_LANGUAGE_SCRIPTS: dict[str, frozenset[str]] = {
    **{lang: frozenset({"Cyrl"}) for lang in
       ("ru", "uk", "be", "bg", "mk", "kk", "ky", "mn", "tg", "tt", "ba", "cv", "ce", "os", "sah")},
    **{lang: frozenset({"Cyrl", LATIN}) for lang in ("sr", "uz", "az")},
    **{lang: frozenset({"Arab"}) for lang in ("ar", "fa", "ur", "ps", "ug", "sd", "ckb")},
    **{lang: frozenset({"Deva"}) for lang in ("hi", "mr", "ne", "sa", "kok", "mai", "bho", "new")},
    **{lang: frozenset({"Beng"}) for lang in ("bn", "as", "mni")},
    **{lang: frozenset({"Hebr"}) for lang in ("he", "yi", "iw")},
    **{lang: frozenset({"Ethi"}) for lang in ("am", "ti")},
    **{lang: frozenset({"Tibt"}) for lang in ("bo", "dz")},
    **{lang: frozenset({"Hani"}) for lang in ("zh", "yue", "cmn", "wuu", "hak", "nan")},
    "ja": frozenset({JAPANESE, "Kana", "Hani"}),  # kanji alone are Japanese too
    "ko": frozenset({"Hang"}),
    "el": frozenset({"Grek"}), "hy": frozenset({"Armn"}), "ka": frozenset({"Geor"}),
    "th": frozenset({"Thai"}), "lo": frozenset({"Laoo"}), "km": frozenset({"Khmr"}),
    "my": frozenset({"Mymr"}), "si": frozenset({"Sinh"}), "ta": frozenset({"Taml"}),
    "te": frozenset({"Telu"}), "kn": frozenset({"Knda"}), "ml": frozenset({"Mlym"}),
    "gu": frozenset({"Gujr"}), "pa": frozenset({"Guru", "Arab"}), "or": frozenset({"Orya"}),
    "dv": frozenset({"Thaa"}), "syr": frozenset({"Syrc"}), "mn-mong": frozenset({"Mong"}),
}
_LATIN_ONLY = frozenset({LATIN})
#: Syllabic scripts: a character takes about as long to say as three Latin letters
#: (the segmenter's weight), so "我喜欢用iPhone手机" is Chinese, not English.
_WEIGHTS = {"Hani": CJK_WEIGHT, JAPANESE: CJK_WEIGHT, "Kana": CJK_WEIGHT, "Hang": CJK_WEIGHT}

# Text next to a skipped run that goes with it: CJK punctuation and brackets, full-width
# forms and combining marks ("王小明。" is skipped whole, not leaving "。" to be read).
_ATTACHED = re.compile("[\u0300-\u036f\u3001-\u303f\u30fb\uff01-\uff20\uff3b-\uff40\uff5b-\uff65]*")
_ATTACHED_BEFORE = re.compile("[\u3008-\u3011\u3014-\u301b\uff08\uff3b\uff5b\uff5f]+$")


def _letter_ranges(blocks: Iterable[tuple[int, int, bool]]) -> list[tuple[int, int]]:
    """Code point ranges of the letters and marks in `blocks` (built once, at import)."""
    ranges: list[tuple[int, int]] = []

    def add(lo: int, hi: int) -> None:
        if ranges and ranges[-1][1] + 1 == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))

    for lo, hi, is_whole in blocks:
        if is_whole:
            add(lo, min(hi, sys.maxunicode))
            continue
        for code in range(lo, hi + 1):
            if unicodedata.category(chr(code))[0] in "LM":
                add(code, code)
    return ranges


def _char_class(ranges: list[tuple[int, int]]) -> str:
    return "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)


# One alternative per script, the common ones first: a run is a maximal stretch of
# one script's letters, and `lastgroup` names the script.
_RUNS = re.compile("|".join(f"(?P<{script}>[{_char_class(_letter_ranges(blocks))}]+)"
                            for script, blocks in _BLOCKS.items()))
_ASCII_LETTERS = re.compile("[A-Za-z]+")


@dataclass(slots=True, frozen=True)
class Run:
    """Letters of one script, `text[start:end]`."""

    start: int
    end: int
    script: str

    @property
    def weight(self) -> int:
        return (self.end - self.start) * _WEIGHTS.get(self.script, 1)


@dataclass(slots=True, frozen=True)
class Piece:
    """A stretch of a segment: spoken (`language` None) or skipped, in that language."""

    text: str
    language: str | None = None

    @property
    def is_skipped(self) -> bool:
        return self.language is not None


def runs_of(text: str) -> list[Run]:
    """The script runs of `text`, in order; Han counts as Japanese where kana is present."""
    if text.isascii():  # the common case: English
        return [Run(m.start(), m.end(), LATIN) for m in _ASCII_LETTERS.finditer(text)]
    runs = [Run(m.start(), m.end(), m.lastgroup or "") for m in _RUNS.finditer(text)]
    if any(run.script == "Kana" for run in runs):
        runs = [Run(r.start, r.end, JAPANESE) if r.script in ("Hani", "Kana") else r for r in runs]
    return runs


def language_of_script(script: str) -> str:
    """`zh` for Han, `ja` for Japanese, `und-Cyrl` for Cyrillic (a script of many languages)."""
    return _SCRIPT_LANGUAGE.get(script) or f"und-{script}"


def primary_subtag(tag: str) -> str:
    """`en` for `en-US` or `en_us`; an undetermined tag keeps its script (`und-Cyrl`)."""
    parts = tag.replace("_", "-").split("-")
    if parts[0].lower() == "und" and len(parts) > 1:
        return f"und-{parts[1].title()}"
    return parts[0].lower()


def scripts_of(languages: Iterable[str]) -> frozenset[str]:
    """The scripts that voices of these languages can read (`und-Cyrl`: Cyrillic)."""
    scripts: set[str] = set()
    for tag in languages:
        primary = primary_subtag(tag)
        if primary.startswith("und-"):
            scripts.add(primary[4:])
        else:
            scripts |= _LANGUAGE_SCRIPTS.get(primary, _LATIN_ONLY)
    return frozenset(scripts)


def dominant_script(runs: list[Run], preferred: frozenset[str] = frozenset()) -> str | None:
    """The script with the most weight; on a tie one of `preferred` (the voice's) wins.

    None when the text has no letters (digits and punctuation are any voice's).
    """
    weights: dict[str, int] = {}
    for run in runs:
        weights[run.script] = weights.get(run.script, 0) + run.weight
    if not weights:
        return None
    top = max(weights.values())
    leaders = [script for script, weight in weights.items() if weight == top]
    return next((s for s in leaders if s in preferred), leaders[0])


def detect(text: str) -> str | None:
    """The language tag of `text` by its dominant script; None without letters."""
    script = dominant_script(runs_of(text))
    return None if script is None else language_of_script(script)


def cut(text: str, runs: list[Run], speakable: frozenset[str]) -> list[Piece]:
    """`text` as pieces: spoken, and skipped where a run's script is not in `speakable`.

    The pieces rejoin to `text` exactly. Skipped runs of one language with only
    non-letters between them are one piece ("王 小明"), and the CJK punctuation
    around them goes with them.
    """
    pieces: list[Piece] = []
    pos = 0
    i = 0
    while i < len(runs):
        run = runs[i]
        if run.script in speakable:
            i += 1
            continue
        language = language_of_script(run.script)
        j = i
        while (j + 1 < len(runs) and runs[j + 1].script not in speakable
               and language_of_script(runs[j + 1].script) == language):
            j += 1
        start, end = run.start, runs[j].end
        # the punctuation around it, up to the letters on either side
        limit = runs[j + 1].start if j + 1 < len(runs) else len(text)
        attached = _ATTACHED.match(text, end, limit)
        end = attached.end() if attached else end
        before = _ATTACHED_BEFORE.search(text, max(pos, runs[i - 1].end if i else 0), start)
        start = before.start() if before else start
        if start > pos:
            pieces.append(Piece(text[pos:start]))
        pieces.append(Piece(text[start:end], language))
        pos = end
        i = j + 1
    if pos < len(text):
        pieces.append(Piece(text[pos:]))
    return pieces


def spoken_text(pieces: Iterable[Piece]) -> str:
    """What the voice says: the spoken pieces, each with its spaces collapsed, joined by one.

    Its words (`str.split`) are the spoken pieces' words, in order, which is how
    word timings map back onto the pieces at barge-in.
    """
    return " ".join(" ".join(p.text.split()) for p in pieces if not p.is_skipped and p.text.strip())
