"""Text normalization for CosyVoice (wetext): what the LM reads, while the gateway keeps the LLM's
text."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.cosyvoice.backend import CosyVoiceBackend
from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.frontend.frontend import (
    SYSTEM_PROMPT,
    ByteTokenizer,
    CosyVoiceFrontend,
    VoicePrompt,
)
from engine.backends.cosyvoice.frontend.textnorm import (
    PlainText,
    WeTextNormalizer,
    load_text_normalizer,
)
from engine.backends.cosyvoice.frontend.tokens import added_token_id
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.sequences import Sequence
from engine.errors import ModelLoadError
from engine.types import RequestId, SynthesisRequest
from tests.support.cosyvoice_parity import fixture_dir
from tests.unit.engine.cosyvoice.test_backend import make_backend
from tests.unit.engine.cosyvoice.test_frontend import CharTokenizer, chars

DIGITS = re.compile(r"[0-9]")


@pytest.fixture(scope="module")
def wetext() -> WeTextNormalizer:
    normalizer = load_text_normalizer("wetext")
    assert isinstance(normalizer, WeTextNormalizer)
    return normalizer


@pytest.mark.parametrize(("text", "words"), [
    ("It costs $12.50 today.", ["twelve", "dollars"]),
    ("I have 3 cats and 45% of a dog.", ["three", "forty five percent"]),
    ("Meet me at 10:30am.", ["ten thirty"]),
])
def test_english_digits_and_symbols_are_spelled_out(wetext: WeTextNormalizer, text: str,
                                                    words: list[str]) -> None:
    spoken = wetext.normalize(text)
    assert not DIGITS.search(spoken) and "$" not in spoken and "%" not in spoken
    for word in words:
        assert word in spoken.lower()


def test_chinese_uses_the_chinese_grammar_and_drops_blanks_between_ideographs(
        wetext: WeTextNormalizer) -> None:
    spoken = wetext.normalize("今天 是2024年3月5日， 气温25℃。")
    assert not DIGITS.search(spoken)
    assert "二零二四年三月五日" in spoken and "二十五" in spoken
    assert " " not in spoken


def test_text_the_grammar_fails_on_is_normalized_around_the_failing_words(
        wetext: WeTextNormalizer) -> None:
    # wetext raises an AssertionError on "+1" (found by bench/bench_textnorm.py on the load corpus)
    with pytest.raises(AssertionError):
        wetext._en.normalize("a UTC offset of +1 hours.")
    spoken = wetext.normalize("It is 15:45 where you are, given a UTC offset of +1 hours and 3 "
                              "minutes.")
    assert spoken == ("It is fifteen forty five where you are, given a UTC offset of +1 hours "
                      "and three minutes.")
    assert wetext.normalize("+1") == "+1"


def test_text_with_inline_markup_or_nothing_to_say_is_left_alone(wetext: WeTextNormalizer) -> None:
    for text in ("Wait <|breath|> 3 seconds.", "", "   "):
        assert wetext.normalize(text) == text


def test_modes_none_and_auto_and_a_missing_wetext_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(load_text_normalizer("none"), PlainText)
    assert load_text_normalizer("none").normalize("3 cats") == "3 cats"
    # installed by the test extras
    assert isinstance(load_text_normalizer("auto"), WeTextNormalizer)
    # An absent package (simulated: this machine has it installed).
    monkeypatch.setitem(sys.modules, "wetext", None)
    assert isinstance(load_text_normalizer("auto"), PlainText)
    with pytest.raises(ModelLoadError, match="expects the wetext package"):
        load_text_normalizer("wetext")
    with pytest.raises(ValueError, match="text_frontend must be one of"):
        CosyVoiceBackendConfig(text_frontend="icu")


def test_the_frontend_normalizes_the_text_and_the_transcript_but_not_the_instruction(
    wetext: WeTextNormalizer,
) -> None:
    frontend = CosyVoiceFrontend(load_model_dir(fixture_dir(3)), CharTokenizer(3), wetext)
    transcript_ids = frontend.prompt_text_ids("I paid $5.")
    assert transcript_ids == chars(SYSTEM_PROMPT) + [added_token_id("<|endofprompt|>", 3)] + chars(
        wetext.normalize("I paid $5."))
    voice = VoicePrompt(3, "I paid $5.", transcript_ids, [1, 2], np.zeros(192, np.float32))
    assert frontend.lm_input("Take 2.", voice).text_ids == chars(wetext.normalize("Take 2."))
    assert frontend.lm_input([7, 8], voice).text_ids == [7, 8]  # ids are taken as given


def _text_ids(backend: CosyVoiceBackend, text: str) -> list[int]:
    item = backend.prepare(SynthesisRequest(RequestId("norm-1"), text, "default"))
    state = item.state
    assert isinstance(state, Sequence)
    backend.release(item)
    return state.inputs.lm_input.text_ids


def test_the_backend_speaks_normalized_text_per_its_text_frontend_option(tmp_path: Path) -> None:
    tokenizer = ByteTokenizer(3)
    plain = make_backend(tmp_path, text_frontend="none")
    assert _text_ids(plain, "I have 3 cats.") == tokenizer.encode("I have 3 cats.")
    normalized = make_backend(tmp_path, text_frontend="wetext")
    assert _text_ids(normalized, "I have 3 cats.") == tokenizer.encode("I have three cats.")
    assert plain.voice_features_version != normalized.voice_features_version  # transcripts differ
