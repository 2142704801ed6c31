"""Cleanup for speech: each rule, split invariance and idempotence."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text.cleanup import BREAK, CODE_CLOSE, CODE_OPEN, SpeechCleaner, clean_for_speech

WORDS = ["hello", "World", "Dr.", "e.g.", "3.14", "1,000", "v2.1.3", "a.m.", "U.S.", "The", "I",
         "你好", "世界", "中文", "Python", "great🎉", "✅done", "x_y", "2*3", "C#", "it's", "(see)",
         "“quoted”"]
WRAPS = ["{}", "{}", "{}", "**{}**", "*{}*", "_{}_", "__{}__", "~~{}~~", "`{}`", "[{}](https://x.com/a.b)",
         "![{}](i.png)", "***{}***"]
PREFIXES = ["", "", "", "- ", "* ", "+ ", "1. ", "12) ", "# ", "### ", "> ", "> - ", "  - ",
            "**1.** "]
ENDS = ["", ".", "!", "?", "…", "。", "！", "：", ",", ";", " —"]


@st.composite
def markdown_text(draw: st.DrawFn) -> str:
    """Markdown-shaped LLM output: block prefixes, wrapped words, fences, tables."""
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 9))
        if kind == 0:
            lines.append("```py\nprint('x. Y')\n```")
        elif kind == 1:
            cells = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3))
            lines.append("| " + " | ".join(cells) + " |")
        elif kind == 2:
            lines.append("")
        else:
            words = [draw(st.sampled_from(WRAPS)).format(draw(st.sampled_from(WORDS)))
                     for _ in range(draw(st.integers(1, 6)))]
            lines.append(draw(st.sampled_from(PREFIXES)) + " ".join(words)
                         + draw(st.sampled_from(ENDS)))
    return "\n".join(lines)


def clean_in_pieces(text: str, cuts: list[int]) -> str:
    cleaner = SpeechCleaner()
    out, prev = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        out.append(cleaner.feed(text[prev:cut]))
        prev = cut
    out.append(cleaner.finish())
    return "".join(out)


@pytest.mark.parametrize(("raw", "spoken"), [
    ("This is **very** important", "This is very important"),
    ("Use __bold__, _italic_ and ***both***", "Use bold, italic and both"),
    ("It is ~~wrong~~ right", "It is wrong right"),
    ("2*3 and 4 * 5 stay arithmetic", "2*3 and 4 * 5 stay arithmetic"),
    ("snake_case names stay", "snake_case names stay"),
    ("## Heading\nBody", "Heading Body"),
    ("- one\n- two\n1. three\n2) four", "one two three four"),
    ("> quoted", "quoted"),
    ("Read [the docs](https://example.com/x.html) now", "Read the docs now"),
    ("A picture ![cat](cat.png) here", "A picture here"),
    ("Keep [brackets] and (parens)", "Keep [brackets] and (parens)"),
    ("Call `os.path.join()` please", "Call os.path.join() please"),
    ("Code:\n```python\nprint(1)\n```\nDone", "Code: Done"),
    ("Party 🎉 time✅.", "Party time."),
    ("Family 👨‍👩‍👧 and flag 🇺🇸", "Family and flag"),
    ("25°C © ™", "25°C © ™"),
    ("spaces   and\ttabs\u00a0here", "spaces and tabs here"),
    ("中文 之间 没有 空格", "中文之间没有空格"),
    ("中文 English 中文", "中文 English 中文"),
    ("第一行\n第二行", "第一行第二行"),
    ("| a | b |\n|---|---|\n| 1 | 2 |", "a, b 1, 2"),
    ("above\n\n---\n\nbelow", "above below"),
])
def test_markdown_and_symbols_clean_to_speakable_text(raw: str, spoken: str) -> None:
    assert clean_for_speech(raw) == spoken


def test_code_blocks_can_be_announced_instead_of_skipped() -> None:
    text = "Here:\n```\nx = 1\n```\nDone."
    assert clean_for_speech(text, code_block_text="Code block omitted.") == (
        "Here: Code block omitted. Done.")


def test_blocks_are_separated_by_breaks_and_code_spans_are_marked() -> None:
    cleaner = SpeechCleaner()
    out = cleaner.feed("# Title\nUse `a. B` now\n\n- item") + cleaner.finish()
    assert out == f"Title{BREAK}Use {CODE_OPEN}a. B{CODE_CLOSE} now{BREAK}item"


def test_markers_split_across_deltas_clean_like_the_whole_text() -> None:
    text = "**bold** and [a link](http://x.y) and `code` and\n- item\n```\nhidden\n```\n"
    whole = clean_in_pieces(text, [])
    assert clean_in_pieces(text, list(range(len(text)))) == whole
    assert "hidden" not in whole and "*" not in whole


def test_held_back_text_is_released_by_drain_without_ending_the_text() -> None:
    cleaner = SpeechCleaner()
    assert cleaner.feed("say **") == "say"
    assert cleaner.pending_raw == "**"
    assert cleaner.drain() == ""
    assert cleaner.feed("bold** and [a") == " bold and"
    assert cleaner.drain() == " [a"


def test_unclosed_backtick_is_dropped_at_the_end_of_its_line() -> None:
    cleaner = SpeechCleaner()
    assert cleaner.feed("a lone ` tick") == "a lone"
    assert cleaner.feed("\nnext") == " tick next"


@settings(max_examples=100, deadline=None)
@given(markdown_text())
def test_cleanup_is_idempotent(text: str) -> None:
    cleaned = clean_for_speech(text)
    assert clean_for_speech(cleaned) == cleaned


@settings(max_examples=100, deadline=None)
@given(markdown_text(), st.randoms(use_true_random=False))
def test_cleanup_does_not_depend_on_delta_splits(text: str, rng: random.Random) -> None:
    cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 12))]
    assert clean_in_pieces(text, cuts) == clean_in_pieces(text, [])


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=80))
def test_cleanup_of_any_text_is_split_invariant_and_folds_whitespace(text: str) -> None:
    whole = clean_in_pieces(text, [])
    assert clean_in_pieces(text, list(range(len(text)))) == whole
    spoken = clean_for_speech(text)
    assert spoken == spoken.strip() and "  " not in spoken and "\n" not in spoken


# -- cost per delta (docs/segmenter.md, "Cost per delta") ------------------------------------------
#
# Work is counted, not timed: `num_examined` adds up the characters the cleaner reads, held
# text read again included. Before the holds were bounded and remembered, a delta on a line of
# 19,000 held characters read all of them again.

LONG_LINES = {
    "rule _": "_", "rule *": "*", "rule -": "-", "rule =": "=", "fence `": "`", "fence ~": "~",
    "indent": " ", "inline _": "word _", "inline *": "word *", "inline ~": "word ~",
    "inline `": "word `", "closing fence": "```\n`", "blank fence line": "```\n ",
    "table row": "| x", "link text": "see [x", "link url": "see [x](x", "code span": "a `x",
}


def _examined_per_delta(opening: str, held: int, num_deltas: int = 400) -> int:
    """Characters read for `num_deltas` one-character deltas once `held` of them came."""
    cleaner = SpeechCleaner()
    fill = opening[-1]
    cleaner.feed(opening)
    for _ in range(held):
        cleaner.feed(fill)
    before = cleaner.num_examined
    for _ in range(num_deltas):
        cleaner.feed(fill)
    return cleaner.num_examined - before


@pytest.mark.parametrize("opening", LONG_LINES.values(), ids=LONG_LINES.keys())
def test_the_cost_of_a_delta_stays_flat_as_a_held_line_grows(opening: str) -> None:
    early = _examined_per_delta(opening, 1_000)
    late = _examined_per_delta(opening, 19_000)
    assert late == early <= 2 * 400  # a character or two read per one-character delta


def test_a_line_long_past_its_judgement_cleans_alike_whole_and_in_pieces() -> None:
    for text in ["a\n" + "-" * 300 + " tail\nb", "```\nx\n" + "`" * 300 + "\nafter",
                 "~" * 300 + " info\nx",
                 "a snake" + "_" * 500 + "case b", "x " + "`" * 250 + "y" + "`" * 250 + " z",
                 "| " + "c " * 1100 + "|\nnext", "[" + "t" * 400 + "](u) end"]:
        whole = clean_in_pieces(text, [])
        assert clean_in_pieces(text, list(range(len(text)))) == whole, text[:20]


def test_a_rule_judged_from_its_start_drops_more_of_its_marks_and_reads_other_text() -> None:
    assert clean_for_speech("above\n" + "=" * 1000 + "\nbelow") == "above below"
    assert clean_for_speech("above\n" + "-" * 300 + " tail") == "above " + "tail"
    assert clean_for_speech("```\ncode\n" + "`" * 400 + "\nafter") == "after"  # closed
    assert clean_for_speech("a snake" + "_" * 500 + "case") == "a snake" + "_" * 500 + "case"


LONG_PIECES = ["-" * 255, "-" * 257, "_" * 260, "`" * 199, "`" * 201, "~" * 258, "=" * 300,
               " " * 300,
               "x" * 1999, "| " + "y" * 2001, "[" + "t" * 299, "](" + "u" * 2001, "*" * 3, "\n",
               "```\n", " word ", "snake_", "`code`", "|", "#"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(LONG_PIECES), max_size=8), st.randoms(use_true_random=False))
def test_cleanup_of_long_held_lines_does_not_depend_on_delta_splits(pieces: list[str],
                                                                      rng: random.Random) -> None:
    text = "".join(pieces)
    cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 40))]
    assert clean_in_pieces(text, cuts) == clean_in_pieces(text, [])
