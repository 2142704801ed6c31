"""Routing a segment: stays on its voice, goes to the mapped voice, or is skipped."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text.language import Piece
from gateway.text.routing import (
    VoiceScripts,
    normalize_voice_for,
    parse_voice_for,
    route,
)
from tests.unit.gateway.text.test_language import mixed_text

LANGUAGES = {"joe": ("en",), "mei": ("zh",), "ivan": ("ru",), "any": (), "cosy": ("zh", "en", "ja")}
scripts = VoiceScripts(lambda voice: LANGUAGES.get(voice))


def test_an_english_segment_stays_on_the_english_voice_whole() -> None:
    result = route("The capital of France is Paris.", "joe", {}, scripts)
    assert result.voice == "joe" and result.pieces == (Piece("The capital of France is Paris."),)
    assert result.text == "The capital of France is Paris." and result.skipped == ()


def test_a_chinese_segment_without_a_mapped_voice_is_skipped_whole() -> None:
    result = route("今天天气很好。", "joe", {}, scripts)
    assert result.voice == "joe" and result.text == ""
    assert result.skipped == (Piece("今天天气很好。", "zh"),) and result.language == "zh"


def test_a_chinese_segment_goes_to_the_voice_mapped_for_chinese() -> None:
    result = route("今天天气很好。", "joe", {"zh": "mei"}, scripts)
    assert result.voice == "mei" and result.text == "今天天气很好。" and result.skipped == ()


def test_the_mapped_voice_also_cuts_what_it_cannot_say() -> None:
    result = route("我们用Python写了这个程序。", "joe", {"zh": "mei"}, scripts)
    assert result.voice == "mei"
    assert result.skipped == (Piece("Python", "und-Latn"),)
    assert result.text == "我们用 写了这个程序。"


def test_a_chinese_name_in_an_english_sentence_stays_english_and_is_cut_out() -> None:
    result = route("I met 王小明 at the station yesterday.", "joe", {"zh": "mei"}, scripts)
    assert result.voice == "joe"
    assert result.skipped == (Piece("王小明", "zh"),)
    assert result.text == "I met at the station yesterday."


def test_a_cyrillic_segment_is_undetermined_and_skipped_without_a_voice_for_it() -> None:
    result = route("Привет, как дела?", "joe", {"zh": "mei"}, scripts)
    assert result.skipped == (Piece("Привет, как дела?", "und-Cyrl"),)


def test_an_undetermined_segment_takes_a_voice_mapped_for_a_language_of_its_script() -> None:
    assert route("Привет, как дела?", "joe", {"ru": "ivan"}, scripts).voice == "ivan"
    assert route("Привет, как дела?", "joe", {"und-Cyrl": "ivan"}, scripts).voice == "ivan"


def test_a_mapped_voice_that_cannot_speak_the_script_is_not_used() -> None:
    result = route("今天天气很好。", "joe", {"zh": "ivan"}, scripts)
    assert result.voice == "joe" and result.text == ""


def test_a_multilingual_voice_keeps_every_segment_it_can_speak() -> None:
    for text in ("Hello there.", "今天天气很好。", "田中さんは東京に住んでいます。"):
        result = route(text, "cosy", {"zh": "mei"}, scripts)
        assert result.voice == "cosy" and result.text == text


def test_a_voice_without_declared_languages_speaks_everything() -> None:
    result = route("今天天气很好。", "any", {}, scripts)
    assert result.voice == "any" and result.text == "今天天气很好。"


def test_digits_and_punctuation_stay_on_the_voice() -> None:
    assert route("42.", "mei", {}, scripts).text == "42."


def test_voice_for_keys_are_normalized_and_checked() -> None:
    assert normalize_voice_for({"zh-CN": "mei", "und-cyrl": "ivan"}) == {
        "zh": "mei", "und-Cyrl": "ivan"}
    with pytest.raises(ValueError, match="language tags"):
        normalize_voice_for({"chinese!": "mei"})
    with pytest.raises(ValueError, match="voice id"):
        normalize_voice_for({"zh": ""})
    with pytest.raises(ValueError, match="at most"):
        normalize_voice_for({f"l{chr(97 + i // 26)}{chr(97 + i % 26)}": "v" for i in range(40)})


def test_voice_for_flags_parse_language_equals_voice() -> None:
    assert parse_voice_for(["zh=mei", " ru = ivan "]) == {"zh": "mei", "ru": "ivan"}
    with pytest.raises(ValueError, match="LANGUAGE=VOICE"):
        parse_voice_for(["zh"])


def test_voice_scripts_are_read_again_after_forget() -> None:
    languages = {"v": ("en",)}
    cached = VoiceScripts(lambda voice: languages.get(voice))
    assert cached("v") == {"Latn"}
    languages["v"] = ("zh",)
    assert cached("v") == {"Latn"}
    cached.forget()
    assert cached("v") == {"Hani"}


@given(mixed_text, st.sampled_from(sorted(LANGUAGES)),
       st.dictionaries(st.sampled_from(["zh", "ru", "ja", "und-Grek"]),
                       st.sampled_from(sorted(LANGUAGES))))
@settings(max_examples=300, deadline=None)
def test_a_route_rejoins_to_its_segment(text: str, voice: str, voice_for: dict[str, str]) -> None:
    result = route(text, voice, voice_for, scripts)
    assert "".join(p.text for p in result.pieces) == text
    assert result.voice == voice or result.voice in voice_for.values()
