"""Block syntax at the start of a line, for `SpeechCleaner` (gateway/text/cleanup.py).

`BlockReader` is the half of the cleaner that reads where a line starts:
blank lines, headings, list items, quotes, rules, tables and fenced code
(CommonMark's block structure, simplified; docs/segmenter.md). It shares the
cleaner's state and output, declared below and supplied by `SpeechCleaner`.

A line's block syntax waits for the text after it (is `---` a rule, or the
start of `---abc`?), and that wait is bounded: a rule or a fence is judged
from at most the first MAX_HELD_LINE characters of its line, a table row
from MAX_TABLE_LINE, whether or not the line has ended (`_line`). So whole
text and text in any pieces are judged alike. Past a judgement made early,
the rest of a rule or closing fence line reads its character and blanks as
nothing (`_read_line_rest`), and the rest of an opening fence line is its
info string. While a line waits, the cleaner is told what keeps it
undecided (`_hold`), so more of it costs no second reading.
"""

from __future__ import annotations

import re

MAX_HELD_LINE = 256  # a line's block syntax (rule, fence) is judged from this many chars at most
MAX_TABLE_LINE = 2000

_INDENT = re.compile(r"[ \t]*")
_HEADING = re.compile(r"#{1,6}(?=[ \t\n])[ \t]*")
_BULLET = re.compile(r"[-*+\u2022][ \t]+")
_ORDERED = re.compile(r"(?:\*\*|__)?\d{1,9}[.)](?:\*\*|__)?[ \t]+")
_ORDERED_PREFIX = re.compile(r"(?:\*\*?|__?)?(?:\d{1,9}(?:[.)](?:\*\*?|__?)?)?)?")
_RULE_CHARS = re.compile(r"([-*_=])(?:[ \t]*\1)*[ \t]*")
_QUOTE = re.compile(r">[ \t]?")
_TABLE_SEPARATOR = re.compile(r"\s*:?-+:?\s*")
# What keeps a held line undecided (see `SpeechCleaner._hold`)
_TO_LINE_END = re.compile(r"[^\n]*")
_FENCE_RUN = {c: re.compile(re.escape(c) + "*") for c in "`~"}
_RULE_REST = {c: re.compile(f"[{re.escape(c)} \t]*") for c in "-*_=`~"}
_FENCE_INFO = {"`": re.compile(r"[^\n`]*"), "~": _TO_LINE_END}
_FENCE_LINE = {c: re.compile(f"[{re.escape(c)} ]*") for c in "`~"}


def _line(raw: str, at: int, final: bool, limit: int) -> tuple[str, int, bool]:
    """The line at `at` as far as a judgement reads it: (its text up to the newline or its
    first `limit` characters, where reading goes on after it, whether it can be judged now)."""
    newline = raw.find("\n", at, at + limit)
    if newline >= 0:
        return raw[at:newline], newline + 1, True
    if len(raw) - at >= limit:
        return raw[at:at + limit], at + limit, True
    return raw[at:], len(raw), final


