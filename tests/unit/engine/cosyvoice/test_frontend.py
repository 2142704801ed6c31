"""The CosyVoice frontend: prompt layout per mode, voice registration, audio features."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from engine.backends.cosyvoice.frontend.frontend import (
    SYSTEM_PROMPT,
    CosyVoiceFrontend,
    Mode,
    VoicePrompt,
    normalize_instruction,
)
from engine.backends.cosyvoice.frontend.tokens import added_token_id
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.features import kaldi_fbank, resample, whisper_log_mel
from engine.errors import ModelLoadError
from tests.support.cosyvoice_parity import copy_model_dir, fixture_dir

SPECIAL = re.compile(r"(<\|[a-z_]+\|>)")


class CharTokenizer:
    """One id per character, special tokens at their real ids: enough to check layouts."""

    def __init__(self, version: int) -> None:
        self.version = version

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in SPECIAL.split(text):
            if SPECIAL.fullmatch(part):
                ids.append(added_token_id(part, self.version))
            else:
                ids.extend(ord(c) for c in part)
        return ids


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


EOP = added_token_id("<|endofprompt|>", 3)
VOICE_TOKENS = [11, 12, 13]


def make_voice(frontend: CosyVoiceFrontend, transcript: str) -> VoicePrompt:
    return VoicePrompt(
        frontend.version,
        transcript,
        frontend.prompt_text_ids(transcript),
        list(VOICE_TOKENS),
        np.zeros(192, np.float32),
    )


def test_end_of_prompt_is_id_151646_in_both_versions() -> None:
    assert added_token_id("<|endofprompt|>", 2) == added_token_id("<|endofprompt|>", 3) == 151646
    assert added_token_id("[breath]", 3) == 151647
    assert added_token_id("<|endofsystem|>", 3) == 151646 + 17


def test_v3_zero_shot_prompt_is_system_end_of_prompt_transcript_then_voice_tokens() -> None:
    frontend = CosyVoiceFrontend(load_model_dir(fixture_dir(3)), CharTokenizer(3))
    voice = make_voice(frontend, "Hi there.")
    lm_input = frontend.lm_input("Hello.", voice)
    assert lm_input.prompt_text_ids == chars(SYSTEM_PROMPT) + [EOP] + chars("Hi there.")
    assert lm_input.text_ids == chars("Hello.")
    assert lm_input.prompt_speech_tokens == VOICE_TOKENS


def test_v2_zero_shot_prompt_is_the_bare_transcript() -> None:
    frontend = CosyVoiceFrontend(load_model_dir(fixture_dir(2)), CharTokenizer(2))
    lm_input = frontend.lm_input("Hello.", make_voice(frontend, "Hi there."))
    assert lm_input.prompt_text_ids == chars("Hi there.")
    assert lm_input.prompt_speech_tokens == VOICE_TOKENS


@pytest.mark.parametrize("version", [2, 3])
def test_cross_lingual_drops_the_lm_prompt_and_v3_prefixes_the_text(version: int) -> None:
    frontend = CosyVoiceFrontend(load_model_dir(fixture_dir(version)), CharTokenizer(version))
    lm_input = frontend.lm_input("Bonjour.", make_voice(frontend, "Hi."), Mode.CROSS_LINGUAL)
    assert (lm_input.prompt_text_ids, lm_input.prompt_speech_tokens) == ([], [])
    prefix = chars(SYSTEM_PROMPT) + [EOP] if version == 3 else []
    assert lm_input.text_ids == prefix + chars("Bonjour.")


def test_instruct_mode_uses_the_normalized_instruction_without_voice_tokens() -> None:
    frontend = CosyVoiceFrontend(load_model_dir(fixture_dir(3)), CharTokenizer(3))
    lm_input = frontend.lm_input(
        "Hello.", make_voice(frontend, "Hi."), Mode.INSTRUCT, "Speak slowly"
    )
    assert lm_input.prompt_text_ids == chars(f"{SYSTEM_PROMPT} Speak slowly.") + [EOP]
    assert lm_input.prompt_speech_tokens == []
    with pytest.raises(ValueError, match="instruction"):
        frontend.lm_input("Hello.", make_voice(frontend, "Hi."), Mode.INSTRUCT)


@pytest.mark.parametrize(
    ("given", "version", "want"),
    [
        ("Speak slowly", 3, "You are a helpful assistant. Speak slowly.<|endofprompt|>"),
        ("请用广东话表达", 3, "You are a helpful assistant. 请用广东话表达。<|endofprompt|>"),
        (
            "You are a helpful assistant. 请用广东话表达。<|endofprompt|>",
            3,
            "You are a helpful assistant. 请用广东话表达。<|endofprompt|>",
        ),
        ("用四川话说这句话", 2, "用四川话说这句话<|endofprompt|>"),
    ],
)
def test_instructions_are_normalized_to_the_trained_form(
    given: str, version: int, want: str
) -> None:
    assert normalize_instruction(given, version) == want


def test_text_without_a_tokenizer_is_a_clear_error_but_token_ids_work() -> None:
    frontend = CosyVoiceFrontend(load_model_dir(fixture_dir(3)))
    assert frontend.tokenizer is None  # the fixture has no tokenizer files
    with pytest.raises(ModelLoadError, match="expected tokenizer files"):
        frontend.tokenize("Hello.")
    voice = VoicePrompt(3, "", [EOP, 5], [1, 2], np.zeros(192, np.float32))
    assert frontend.lm_input([7, 8], voice).text_ids == [7, 8]


@pytest.mark.parametrize(
    ("method", "name"),
    [("speaker_embedding", "campplus.onnx"), ("speech_tokens", "speech_tokenizer_v3.onnx")],
)
def test_missing_onnx_models_are_named_when_a_voice_needs_them(method: str, name: str) -> None:
    frontend = CosyVoiceFrontend(load_model_dir(fixture_dir(3)), CharTokenizer(3))
    with pytest.raises(ModelLoadError, match=f"expected file {re.escape(name)}"):
        getattr(frontend, method)(np.zeros(16000, np.float32))


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def write_standin_onnx(model: Path, weight: np.ndarray) -> None:
    """campplus: mean over frames @ weight; speech tokenizer: the loudest mel bin per frame."""
    _save(
        helper.make_graph(
            [
                helper.make_node("ReduceMean", ["feat"], ["mean"], axes=[1], keepdims=0),
                helper.make_node("MatMul", ["mean", "w"], ["embedding"]),
            ],
            "campplus",
            [helper.make_tensor_value_info("feat", TensorProto.FLOAT, [1, None, 80])],
            [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, 192])],
            [helper.make_tensor("w", TensorProto.FLOAT, [80, 192], weight.reshape(-1).tolist())],
        ),
        model / "campplus.onnx",
    )
    _save(
        helper.make_graph(
            [helper.make_node("ArgMax", ["feats"], ["tokens"], axis=1, keepdims=0)],
            "tokenizer",
            [
                helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, None]),
                helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
            ],
            [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, None])],
        ),
        model / "speech_tokenizer_v3.onnx",
    )


def tone(freq: float, seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_registering_a_voice_runs_both_onnx_models_once_on_16k_features(tmp_path: Path) -> None:
    model = copy_model_dir(3, tmp_path / "m")
    weight = np.random.default_rng(0).standard_normal((80, 192)).astype(np.float32)
    write_standin_onnx(model, weight)
    frontend = CosyVoiceFrontend(load_model_dir(model), CharTokenizer(3))
    voice = frontend.register_voice(tone(1000.0, 1.0, 24000), 24000, "Hi.")
    assert voice.prompt_text_ids == chars(SYSTEM_PROMPT) + [EOP] + chars("Hi.")
    # 1 s at 16 kHz: 100 Whisper frames; a 1 kHz tone peaks in Slaney mel bin 42.
    assert len(voice.prompt_speech_tokens) == 100
    assert set(voice.prompt_speech_tokens[2:-2]) == {42}
    feat = kaldi_fbank(torch.from_numpy(resample(tone(1000.0, 1.0, 24000), 24000, 16000)))
    want = ((feat - feat.mean(0)).mean(0).numpy() @ weight).astype(np.float32)
    np.testing.assert_allclose(voice.embedding, want, rtol=1e-4, atol=1e-4)
    assert voice.prompt_mel is None  # the flow code fills it


def test_kaldi_fbank_frames_and_mel_placement_follow_kaldi() -> None:
    feat = kaldi_fbank(torch.from_numpy(tone(1000.0, 1.0, 16000)))
    assert feat.shape == (1 + (16000 - 400) // 160, 80)
    # Kaldi mel(f) = 1127 ln(1 + f / 700): 1 kHz sits at bin 27 of 80 between 20 Hz and 8 kHz.
    assert int(feat[10].argmax()) == 27
    silence = kaldi_fbank(torch.zeros(800))
    assert torch.allclose(
        silence, torch.full_like(silence, float(np.log(np.finfo(np.float32).eps)))
    )


def test_whisper_log_mel_has_one_frame_per_hop_and_is_range_limited() -> None:
    mel = whisper_log_mel(torch.from_numpy(tone(3000.0, 0.5, 16000)))
    assert mel.shape == (128, 50)
    assert float(mel.max() - mel.min()) <= 2.0 + 1e-6  # 8 decades over a scale of 4


def test_resample_keeps_duration_and_pitch() -> None:
    out = resample(tone(440.0, 1.0, 24000), 24000, 16000)
    assert abs(len(out) - 16000) <= 32
    spectrum = np.abs(np.fft.rfft(out[:16000]))
    assert abs(int(spectrum.argmax()) - 440) <= 1
