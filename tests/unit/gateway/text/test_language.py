"""Language by script: detection, the voice's scripts, and cutting out what a voice cannot say."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text.language import (
    JAPANESE,
    LATIN,
    Piece,
    cut,
    detect,
    dominant_script,
    language_of_script,
    primary_subtag,
    runs_of,
    scripts_of,
    spoken_text,
)

ENGLISH = scripts_of(["en"])
CHINESE = scripts_of(["zh"])

# Fragments where scripts meet: names inside sentences, CJK punctuation, digits, marks.
FRAGMENTS = ["Hello", " ", "world", ".", "王小明", "你好", "，", "。", "「", "」", "Привет", "мир",
             "Καλημέρα", "さん", "東京", "안녕", "שלום", "مرحبا", "नमस्ते", "ไทย", "2024", "年", "!",
             "é", "e\u0301", "々", "\u3000", "（", "）", "iPhone", "'s", "—", "🎉", "\n", "ー"]
mixed_text = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)
any_scripts = st.frozensets(st.sampled_from(["Latn", "Hani", "Cyrl", "Grek", JAPANESE, "Hang",
                                             "Hebr", "Arab", "Deva", "Thai"]))


def test_english_is_latin_and_undetermined() -> None:
    assert detect("The capital of France is Paris.") == "und-Latn"


@pytest.mark.parametrize(("text", "language"), [
    ("今天天气很好。", "zh"),
    ("田中さんは東京に住んでいます。", "ja"),
    ("カタカナ", "ja"),
    ("안녕하세요, 세계!", "ko"),
    ("Καλημέρα κόσμε", "el"),
    ("שלום עולם", "he"),
    ("สวัสดีครับ", "th"),
    ("Привет, мир!", "und-Cyrl"),
    ("مرحبا بالعالم", "und-Arab"),
    ("नमस्ते दुनिया", "und-Deva"),
])
def test_a_script_of_one_language_names_it_and_a_shared_script_stays_undetermined(
        text: str, language: str) -> None:
    assert detect(text) == language


def test_digits_punctuation_and_emoji_have_no_language() -> None:
    assert detect("42, 3.14 — 🎉!") is None
    assert runs_of("(2024) ... 100%") == []


def test_an_english_sentence_with_a_chinese_name_is_still_latin() -> None:
    assert dominant_script(runs_of("My friend 王小明 said hello to everyone.")) == LATIN


def test_han_weighs_three_latin_letters_so_a_chinese_sentence_with_a_brand_is_chinese() -> None:
    assert detect("我喜欢用iPhone手机") == "zh"


def test_a_tie_goes_to_the_script_the_voice_speaks() -> None:
    runs = runs_of("abc 中")  # 3 Latin letters, one Han character of weight 3
    assert dominant_script(runs, ENGLISH) == LATIN
    assert dominant_script(runs, CHINESE) == "Hani"


def test_arabic_digits_and_devanagari_danda_count_for_no_script() -> None:
    assert runs_of("١٢٣") == []
    assert runs_of("।") == []


def test_voices_speak_the_scripts_their_languages_are_written_in() -> None:
    assert scripts_of(["en-US"]) == {"Latn"}
    assert scripts_of(["zh"]) == {"Hani"}
    assert "Hani" in scripts_of(["ja"]) and JAPANESE in scripts_of(["ja"])
    assert scripts_of(["ru"]) == {"Cyrl"}
    assert scripts_of(["sr"]) == {"Cyrl", "Latn"}
    assert scripts_of(["und-Cyrl"]) == {"Cyrl"}
    assert scripts_of(["sw"]) == {"Latn"}  # a language not in the table is written in Latin


def test_primary_subtags_are_lower_case_and_keep_an_undetermined_script() -> None:
    assert primary_subtag("en_US") == "en"
    assert primary_subtag("ZH-cn") == "zh"
    assert primary_subtag("und-cyrl") == "und-Cyrl"


def test_language_of_a_script() -> None:
    assert language_of_script("Hani") == "zh"
    assert language_of_script(JAPANESE) == "ja"
    assert language_of_script("Cyrl") == "und-Cyrl"


def test_a_chinese_name_is_cut_out_of_an_english_sentence() -> None:
    text = "My friend 王小明 said hi."
    pieces = cut(text, runs_of(text), ENGLISH)
    assert pieces == [Piece("My friend "), Piece("王小明", "zh"), Piece(" said hi.")]
    assert spoken_text(pieces) == "My friend said hi."


def test_cjk_punctuation_goes_with_the_skipped_run() -> None:
    text = "He said 「你好，世界。」 and left."
    pieces = cut(text, runs_of(text), ENGLISH)
    assert [p for p in pieces if p.is_skipped] == [Piece("「你好，世界。」", "zh")]
    assert spoken_text(pieces) == "He said and left."


def test_a_japanese_name_with_kana_is_one_japanese_piece() -> None:
    text = "Ask 田中さん today."
    skipped = [p for p in cut(text, runs_of(text), ENGLISH) if p.is_skipped]
    assert skipped == [Piece("田中さん", "ja")]


def test_runs_of_two_languages_are_separate_pieces() -> None:
    text = "A Привет B 你好 C"
    skipped = [p for p in cut(text, runs_of(text), ENGLISH) if p.is_skipped]
    assert skipped == [Piece("Привет", "und-Cyrl"), Piece("你好", "zh")]


def test_text_a_voice_can_say_is_one_spoken_piece() -> None:
    text = "Nothing to cut here, 42 times."
    assert cut(text, runs_of(text), ENGLISH) == [Piece(text)]


def test_spoken_words_are_the_spoken_pieces_words_in_order() -> None:
    text = "the王小明's book"
    pieces = cut(text, runs_of(text), ENGLISH)
    assert spoken_text(pieces).split() == ["the", "'s", "book"]


@given(mixed_text, any_scripts)
@settings(max_examples=400, deadline=None)
def test_pieces_rejoin_to_the_input_for_any_text(text: str, speakable: frozenset[str]) -> None:
    pieces = cut(text, runs_of(text), speakable)
    assert "".join(p.text for p in pieces) == text
    assert all(p.text for p in pieces)


@given(mixed_text, any_scripts)
@settings(max_examples=400, deadline=None)
def test_skipped_pieces_hold_no_letter_the_voice_can_say(text: str,
                                                         speakable: frozenset[str]) -> None:
    pieces = cut(text, runs_of(text), speakable)
    offset = 0
    spans = []
    for piece in pieces:
        if piece.is_skipped:
            spans.append((offset, offset + len(piece.text)))
        offset += len(piece.text)
    for run in runs_of(text):
        if run.script in speakable:
            assert not any(lo < run.end and run.start < hi for lo, hi in spans), (text, run)
        else:
            assert any(lo <= run.start and run.end <= hi for lo, hi in spans), (text, run)


@given(st.text(max_size=80), any_scripts)
@settings(max_examples=300, deadline=None)
def test_any_unicode_text_rejoins_and_speaks_only_spoken_words(text: str,
                                                               speakable: frozenset[str]) -> None:
    pieces = cut(text, runs_of(text), speakable)
    assert "".join(p.text for p in pieces) == text
    assert spoken_text(pieces).split() == [w for p in pieces if not p.is_skipped
                                           for w in p.text.split()]
