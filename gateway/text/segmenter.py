"""Incremental sentence segmenter: text deltas in, speakable segments out.

Sans-I/O and clock-free (time is passed in). Fed deltas of any size, it
releases a segment only once the text after its boundary confirms it, so the
segments depend on the text alone, never on how it was split into deltas
(docs/protocol.md, "Rules the server keeps"); the one exception is the time-based
release of `max_buffer_delay_ms`. Text is first cleaned for speech
(gateway/text/cleanup.py); the emitted segments, joined, equal the cleaned text
up to the whitespace between them.

How it stays split-invariant: candidates are judged left to right, each to
CUT, NO or WAIT, from the text up to a bounded lookahead only; the first CUT
is taken, a WAIT stops the scan until more text (or `flush`) comes. A NO is
final, so the scan resumes where it stopped. Rules and defaults are in
docs/segmenter.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.text.cleanup import BREAK, CODE_CLOSE, CODE_OPEN, SpeechCleaner, is_cjk, strip_marks

CJK_WEIGHT = 3  # a Han character takes about as long to say as three Latin letters

_TERMINALS = ".!?…"
_CJK_TERMINALS = "。！？；"
_CLOSERS = "\"')]}’”»」』）】〉》"
_OPENERS = "\"'([{‘“«「『（【〈《¿¡"
_TOKEN_STOPS = " " + BREAK + CODE_OPEN + CODE_CLOSE + _OPENERS
_NO_LEAD = set(_CLOSERS + _TERMINALS + _CJK_TERMINALS + ",;:，、：")
_SENTENCE = re.compile(f"[{BREAK}{CODE_OPEN}{CODE_CLOSE}.!?…。！？；]")
_SENTENCE_OR_CLAUSE = re.compile(f"[{BREAK}{CODE_OPEN}{CODE_CLOSE}.!?…。！？；,;:，、：—–-]")
_CLAUSE = re.compile(r"[,;:](?= )|[，、：—]|(?<= )[-–](?= )")
_WORD = re.compile(r"[^\W_]+(?:['’.-][^\W_]+)*")
_NEXT_WORD = re.compile(r"[A-Za-z]+(?:['’][A-Za-z]+)?")
_SPEAKABLE = re.compile(r"[^\W_]")
_DOTTED = re.compile(r"(?:[A-Za-z]{1,3}\.)+[A-Za-z]{1,3}")

def _wordset(text: str) -> frozenset[str]:
    return frozenset(text.split())


# After these a period never ends the sentence: titles, and Latin
# abbreviations that always introduce more ("e.g.", "cf.").
_NEVER_END = _wordset("""
    mr mrs ms mx dr prof rev fr hon st mt ft gen col capt cpt lt sgt maj cmdr adm
    gov sen rep pres supt messrs mme mlle e.g i.e eg ie cf vs v viz approx ca
    """)
# Before a number these never end it ("No. 5", "Jan. 5", "p. 12").
_BEFORE_NUMBER = _wordset("""
    no nos nr vol vols fig figs p pp ch chap sec sect art eq op pt pts para ver ref
    tel ext jan feb mar apr jun jul aug sep sept oct nov dec
    """)
# These may end a sentence: they do when a typical sentence opener follows
# ("in the U.S. The ...", but "U.S. Army"); initials ("J. R. R. Tolkien") too.
_MAY_END = _wordset("""
    etc al inc ltd co corp jr sr bros dept est govt llc plc assn univ misc
    """)
_OPENER_WORDS = _wordset("""
    A An And As At After Also Although Because Before But By Can Could Did Do Does
    Each Every Finally First For From He Her Here His How However I If In It Its
    Let Let's Many Most My Next No Now Of On Once One Or Our Please She Since So
    Some Still That The Their Then There These They This Those Though Thus To
    Today Tomorrow Unless Until We What When Where Which While Who Why With Yet
    You Your Yes
    """)


@dataclass(slots=True)
class SegmenterConfig:
    """Segmentation policy of one context; docs/segmenter.md justifies the defaults.

    `max_buffer_delay_ms` of 0 means only punctuation, the length cap and flush
    release text (docs/protocol.md, "Options").
    """

    max_segment_chars: int = 250
    first_segment_min_words: int = 4
    max_buffer_delay_ms: int = 0
    first_segment_max_chars: int = 100
    code_block_text: str = ""

    def __post_init__(self) -> None:
        for name in ("max_segment_chars", "first_segment_min_words", "max_buffer_delay_ms",
                     "first_segment_max_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.max_segment_chars < 20:
            raise ValueError(f"max_segment_chars must be >= 20, got {self.max_segment_chars}")
        if self.first_segment_max_chars < 20:
            raise ValueError(
                f"first_segment_max_chars must be >= 20, got {self.first_segment_max_chars}")
        if self.first_segment_min_words < 1:
            raise ValueError(
                f"first_segment_min_words must be >= 1, got {self.first_segment_min_words}")
        if self.max_buffer_delay_ms < 0:
            raise ValueError(f"max_buffer_delay_ms must be >= 0, got {self.max_buffer_delay_ms}")
        if not isinstance(self.code_block_text, str):
            raise TypeError(
                f"code_block_text must be a str, got {type(self.code_block_text).__name__}")


def text_weight(text: str) -> int:
    """Length for the cap: Latin characters count 1, CJK characters `CJK_WEIGHT`."""
    if text.isascii():
        return len(text) - text.count(CODE_OPEN) - text.count(CODE_CLOSE)
    return sum(CJK_WEIGHT if is_cjk(c) else 0 if c in CODE_OPEN + CODE_CLOSE else 1
               for c in text)


def count_words(text: str) -> int:
    """Words for the first-segment rule; two Han characters make about one word."""
    total = 0
    for word in _WORD.findall(text):
        num_cjk = sum(1 for c in word if is_cjk(c)) if not word.isascii() else 0
        total += 1 if num_cjk == 0 else (num_cjk + 1) // 2 + (num_cjk < len(word))
    return total


def _cap_index(text: str, cap: int) -> int | None:
    """Index of the first character that no longer fits under `cap`, or None."""
    head = text[: cap + 1]
    if head.isascii() and CODE_OPEN not in head:
        return cap if len(text) > cap else None
    weight = 0
    for i, char in enumerate(text):
        weight += CJK_WEIGHT if is_cjk(char) else 0 if char in CODE_OPEN + CODE_CLOSE else 1
        if weight > cap:
            return i
    return None


_WAIT = -1  # a judgement needing more text
_NO = -2


class Segmenter:
    """Cuts one context's text stream into speakable segments."""

    def __init__(self, config: SegmenterConfig | None = None) -> None:
        self.config = config or SegmenterConfig()
        self._cleaner = SpeechCleaner(self.config.code_block_text)
        self._buffer = ""  # cleaned, not yet released; starts at a segment start
        self._scan_pos = 0  # candidates before this index were judged NO
        self._is_scan_in_code = False
        self._last_input_at: float | None = None
        self.num_emitted = 0
        self.num_words_emitted = 0

    @property
    def pending_text(self) -> str:
        """Text received but not yet released (cleaned where already decided)."""
        cleaned = " ".join(strip_marks(self._buffer).split())
        raw = self._cleaner.pending_raw
        return f"{cleaned} {raw}" if cleaned and raw.strip() else cleaned or raw

    def _has_pending_text(self) -> bool:
        """`pending_text` is more than blanks; asked on every message, so it builds nothing
        from the cleaner's held text, which may be long (a run of markers)."""
        return self._cleaner.has_pending_text or bool(strip_marks(self._buffer).strip())

    def push(self, delta: str, now: float) -> list[str]:
        """Append a delta; return the segments it completes."""
        self._buffer += self._cleaner.feed(delta)
        self._last_input_at = now
        return self._release(final=False)

    def flush(self, now: float) -> list[str]:
        """No more text comes: release everything buffered."""
        self._buffer += self._cleaner.finish()
        self._last_input_at = None
        return self._release(final=True)

    def poll(self, now: float) -> list[str]:
        """Release buffered text that waited `max_buffer_delay_ms` for more."""
        deadline = self.next_deadline()
        if deadline is None or now < deadline:
            return []
        self._buffer += self._cleaner.drain()
        return self._release(final=True)

    def next_deadline(self) -> float | None:
        delay = self.config.max_buffer_delay_ms
        if delay <= 0 or self._last_input_at is None or not self._has_pending_text():
            return None
        return self._last_input_at + delay / 1000.0

    def clear(self) -> None:
        """Drop everything buffered (cancel)."""
        self._cleaner = SpeechCleaner(self.config.code_block_text)
        self._buffer = ""
        self._reset_scan()
        self._last_input_at = None

    # -- cutting --------------------------------------------------------------

    def _reset_scan(self) -> None:
        self._scan_pos = 0
        self._is_scan_in_code = False

    def _release(self, final: bool) -> list[str]:
        segments: list[str] = []
        self._buffer = self._buffer.lstrip(" " + BREAK)
        while self._buffer:
            cut = self._next_cut(final)
            if cut is None:
                break
            end, resume = cut
            head, rest = self._buffer[:end], self._buffer[resume:].lstrip(" " + BREAK)
            if rest and head.rfind(CODE_OPEN) > head.rfind(CODE_CLOSE):
                rest = CODE_OPEN + rest  # a cap cut inside code: the rest stays code
            self._buffer = rest
            self._reset_scan()
            text = strip_marks(head).strip(" " + BREAK)
            if text:
                segments.append(text)
                self.num_emitted += 1
                self.num_words_emitted += count_words(text)
        return segments

    def _next_cut(self, final: bool) -> tuple[int, int] | None:
        """(end of segment, start of the rest) of the first confirmed cut, or None."""
        text = self._buffer
        # Early segments (until the context has spoken `first_segment_min_words` words) may
        # end at a clause: after a short opener ("Sure!") the next clause follows at once,
        # before the opener's half second of audio runs out.
        is_early = self.num_words_emitted < self.config.first_segment_min_words
        cap = self.config.max_segment_chars
        if is_early:
            cap = min(cap, self.config.first_segment_max_chars)
        limit = _cap_index(text, cap)
        stop = len(text) if limit is None else limit
        pattern = _SENTENCE_OR_CLAUSE if is_early else _SENTENCE
        pos, in_code = self._scan_pos, self._is_scan_in_code
        while (match := pattern.search(text, pos, stop)) is not None:
            i = match.start()
            char = text[i]
            if char in CODE_OPEN + CODE_CLOSE:
                in_code = char == CODE_OPEN
                pos = i + 1
            elif in_code:
                pos = i + 1
            else:
                end, resume = self._judge(text, i, final)
                if end == _WAIT:
                    break
                if end >= 0 and end <= stop and _SPEAKABLE.search(text, 0, end):
                    return end, resume
                pos = resume
            self._scan_pos, self._is_scan_in_code = pos, in_code
        else:
            if limit is not None:
                return self._cap_cut(text, limit)
            if final:
                return len(text), len(text)
        return None

    def _judge(self, text: str, i: int, final: bool) -> tuple[int, int]:
        """(end, resume) for a CUT, or (_NO, where to go on), or (_WAIT, i)."""
        char = text[i]
        if char == BREAK:
            return i, i + 1
        if char in _CJK_TERMINALS:
            j = _skip(text, i + 1, _TERMINALS + _CJK_TERMINALS + _CLOSERS)
            if j == len(text) and not final:
                return _WAIT, i
            return j, j
        if char in _TERMINALS:
            return self._judge_terminal(text, i, final)
        return self._judge_clause(text, i, final)

    def _judge_terminal(self, text: str, i: int, final: bool) -> tuple[int, int]:
        """`.` `!` `?` `…`: a boundary when a space and a sentence start follow."""
        run_end = _skip(text, i, _TERMINALS + _CJK_TERMINALS)
        j = _skip(text, run_end, _CLOSERS)
        if j == len(text):
            return (_NO, j) if final else (_WAIT, i)
        run = text[i:run_end]
        after = text[j]
        if after != " ":
            # Chinese written with ASCII marks: "好!我们" ends there; "3.14", "12345.Let's" do not.
            is_cjk_stop = (i > 0 and is_cjk(text[i - 1]) and is_cjk(after)
                           and "…" not in run and ".." not in run)
            return (j, j) if is_cjk_stop else (_NO, j)
        k = j + 1
        if k == len(text):
            return (_NO, j) if final else (_WAIT, i)
        start = text[k]
        is_start = (start.isdigit() or is_cjk(start) or start in _OPENERS or start == CODE_OPEN
                    or (start.isalpha() and not start.islower()))
        if not is_start:
            return _NO, j
        if run != ".":
            return j, j
        token_start = i
        while (token_start > 0 and text[token_start - 1] not in _TOKEN_STOPS
               and not is_cjk(text[token_start - 1])):
            token_start -= 1
        kind = _abbreviation_kind(text[token_start:i])
        if kind == "never" or (kind == "number" and start.isdigit()):
            return _NO, j
        if kind == "enumeration" and not text[:token_start].strip(" " + CODE_OPEN + CODE_CLOSE):
            return _NO, j
        if kind == "maybe":
            word = _NEXT_WORD.match(text, k)
            if word is None:
                return _NO, j
            after_word = text[word.end():word.end() + 2]
            if not final and (not after_word or (after_word in "'’" and len(after_word) == 1)):
                return _WAIT, i  # the word may go on ("Let" -> "Let's")
            is_initial = word.end() < len(text) and text[word.end()] == "."
            if word.group() not in _OPENER_WORDS or is_initial:
                return _NO, j
        return j, j

    def _judge_clause(self, text: str, i: int, final: bool) -> tuple[int, int]:
        """Early segments only: a clause mark once the segment holds enough words."""
        char = text[i]
        if char == "—":
            end = _skip(text, i, "—")
        elif char in "，、：":
            end = i + 1
        else:
            if char in "-–" and (i == 0 or text[i - 1] != " "):
                return _NO, i + 1
            if i + 1 == len(text):
                return (_NO, i + 1) if final else (_WAIT, i)
            if text[i + 1] != " ":
                return _NO, i + 1
            end = i + 1
        if end == len(text) and not final:
            return _WAIT, i
        if count_words(strip_marks(text[:end])) < self.config.first_segment_min_words:
            return _NO, end
        return end, end

    def _cap_cut(self, text: str, limit: int) -> tuple[int, int]:
        """Cut an over-long segment at its last clause mark, else a word boundary."""
        best = 0
        for match in _CLAUSE.finditer(text, 0, limit):
            if match.end() >= limit // 2:
                best = match.end()
        if best:
            return best, best
        best = text.rfind(" ", 0, limit + 1)
        for q in range(limit, max(best, 0, limit - 64), -1):
            if (is_cjk(text[q - 1]) or is_cjk(text[q])) and text[q] not in _NO_LEAD:
                best = q
                break
        if best > 0:
            return best, best
        return limit, limit


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _abbreviation_kind(token: str) -> str:
    lower = token.lower()
    if lower in _NEVER_END:
        return "never"
    if lower in _BEFORE_NUMBER:
        return "number"
    if (len(token) == 1 and token.isalpha()) or lower in _MAY_END or _DOTTED.fullmatch(token):
        return "maybe"
    if token.isdigit() and len(token) <= 2:
        return "enumeration"
    return "plain"
