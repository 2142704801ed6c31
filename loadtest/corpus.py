"""The LLM answers the load generator plays, cut into token-sized deltas.

The corpus (data/corpus.jsonl, one `{"id", "lang", "text"}` object a line) is
written by `python -m loadtest.make_corpus`. Deltas approximate a BPE
tokenizer's output: a word with its leading space, long words in pieces of up
to 6 letters, digits in groups of up to 3, each punctuation mark alone, one or
two CJK characters. Joined, the deltas are the answer exactly.

`first_segment_end` fixes the moment TTFA is measured from ("first segment
complete in the input"), see docs/loadtest.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

_TOKEN = re.compile(
    r"[ \t]?[A-Za-z]{1,6}"  # a word or a piece of one, with its leading space
    r"|[ \t]?\d{1,3}"  # digit groups
    r"|[\u3400-\u9fff]{1,2}"  # CJK ideographs, one or two per token
    r"|\n+"  # line breaks
    r"|[ \t]+(?=\s)|[ \t]"  # runs of blanks
    r"|[ \t]?[^\sA-Za-z\d\u3400-\u9fff]"  # any other mark, alone
)

# Sentence ends: Latin ones need what follows to be whitespace (that is what
# tells "3.14" and "e.g." apart from a full stop); CJK ones need nothing after.
_LATIN_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s)")
_CJK_END = re.compile(r"[。！？]+[”’」』）]*")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "Dr.", "Mr.", "Mrs.", "Ms.", "St.", "No.")
_LIST_MARKER = re.compile(r"(?:^|\n)[ \t]*\d{1,3}[.)]$")


@dataclass(slots=True, frozen=True)
class Answer:
    """One LLM answer of the corpus."""

    answer_id: str
    lang: str
    text: str

    def __post_init__(self) -> None:
        if not self.text:
            raise ValueError(f"expected non-empty text for answer {self.answer_id!r}")


def default_corpus_path() -> Path:
    return Path(str(resources.files("loadtest") / "data" / "corpus.jsonl"))


def load_corpus(path: str | Path | None = None) -> list[Answer]:
    """Read a corpus file: JSON lines with at least a `text` field."""
    path = Path(path) if path is not None else default_corpus_path()
    answers: list[Answer] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: expected a JSON object, got {exc}") from exc
            if not isinstance(item, dict) or not isinstance(item.get("text"), str):
                raise TypeError(f"{path}:{number}: expected an object with a string 'text', "
                                f"got {type(item).__name__}")
            answers.append(
                Answer(str(item.get("id", number)), str(item.get("lang", "en")), item["text"]))
    if not answers:
        raise ValueError(f"expected at least one answer in {path}, got none")
    return answers


def tokenize(text: str) -> list[str]:
    """Token-sized deltas whose concatenation is `text`, character for character."""
    tokens: list[str] = []
    pos = 0
    for match in _TOKEN.finditer(text):
        if match.start() > pos:  # anything the pattern skipped travels alone
            tokens.append(text[pos:match.start()])
        tokens.append(match.group())
        pos = match.end()
    if pos < len(text):
        tokens.append(text[pos:])
    return tokens


def first_segment_end(text: str) -> int | None:
    """Index just past the first sentence end whose completion the input confirms.

    A Latin sentence end is `.`, `!`, `?` or `…` (with closing quotes or
    brackets) followed by whitespace; the whitespace must already be in `text`.
    Abbreviations from a short list and list markers ("2.") do not end a
    sentence. A CJK full stop, exclamation or question mark ends one at once.
    None when `text` holds no complete sentence yet (then the flush completes it).
    """
    found = _first_end(text)
    return found[0] if found is not None else None


def _first_end(text: str) -> tuple[int, int] | None:
    """(end of the sentence, characters the input must hold to confirm it)."""
    candidates: list[tuple[int, int]] = []
    for match in _LATIN_END.finditer(text):
        head = text[:match.end()]
        if head.endswith(_ABBREVIATIONS) or _LIST_MARKER.search(head):
            continue
        candidates.append((match.end(), match.end() + 1))  # the whitespace confirms it
        break
    cjk = _CJK_END.search(text)
    if cjk is not None:
        candidates.append((cjk.end(), cjk.end()))
    return min(candidates) if candidates else None


def first_segment_token(tokens: list[str]) -> int | None:
    """Index of the token whose sending completes the first segment (None: the flush does).

    For a Latin end that is the token carrying the whitespace after the mark;
    for a CJK end, the token carrying the mark itself (and its closing quotes).
    """
    found = _first_end("".join(tokens))
    if found is None:
        return None
    needed = found[1]
    sent = 0
    for index, token in enumerate(tokens):
        sent += len(token)
        if sent >= needed:
            return index
    return None
