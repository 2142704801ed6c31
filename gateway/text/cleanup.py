"""Cleanup of LLM text for speech: markdown, emoji and symbols out, words in.

`SpeechCleaner` is incremental like the segmenter it feeds: `feed(delta)`
returns only the cleaned text that no later delta can change, so a marker
split across deltas (`*` then `*bold**`) cleans exactly as the whole text.
Its output is the speakable text plus three marks the segmenter reads:

- `BREAK` ("\\n") between blocks (blank line, list item, heading, table row,
  code block): a hard segment boundary;
- `CODE_OPEN` / `CODE_CLOSE` around inline code, where no sentence boundary
  may fall.

`clean_for_speech(text)` is the whole-text form with the marks removed: the
reference that the joined segments of a context equal (docs/protocol.md,
"Rules the server keeps": text is never lost or duplicated). Rules, each with
its reason, are in docs/segmenter.md.

The block syntax at line starts is read by `BlockReader` (blocks.py), the
inline syntax here; both share this scanner's state.

Work is linear in the text, however it is split (docs/segmenter.md, "Cost
per delta"). Text that cannot be judged yet is held, and a hold is bounded:
a line's block syntax by blocks.py's windows, a link and a code span by
theirs (MAX_LINK_*, MAX_CODE_SPAN). While a hold waits, the cleaner
remembers what it waits for (`_hold`: the characters that keep it
undecided), so a delta of more of them is appended without reading the held
text again. Runs of emphasis markers, and backtick runs too long for any code
span, are read as they come and kept as a count, not as text. `num_examined`
counts the characters read, for the tests that show it.
"""

from __future__ import annotations

import re

from gateway.text.blocks import BlockReader

BREAK = "\n"
CODE_OPEN = "\x02"
CODE_CLOSE = "\x03"
MARKS = BREAK + CODE_OPEN + CODE_CLOSE

MAX_CODE_SPAN = 200  # a backtick not closed within this many chars (or the line) is dropped
MAX_LINK_TEXT = 300
MAX_LINK_URL = 2000

# Symbols read as nothing: pictographs, dingbats, arrows, box drawing, shapes,
# private use. Removing one leaves a word gap ("done✅now" -> "done now").
_GAP = (
    "\u2190-\u21ff\u2300-\u23ff\u2500-\u27bf\u27f0-\u27ff\u2900-\u297f"
    "\u2b00-\u2bff\u3030\u303d\u3297\u3299\ue000-\uf8ff\U0001f000-\U0001f3fa"
    "\U0001f400-\U0001faff\U000f0000-\U0010ffff|\u2022"
)
# Invisible glue removed without a gap: zero-width joiners and spaces, soft
# hyphen, variation selectors, keycap, skin tones, tag characters, controls.
_SILENT = (
    "\x00-\x01\x04-\x08\x0e-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u2028-\u202e\u2060-\u206f"
    "\ufe00-\ufe0f\ufeff\u20e3\U0001f3fb-\U0001f3ff\U000e0000-\U000e007f\ud800-\udfff\\\\"
)
_SPACES = "\t\x0b\x0c\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000"
# Ordinary text (and plain spaces) that needs no lookahead.
_PLAIN = re.compile(f"[^\n\r`\\[!*_~{_GAP}{_SILENT}{_SPACES}\x02\x03]+")
_GAP_RE = re.compile(f"[{_GAP}]+")
_SILENT_RE = re.compile(f"[{_SILENT}\x02\x03\r]+")
_SPACES_RE = re.compile(f"[{_SPACES}]+")
_BACKTICKS = re.compile(r"`+")
_BREAK_RE = re.compile(r"(.)\n(?=(.))", re.DOTALL)
# What keeps a held construct undecided (see `_hold`), and runs read as they come.
_RUN_OF = {c: re.compile(re.escape(c) + "*") for c in "`*_~"}
_CODE_SPAN_TEXT = re.compile(r"[^`\n]*")
_LINK_TEXT = re.compile(r"[^\[\]\n]*")
_LINK_URL = re.compile(r"[^()\n\t ]*")

# A gap left by a removed symbol is not spoken before these ("done✅." -> "done.").
_CLOSING = set(".,!?;:)]}…'\"’”»%。，！？；：、）》」』】")


