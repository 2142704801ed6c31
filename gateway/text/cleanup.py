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

The module is a little past the ~400 lines the style asks for: it is one
incremental scanner, and its readers of markdown constructs share the
scanner's state (position, open markers, pending raw text), which a split by
construct would have to pass between modules.
"""

from __future__ import annotations

import re

BREAK = "\n"
CODE_OPEN = "\x02"
CODE_CLOSE = "\x03"
MARKS = BREAK + CODE_OPEN + CODE_CLOSE

MAX_CODE_SPAN = 200  # a backtick not closed within this many chars (or the line) is dropped
MAX_LINK_TEXT = 300
MAX_LINK_URL = 2000
MAX_TABLE_LINE = 2000

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
_INDENT = re.compile(r"[ \t]*")
_HEADING = re.compile(r"#{1,6}(?=[ \t\n])[ \t]*")
_BULLET = re.compile(r"[-*+\u2022][ \t]+")
_ORDERED = re.compile(r"(?:\*\*|__)?\d{1,9}[.)](?:\*\*|__)?[ \t]+")
_ORDERED_PREFIX = re.compile(r"(?:\*\*?|__?)?(?:\d{1,9}(?:[.)](?:\*\*?|__?)?)?)?")
_RULE_CHARS = re.compile(r"([-*_=])(?:[ \t]*\1)*[ \t]*")
_QUOTE = re.compile(r">[ \t]?")
_TABLE_SEPARATOR = re.compile(r"\s*:?-+:?\s*")

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
    return strip_marks(out)


def strip_marks(text: str) -> str:
    """Cleaner output -> plain speakable text (breaks become spaces, none between Han)."""
    text = text.replace(CODE_OPEN, "").replace(CODE_CLOSE, "")
    if BREAK not in text:
        return text
    return _BREAK_RE.sub(lambda m: m.group(1) + ("" if is_cjk(m.group(1)) and is_cjk(m.group(2)) else " "), text)


class SpeechCleaner:
    """Incremental markdown-to-speech cleaner; output depends on the text only.

    `code_block_text` is what a fenced code block is read as; "" (the
    default) skips it: the listener hears the prose, the screen shows code.
    """

    def __init__(self, code_block_text: str = "", is_inline_only: bool = False) -> None:
        self.code_block_text = code_block_text
        self._is_inline_only = is_inline_only
        self._raw = ""
        self._reset_state()

    def _reset_state(self) -> None:
        self._is_line_start = not self._is_inline_only
        self._fence: str | None = None  # the opening run while inside a code block
        self._is_fence_midline = False
        self._is_heading_line = False
        self._prev_raw = " "  # the raw character before the unread text
        self._prev_out = ""  # the last visible character written
        self._pending_space = 0  # 0 none, 1 gap left by a symbol, 2 real space
        self._is_break_pending = False
        self._is_newline_pending = False
        self._out: list[str] = []

    @property
    def pending_raw(self) -> str:
        """Input held back until the text after it decides how it reads."""
        return self._raw

    def feed(self, delta: str) -> str:
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
        if self._prev_out:
            if self._is_break_pending:
                self._out.append(BREAK)
            elif (self._pending_space and not (is_cjk(self._prev_out) and is_cjk(first))
                  and (self._pending_space == 2 or first not in _CLOSING)):
                self._out.append(" ")
        self._is_break_pending = False
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
        self._is_break_pending = True

    # -- the reading loop -----------------------------------------------------

    def _run(self, final: bool) -> str:
        raw = self._raw
        pos = 0
        while pos < len(raw):
            if self._fence is not None:
                step = self._read_fence_line(raw, pos, final)
            elif self._is_line_start:
                step = self._read_line_start(raw, pos, final)
            else:
                step = self._read_inline(raw, pos, final)
            if step is None:
                break
            if step > pos:
                self._prev_raw = raw[step - 1]
            pos = step
        self._raw = raw[pos:]
        out = "".join(self._out)
        self._out.clear()
        return out

    def _read_fence_line(self, raw: str, pos: int, final: bool) -> int | None:
        fence = self._fence
        assert fence is not None
        end = raw.find("\n", pos)
        line = raw[pos:] if end < 0 else raw[pos:end]
        if not self._is_fence_midline:
            stripped = line.strip(" ")
            is_close = (len(line) - len(line.lstrip(" ")) <= 3 and stripped.startswith(fence)
                        and stripped.strip(fence[0]) == "")
            if end < 0 and not final and (is_close or fence[0] * len(stripped) == stripped):
                return None  # may still become the closing fence
            if is_close:
                self._fence = None
                self._is_line_start = True
                self._block_break()
                return len(raw) if end < 0 else end + 1
        if end < 0:
            self._is_fence_midline = True
            return len(raw)
        self._is_fence_midline = False
        return end + 1

    def _read_line_start(self, raw: str, pos: int, final: bool) -> int | None:
        """Block syntax at the start of a line: CommonMark's block structure, simplified."""
        indent = _INDENT.match(raw, pos)
        assert indent is not None
        at = indent.end()
        if at == len(raw):
            return None if not final else len(raw)
        char = raw[at]
        rest_end = raw.find("\n", at)
        line_complete = rest_end >= 0 or final
        line = raw[at:] if rest_end < 0 else raw[at:rest_end]
        if char == "\n":  # blank line
            self._block_break()
            self._is_newline_pending = self._is_heading_line = False
            return at + 1
        if char in "`~":
            run = len(line) - len(line.lstrip(char))
            if run == len(line) and not line_complete:
                return None
            if run >= 3 and not (char == "`" and "`" in line[run:]):
                if not line_complete:
                    return None
                self._fence = char * run
                self._block_break()
                self._is_heading_line = False
                if self.code_block_text:
                    self._emit_text(self.code_block_text)
                    self._block_break()
                return len(raw) if rest_end < 0 else rest_end + 1
        if char == "#":
            if line.strip("#") == "" and len(line) <= 6 and not line_complete:
                return None
            heading = _HEADING.match(raw, at)
            if heading:
                self._start_block(heading_line=True, nested=True)
                return heading.end()
        if char in "-*_=":
            rule = _RULE_CHARS.match(line)
            if rule and rule.end() == len(line):
                if not line_complete:
                    return None
                if line.count(char) >= 3:
                    self._block_break()
                    self._is_newline_pending = self._is_heading_line = False
                    return len(raw) if rest_end < 0 else rest_end + 1
        if char in "-*+\u2022":
            if at + 1 == len(raw) and not final:
                return None
            bullet = _BULLET.match(raw, at)
            if bullet:  # the item's text may open with another block marker
                self._start_block(nested=True)
                return bullet.end()
        if char.isdigit() or char in "*_":
            prefix = _ORDERED_PREFIX.match(line)
            if prefix and prefix.end() == len(line) and not line_complete:
                return None
            ordered = _ORDERED.match(raw, at)
            if ordered:
                self._start_block(nested=True)
                return ordered.end()
        if char == ">":  # a quote: its text is read, its own blocks still count
            quote = _QUOTE.match(raw, at)
            assert quote is not None
            self._block_break()
            self._is_newline_pending = False
            return quote.end()
        if char == "|" and len(line) <= MAX_TABLE_LINE:
            if not line_complete:
                return None
            self._read_table_row(line)
            return len(raw) if rest_end < 0 else rest_end + 1
        # A paragraph line: after a soft line break it continues the paragraph.
        if self._is_newline_pending:
            self._gap(2)
        self._is_newline_pending = False
        self._is_line_start = False
        return at

    def _start_block(self, heading_line: bool = False, nested: bool = False) -> None:
        self._block_break()
        self._is_newline_pending = False
        self._is_line_start = nested
        self._is_heading_line = self._is_heading_line or heading_line

    def _read_table_row(self, line: str) -> None:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        self._block_break()
        self._is_newline_pending = self._is_heading_line = False
        if all(_TABLE_SEPARATOR.fullmatch(c) for c in cells):
            return
        is_first = True
        for cell in cells:
            if not cell:
                continue
            if not is_first:
                self._emit(",")
                self._gap(2)
            self._emit_fragment(cell)
            is_first = False
        self._block_break()

    def _read_inline(self, raw: str, pos: int, final: bool) -> int | None:
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

    def _read_delimiter_run(self, raw: str, pos: int, final: bool) -> int | None:
        """Emphasis and strike-through markers go; `2*3`, `a * b` and `snake_case` stay."""
        char = raw[pos]
        end = pos
        while end < len(raw) and raw[end] == char:
            end += 1
        if end == len(raw) and not final:
            return None
        before = self._prev_raw
        after = raw[end] if end < len(raw) else " "
        if char == "*":
            is_kept = end - pos == 1 and ((before.isspace() and after.isspace())
                                          or (before.isdigit() and after.isdigit()))
        elif char == "_":
            is_kept = before.isalnum() and after.isalnum()
        else:
            is_kept = end - pos == 1
        if is_kept:
            self._emit(raw[pos:end])
        return end

    def _read_code_span(self, raw: str, pos: int, final: bool) -> int | None:
        """CommonMark code spans (on one line); their text is spoken, marked unbreakable."""
        run = _BACKTICKS.match(raw, pos)
        assert run is not None
        start = run.end()
        if start == len(raw) and not final:
            return None
        size = start - pos
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
            return None
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
            return None if not final else self._literal(raw, pos)
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
            return None if not final else self._literal(raw, pos)
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