class BlockReader:
    """The line-start readers of `SpeechCleaner`; its state and output are declared here."""

    code_block_text: str
    _fence: str | None
    _is_fence_midline: bool
    _is_heading_line: bool
    _is_line_start: bool
    _is_newline_pending: bool
    _line_of: str | None

    def _hold(self, pos: int, at: int, waits: re.Pattern[str] | None, limit: int) -> int | None:
        raise NotImplementedError  # SpeechCleaner's

    def _block_break(self) -> None:
        raise NotImplementedError  # SpeechCleaner's

    def _gap(self, strength: int) -> None:
        raise NotImplementedError  # SpeechCleaner's

    def _emit(self, word: str) -> None:
        raise NotImplementedError  # SpeechCleaner's

    def _emit_text(self, text: str) -> None:
        raise NotImplementedError  # SpeechCleaner's

    def _emit_fragment(self, raw: str) -> None:
        raise NotImplementedError  # SpeechCleaner's

    def _read_fence_line(self, raw: str, pos: int, final: bool) -> int | None:
        fence = self._fence
        assert fence is not None
        if self._is_fence_midline:
            end = raw.find("\n", pos)
            if end < 0:
                return len(raw)
            self._is_fence_midline = False
            return end + 1
        line, after, is_judged = _line(raw, pos, final, MAX_HELD_LINE)
        stripped = line.strip(" ")
        is_close = (len(line) - len(line.lstrip(" ")) <= 3 and stripped.startswith(fence)
                    and stripped.strip(fence[0]) == "")
        if not is_judged and (is_close or fence[0] * len(stripped) == stripped):
            return self._hold(pos, pos, _FENCE_LINE[fence[0]], MAX_HELD_LINE - 1)  # may close
        is_ended = raw[after - 1] == "\n"
        if is_close:
            self._fence = None
            self._is_line_start = True
            self._block_break()
            if not is_ended:  # judged from its start: more of its character reads as nothing
                self._line_of = fence[0]
            return after
        self._is_fence_midline = not is_ended
        return after

    def _read_line_rest(self, raw: str, pos: int) -> int:
        """The rest of a rule or closing fence line judged from its first MAX_HELD_LINE
        characters: more of its character and blanks read as nothing; anything else on the
        line is read as text."""
        assert self._line_of is not None
        end = _RULE_REST[self._line_of].match(raw, pos)
        assert end is not None
        if end.end() == len(raw):
            return end.end()
        self._line_of = None
        if raw[end.end()] == "\n":
            return end.end() + 1  # the line start after it, as after a whole rule line
        self._is_line_start = False
        return end.end()

    def _read_line_start(self, raw: str, pos: int, final: bool) -> int | None:
        """Block syntax at the start of a line: CommonMark's block structure, simplified."""
        indent = _INDENT.match(raw, pos)
        assert indent is not None
        at = indent.end()
        if at == len(raw):  # indentation reads as nothing: taken now, the line judged after it
            return at
        char = raw[at]
        if char == "\n":  # blank line
            self._block_break()
            self._is_newline_pending = self._is_heading_line = False
            return at + 1
        line, after, is_judged = _line(raw, at, final, MAX_HELD_LINE)
        if char in "`~":
            run = len(line) - len(line.lstrip(char))
            if run == len(line) and not is_judged:
                return self._hold(pos, at, _FENCE_RUN[char], MAX_HELD_LINE - 1)
            if run >= 3 and not (char == "`" and "`" in line[run:]):
                if not is_judged:  # the info string, until its line ends
                    return self._hold(pos, at, _FENCE_INFO[char], MAX_HELD_LINE - 1)
                self._fence = char * run
                self._is_fence_midline = raw[after - 1] != "\n"  # the rest of it is info string
                self._block_break()
                self._is_heading_line = False
                if self.code_block_text:
                    self._emit_text(self.code_block_text)
                    self._block_break()
                return after
        if char == "#":
            if len(line) <= 6 and line.strip("#") == "" and not is_judged:
                return None
            heading = _HEADING.match(raw, at)
            if heading:
                self._start_block(heading_line=True, nested=True)
                return heading.end()
        if char in "-*_=":
            rule = _RULE_CHARS.match(line)
            if rule and rule.end() == len(line):
                if not is_judged:
                    return self._hold(pos, at, _RULE_REST[char], MAX_HELD_LINE - 1)
                if line.count(char) >= 3:
                    self._block_break()
                    self._is_newline_pending = self._is_heading_line = False
                    if raw[after - 1] != "\n":  # judged from its start: more of it is nothing
                        self._line_of = char
                    return after
        if char in "-*+\u2022":
            if at + 1 == len(raw) and not final:
                return None
            bullet = _BULLET.match(raw, at)
            if bullet:  # the item's text may open with another block marker
                self._start_block(nested=True)
                return bullet.end()
        if char.isdigit() or char in "*_":
            prefix = _ORDERED_PREFIX.match(line)
            if prefix and prefix.end() == len(line) and not is_judged:
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
        if char == "|":
            row, row_after, is_row_judged = _line(raw, at, final, MAX_TABLE_LINE + 1)
            if len(row) <= MAX_TABLE_LINE:
                if not is_row_judged:
                    return self._hold(pos, at, _TO_LINE_END, MAX_TABLE_LINE)
                self._read_table_row(row)
                return row_after
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