def is_cjk(char: str) -> bool:
    """Han, kana and full-width forms: written without spaces between words."""
    code = ord(char)
    return (0x3000 <= code <= 0x30FF or 0x3400 <= code <= 0x4DBF or 0x4E00 <= code <= 0x9FFF
            or 0xF900 <= code <= 0xFAFF or 0xFF00 <= code <= 0xFFEF or 0x20000 <= code <= 0x2FFFF)


def clean_for_speech(text: str, code_block_text: str = "") -> str:
    """The speakable form of a whole text, blocks joined by single spaces."""
    cleaner = SpeechCleaner(code_block_text)
    out = cleaner.feed(text) + cleaner.finish()
    return strip_marks(out).rstrip(BREAK)


def strip_marks(text: str) -> str:
    """Cleaner output -> plain speakable text (breaks become spaces, none between Han)."""
    text = text.replace(CODE_OPEN, "").replace(CODE_CLOSE, "")
    if BREAK not in text:
        return text
    def join(m: re.Match[str]) -> str:
        return m.group(1) + ("" if is_cjk(m.group(1)) and is_cjk(m.group(2)) else " ")
    return _BREAK_RE.sub(join, text)


class SpeechCleaner(BlockReader):
    """Incremental markdown-to-speech cleaner; output depends on the text only.

    `code_block_text` is what a fenced code block is read as; "" (the
    default) skips it: the listener hears the prose, the screen shows code.
    """

    def __init__(self, code_block_text: str = "", is_inline_only: bool = False) -> None:
        self.code_block_text = code_block_text
        self._is_inline_only = is_inline_only
        self._raw = ""
        self.num_examined = 0  # characters read, held text read again included (tests count it)
        self._reset_state()

    def _reset_state(self) -> None:
        self._is_line_start = not self._is_inline_only
        self._fence: str | None = None  # the opening run while inside a code block
        self._is_fence_midline = False
        self._is_heading_line = False
        self._prev_raw = " "  # the raw character before the unread text
        self._prev_out = ""  # the last visible character written
        self._pending_space = 0  # 0 none, 1 gap left by a symbol, 2 real space
        self._is_break_out = False  # the last thing written is a BREAK
        self._is_newline_pending = False
        self._out: list[str] = []
        # What the held text waits for: a delta all of this pattern, keeping the held text
        # within `_hold_limit` characters, cannot decide it (`_hold`).
        self._waits_for: re.Pattern[str] | None = None
        self._hold_limit = 0
        # a run at the end: (char, count, before)
        self._delimiters: tuple[str, int, str] | None = None
        self._is_dropping_ticks = False  # a backtick run too long for any code span goes on
        self._line_of: str | None = None  # a rule or fence line judged early: its char goes on

    @property
    def pending_raw(self) -> str:
        """Input held back until the text after it decides how it reads."""
        held = self._delimiters
        return (held[0] * held[1] if held else "") + self._raw

    @property
    def has_pending_text(self) -> bool:
        """Whether held input holds more than blanks (without building `pending_raw`)."""
        return self._delimiters is not None or bool(self._raw.strip())

    def feed(self, delta: str) -> str:
        waits = self._waits_for
        if (waits is not None and len(self._raw) + len(delta) <= self._hold_limit
                and waits.fullmatch(delta)):
            self._raw += delta  # still undecided: the held text is not read again
            self.num_examined += len(delta)
            return ""
        self._raw += delta
        return self._run(final=False)

    def drain(self) -> str:
        """Read all held input as if the text ended here, but stay mid-text."""
        return self._run(final=True)

    def finish(self) -> str:
        """The text ended: read what is held and start afresh."""
        out = self._run(final=True)
        self._reset_state()
        return out

    # -- output ---------------------------------------------------------------

    def _emit(self, word: str) -> None:
        """Write visible text (no whitespace), first settling the gap before it."""
        first = word.lstrip(CODE_OPEN + CODE_CLOSE)[:1] or word[0]
        if (self._prev_out and not self._is_break_out and self._pending_space
                and not (is_cjk(self._prev_out) and is_cjk(first))
                and (self._pending_space == 2 or first not in _CLOSING)):
            self._out.append(" ")
        self._is_break_out = False
        self._pending_space = 0
        self._out.append(word)
        last = word.rstrip(CODE_OPEN + CODE_CLOSE)[-1:]
        if last:
            self._prev_out = last

    def _emit_text(self, text: str) -> None:
        """Write text that may hold plain spaces."""
        if " " not in text:
            self._emit(text)
            return
        for i, word in enumerate(text.split(" ")):
            if i:
                self._pending_space = 2
            if word:
                self._emit(word)

    def _emit_fragment(self, raw: str) -> None:
        """Write a complete inline fragment (link text, table cell) cleaned."""
        sub = SpeechCleaner(is_inline_only=True)
        sub._prev_raw = self._prev_raw
        text = sub.feed(raw) + sub._run(final=True)
        if text:
            self._emit_text(text)

    def _gap(self, strength: int) -> None:
        self._pending_space = max(self._pending_space, strength)

    def _block_break(self) -> None:
        # Written where the block ends, not before the next block's first word: the
        # segmenter cuts at a blank line at once, while the next line's syntax ("1." or
        # "- " then its text) is still held (docs/segmenter.md, "Boundaries").
        if self._prev_out and not self._is_break_out:
            self._out.append(BREAK)
            self._is_break_out = True

    # -- the reading loop -----------------------------------------------------

    def _hold(self, pos: int, at: int, waits: re.Pattern[str] | None, limit: int) -> int | None:
        """Hold the text from `pos`: None, a reader's answer for "not decided yet". It stays
        undecided while what follows matches `waits` and the text from `at` is at most `limit`
        long, so `feed` need not read it again until then."""
        self._waits_for = waits
        self._hold_limit = at - pos + limit
        return None

    def _run(self, final: bool) -> str:
        raw = self._raw
        self.num_examined += len(raw)
        self._waits_for = None
        pos = 0
        while pos < len(raw):
            if self._fence is not None:
                step = self._read_fence_line(raw, pos, final)
            elif self._line_of is not None:
                step = self._read_line_rest(raw, pos)
            elif self._is_line_start:
                step = self._read_line_start(raw, pos, final)
            else:
                step = self._read_inline(raw, pos, final)
            if step is None:
                break
            if step > pos:
                self._prev_raw = raw[step - 1]
            pos = step
        if final:  # the text ends here: a run still open is judged, a dropped one ends
            self._end_delimiters(" ")
            self._is_dropping_ticks = False
        self._raw = raw[pos:]
        out = "".join(self._out)
        self._out.clear()
        return out

    def _read_inline(self, raw: str, pos: int, final: bool) -> int | None:
        if self._delimiters is not None:  # a run read up to the end of the text before
            if raw[pos] == self._delimiters[0]:
                return self._read_delimiter_run(raw, pos, final)
            self._end_delimiters(raw[pos])
        if self._is_dropping_ticks and raw[pos] != "`":
            self._is_dropping_ticks = False
        plain = _PLAIN.match(raw, pos)
        if plain:
            self._emit_text(plain.group())
            return plain.end()
        char = raw[pos]
        if char == "\n":
            if self._is_heading_line:
                self._block_break()
                self._is_heading_line = False
            else:
                self._is_newline_pending = True
            self._is_line_start = not self._is_inline_only
            if self._is_inline_only:
                self._gap(2)
            return pos + 1
        if char in "*_~":
            return self._read_delimiter_run(raw, pos, final)
        if char == "`":
            return self._read_code_span(raw, pos, final)
        if char in "[!":
            return self._read_link(raw, pos, final)
        spaces = _SPACES_RE.match(raw, pos)
        if spaces:
            self._gap(2)
            return spaces.end()
        gap = _GAP_RE.match(raw, pos)
        if gap:
            self._gap(1)
            return gap.end()
        silent = _SILENT_RE.match(raw, pos)
        assert silent is not None, f"expected a character class for {char!r}"
        return silent.end()

    def _read_delimiter_run(self, raw: str, pos: int, final: bool) -> int:
        """Emphasis and strike-through markers go; `2*3`, `a * b` and `snake_case` stay.

        The run is read as it comes: one that reaches the end of the text so far is kept
        as (char, count, the character before it) until the character after it arrives.
        """
        char = raw[pos]
        run = _RUN_OF[char].match(raw, pos)
        assert run is not None
        end = run.end()
        count, before = end - pos, self._prev_raw
        if self._delimiters is not None:  # the same run, begun in the text before
            count, before = count + self._delimiters[1], self._delimiters[2]
            self._delimiters = None
        if end == len(raw) and not final:
            self._delimiters = (char, count, before)
            return end
        self._judge_delimiters(char, count, before, raw[end] if end < len(raw) else " ")
        return end

    def _end_delimiters(self, after: str) -> None:
        """Judge a run held at the end of the text before, now that `after` follows it."""
        if self._delimiters is not None:
            char, count, before = self._delimiters
            self._delimiters = None
            self._judge_delimiters(char, count, before, after)

    def _judge_delimiters(self, char: str, count: int, before: str, after: str) -> None:
        if char == "*":
            is_kept = count == 1 and ((before.isspace() and after.isspace())
                                      or (before.isdigit() and after.isdigit()))
        elif char == "_":
            is_kept = before.isalnum() and after.isalnum()
        else:
            is_kept = count == 1
        if is_kept:
            self._emit(char * count)

    def _read_code_span(self, raw: str, pos: int, final: bool) -> int | None:
        """CommonMark code spans (on one line); their text is spoken, marked unbreakable."""
        run = _BACKTICKS.match(raw, pos)
        assert run is not None
        start = run.end()
        size = start - pos
        if self._is_dropping_ticks or size > MAX_CODE_SPAN:
            # No closing run of its size fits in the window: dropped, also as it goes on.
            self._is_dropping_ticks = start == len(raw) and not final
            return start
        if start == len(raw) and not final:
            return self._hold(pos, pos, _RUN_OF["`"], MAX_CODE_SPAN)
        window_end = min(len(raw), start + MAX_CODE_SPAN)
        newline = raw.find("\n", start, window_end)
        search_end = window_end if newline < 0 else newline
        for closing in _BACKTICKS.finditer(raw, start, search_end):
            if closing.end() == len(raw) and not final:
                return None
            if closing.end() - closing.start() == size:
                text = " ".join(raw[start:closing.start()].replace("`", " ").split())
                text = " ".join(_SILENT_RE.sub("", _GAP_RE.sub(" ", text)).split())
                if text:
                    self._emit_text(CODE_OPEN + text + CODE_CLOSE)
                return closing.end()
        if newline < 0 and window_end < start + MAX_CODE_SPAN and not final:
            return self._hold(pos, start, _CODE_SPAN_TEXT, MAX_CODE_SPAN - 1)
        return start  # an unmatched run of backticks is dropped

    def _read_link(self, raw: str, pos: int, final: bool) -> int | None:
        """`[text](url)` reads as its text; `![alt](url)` images are skipped."""
        is_image = raw[pos] == "!"
        bracket = pos + 1 if is_image else pos
        if is_image:
            if bracket == len(raw):
                return None if not final else self._literal(raw, pos)
            if raw[bracket] != "[":
                return self._literal(raw, pos)
        close = bracket + 1
        while close < len(raw) and close - bracket <= MAX_LINK_TEXT and raw[close] not in "[]\n":
            close += 1
        if close == len(raw):
            return self._hold(pos, bracket, _LINK_TEXT, MAX_LINK_TEXT + 1) if not final else (
                self._literal(raw, pos))
        if raw[close] != "]" or close - bracket > MAX_LINK_TEXT:
            return self._literal(raw, pos)
        if close + 1 == len(raw):
            return None if not final else self._literal(raw, pos)
        if raw[close + 1] != "(":
            return self._literal(raw, pos)
        end = close + 2
        while end < len(raw) and end - close <= MAX_LINK_URL and raw[end] not in "()\n\t ":
            end += 1
        if end == len(raw):
            return self._hold(pos, close, _LINK_URL, MAX_LINK_URL + 1) if not final else (
                self._literal(raw, pos))
        if raw[end] != ")":
            return self._literal(raw, pos)
        if is_image:
            self._gap(1)
        else:
            self._emit_fragment(raw[bracket + 1:close])
        return end + 1

    def _literal(self, raw: str, pos: int) -> int:
        self._emit(raw[pos])
        return pos + 1
