"""The segmenter: the case table, split invariance, nothing lost, the cap, time."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text.cleanup import clean_for_speech
from gateway.text.segmenter import Segmenter, SegmenterConfig, count_words, text_weight
from tests.unit.gateway.text.test_cleanup import markdown_text

CASES = [json.loads(line) for line in
         (Path(__file__).parent / "data" / "segmenter_cases.jsonl").read_text("utf-8").splitlines()]

# Fragments that meet at the hard places: abbreviations, numbers, markdown, CJK, emoji.
FRAGMENTS = [
    "Hello", "world", "Mr.", "Dr.", "e.g.", "U.S.", "etc.", "3.14", "1,000", "v2.1.3", "The", "I",
    "J.",
    "a.m.", ".", ". ", "! ", "? ", "...", "…", ", ", "; ", ": ", " - ", "—", " ", "  ", "\n",
    "\n\n",
    "- ", "* ", "1. ", "# ", "**", "*", "_", "~~", "`", "```", "```py\n", "[", "](", ")", "![", "|",
    "| a | b |\n", "---\n", "> ", "你好", "。", "，", "！", "；", "世界", "“", "”", "\"", "(", "🎉",
    "\u200d", "https://x.com/a.b", "a@b.com", "Yes", "it", "12345", "Let's", "\t", "\\", "2", "*3",
]
soup_text = st.lists(st.sampled_from(FRAGMENTS), max_size=50).map("".join)
any_text = st.one_of(soup_text, markdown_text())
configs = st.builds(SegmenterConfig, max_segment_chars=st.integers(20, 120),
                    first_segment_min_words=st.integers(1, 6),
                    first_segment_max_chars=st.integers(20, 120))


def segment(text: str, config: SegmenterConfig | None = None,
            cuts: list[int] | None = None) -> list[str]:
    """Push `text` split at `cuts`, then flush; time never advances."""
    segmenter = Segmenter(config)
    segments: list[str] = []
    prev = 0
    for cut in sorted(set(cuts or [])) + [len(text)]:
        segments += segmenter.push(text[prev:cut], 0.0)
        prev = cut
    segments += segmenter.flush(0.0)
    assert not segmenter.pending_text.strip()
    assert segmenter.num_emitted == len(segments)
    return segments


def assert_joined_equal_cleaned(segments: list[str], cleaned: str) -> None:
    """cleaned == s1 + ws + s2 + ws + ... (docs/protocol.md, "Rules the server keeps")."""
    pos = 0
    for text in segments:
        while pos < len(cleaned) and cleaned[pos] == " ":
            pos += 1
        assert cleaned.startswith(text, pos), (text, cleaned[pos:])
        pos += len(text)
    assert not cleaned[pos:].strip()


def case_config(case: dict[str, Any]) -> SegmenterConfig:
    return SegmenterConfig(**case.get("config", {}))


def test_case_table_covers_every_rule_in_both_languages() -> None:
    assert len(CASES) >= 200
    assert len({case["id"] for case in CASES}) == len(CASES)
    assert {case["lang"] for case in CASES} >= {"en", "zh", "mixed"}
    rules = {case["rule"] for case in CASES}
    assert rules >= {"sentence_end", "cjk_end", "blank_line", "list_item", "flush", "decimal",
                     "version", "time_date", "title", "abbreviation", "initials", "url", "email",
                     "code_span", "ellipsis", "joined_as_sent", "first_clause", "cap",
                     "clean_emphasis", "clean_heading", "clean_link", "clean_code_block",
                     "clean_emoji", "clean_whitespace", "mixed"}


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_case_segments_match_whole_char_by_char_and_random_deltas(case: dict[str, Any]) -> None:
    text, expected, config = case["input"], case["segments"], case_config(case)
    assert segment(text, config) == expected
    assert segment(text, config, list(range(len(text)))) == expected
    rng = random.Random(zlib.crc32(case["id"].encode()))
    for _ in range(3):
        cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(1, 12))]
        assert segment(text, config, cuts) == expected
    assert_joined_equal_cleaned(expected, clean_for_speech(text, config.code_block_text))


@settings(max_examples=200, deadline=None)
@given(configs, any_text, st.lists(st.integers(0, 400), max_size=30))
def test_segments_do_not_depend_on_delta_splits(config: SegmenterConfig, text: str,
                                                cuts: list[int]) -> None:
    whole = segment(text, config)
    assert segment(text, config, [c for c in cuts if c <= len(text)]) == whole
    assert segment(text, config, list(range(len(text)))) == whole


@settings(max_examples=200, deadline=None)
@given(configs, any_text)
def test_segments_lose_and_double_nothing_and_respect_the_cap(config: SegmenterConfig,
                                                              text: str) -> None:
    segments = segment(text, config)
    assert_joined_equal_cleaned(segments, clean_for_speech(text))
    for text_out in segments:
        assert text_out and text_out == text_out.strip()
        assert text_weight(text_out) <= config.max_segment_chars
    if segments:
        assert text_weight(segments[0]) <= config.first_segment_max_chars


def test_sentence_end_waits_for_the_next_sentence_start() -> None:
    segmenter = Segmenter()
    assert segmenter.push("It costs only 12.", 0.0) == []
    assert segmenter.push(" ", 0.0) == []
    assert segmenter.push("5", 0.0) == ["It costs only 12."]
    assert segmenter.pending_text == "5"


def test_number_continuing_after_the_dot_is_one_string() -> None:
    segmenter = Segmenter()
    assert segmenter.push("It costs 12345.", 0.0) == []
    assert segmenter.push("Let's go. Now", 0.0) == ["It costs 12345.Let's go."]


def test_first_segment_is_released_before_its_sentence_is_complete() -> None:
    segmenter = Segmenter()
    released = segmenter.push("When you reach the old station, turn", 0.0)
    assert released == ["When you reach the old station,"]
    assert segmenter.push(" left, then right, and stop", 0.0) == []
    assert segmenter.flush(0.0) == ["turn left, then right, and stop"]


def test_first_segment_waits_for_enough_words_before_a_clause_cut() -> None:
    segmenter = Segmenter(SegmenterConfig(first_segment_min_words=4))
    assert segmenter.push("Yes, well, ", 0.0) == []
    assert segmenter.push("I think so, ", 0.0) == []
    assert segmenter.push("a", 0.0) == ["Yes, well, I think so,"]


def test_cjk_full_stop_releases_without_a_space_or_capital() -> None:
    segmenter = Segmenter()
    assert segmenter.push("你好。", 0.0) == []  # a closing quote could still follow
    assert segmenter.push("我", 0.0) == ["你好。"]


def test_blank_line_releases_a_paragraph_without_punctuation() -> None:
    segmenter = Segmenter()
    assert segmenter.push("First paragraph\n\nS", 0.0) == ["First paragraph"]


@pytest.mark.parametrize("after", ["", "1", "1.", "1. ", "- ", "**", "#", "```", "|"])
def test_a_blank_line_releases_at_once_while_the_next_lines_syntax_waits(after: str) -> None:
    # "Sure! Here's how:" then a list: the sentence goes to the engine at the blank line, not
    # when the first item's text arrives, because its audio is due when "Sure!" ends.
    segmenter = Segmenter()
    assert segmenter.push("Sure! Here's how to do it:", 0.0) == ["Sure!"]
    assert segmenter.push("\n\n" + after, 0.0) == ["Here's how to do it:"]
    assert segmenter.push("x", 0.0) == []


def test_long_segment_is_cut_at_a_word_boundary_under_the_cap() -> None:
    config = SegmenterConfig(max_segment_chars=20, first_segment_max_chars=20)
    segments = segment("aaaa bbbb cccc dddd eeee ffff gggg", config)
    assert segments == ["aaaa bbbb cccc dddd", "eeee ffff gggg"]


def test_cap_counts_han_characters_as_three() -> None:
    assert text_weight("你好ab") == 8
    config = SegmenterConfig(max_segment_chars=21, first_segment_max_chars=21)
    assert segment("一二三四五六七八九十", config) == ["一二三四五六七", "八九十"]


def test_words_are_counted_with_two_han_characters_as_one() -> None:
    assert count_words("Hello big world") == 3
    assert count_words("你好世界") == 2
    assert count_words("我用Python写") == 3


def test_no_deadline_without_max_buffer_delay() -> None:
    segmenter = Segmenter()
    segmenter.push("waiting for more", 1.0)
    assert segmenter.next_deadline() is None
    assert segmenter.poll(100.0) == []


def test_idle_text_is_released_after_max_buffer_delay() -> None:
    segmenter = Segmenter(SegmenterConfig(max_buffer_delay_ms=500))
    assert segmenter.push("Hello there my", 10.0) == []
    assert segmenter.push(" friend", 10.2) == []
    assert segmenter.next_deadline() == pytest.approx(10.7)
    assert segmenter.poll(10.69) == []
    assert segmenter.poll(10.7) == ["Hello there my friend"]
    assert segmenter.next_deadline() is None
    assert segmenter.push(", and more. Yes", 11.0) == [", and more."]


def test_idle_release_includes_text_the_cleaner_was_holding() -> None:
    segmenter = Segmenter(SegmenterConfig(max_buffer_delay_ms=100))
    assert segmenter.push("Read [the docs", 0.0) == []
    assert segmenter.pending_text == "Read [the docs"
    assert segmenter.poll(0.1) == ["Read [the docs"]


def test_a_short_opener_is_spoken_at_once_and_the_next_clause_follows_before_it_runs_out() -> None:
    segmenter = Segmenter()
    assert segmenter.push("Sure! Here is", 0.0) == ["Sure!"]
    # Under 4 words spoken so far: the next segment may still end at a clause...
    assert segmenter.push(" the short version, in two parts. Then", 0.0) == [
        "Here is the short version,", "in two parts."]
    # ...and once the context has spoken 4 words, segments are whole sentences.
    assert segmenter.push(" more, and more. Ok. Fine. Next", 0.0) == ["Then more, and more.",
                                                                      "Ok.", "Fine."]
    assert segmenter.num_words_emitted == 1 + 5 + 3 + 4 + 1 + 1


def test_flush_releases_everything_and_empties_the_buffer() -> None:
    segmenter = Segmenter()
    assert segmenter.push("One two three four. Two is **unfinish", 0.0) == ["One two three four."]
    assert segmenter.flush(0.0) == ["Two is unfinish"]
    assert segmenter.pending_text == ""
    assert segmenter.num_emitted == 2


def test_clear_drops_buffered_text() -> None:
    segmenter = Segmenter(SegmenterConfig(max_buffer_delay_ms=100))
    segmenter.push("Some text that will never be spoken", 0.0)
    segmenter.clear()
    assert segmenter.pending_text == ""
    assert segmenter.next_deadline() is None
    assert segmenter.flush(0.0) == []


def test_pending_text_is_the_cleaned_unreleased_text() -> None:
    segmenter = Segmenter()
    segmenter.push("Say **hello** to", 0.0)
    assert segmenter.pending_text == "Say hello to"


def test_code_block_text_is_spoken_in_place_of_the_block() -> None:
    config = SegmenterConfig(code_block_text="Code omitted.")
    assert segment("Run:\n```\nls\n```\nDone.", config) == ["Run:", "Code omitted.", "Done."]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_segment_chars", 5, "max_segment_chars must be >= 20, got 5"),
    ("first_segment_max_chars", 0, "first_segment_max_chars must be >= 20, got 0"),
    ("first_segment_min_words", 0, "first_segment_min_words must be >= 1, got 0"),
    ("max_buffer_delay_ms", -1, "max_buffer_delay_ms must be >= 0, got -1"),
])
def test_config_rejects_out_of_range_values(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SegmenterConfig(**{field: value})  # type: ignore[arg-type]


def test_config_rejects_wrong_types() -> None:
    with pytest.raises(TypeError, match="max_segment_chars must be an int, got str"):
        SegmenterConfig(max_segment_chars="300")  # type: ignore[arg-type]
