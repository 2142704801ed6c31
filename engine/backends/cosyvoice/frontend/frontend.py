"""The CosyVoice text and voice frontend: token ids, prompt layout, registered voices.

A voice is registered once (reference audio + its transcript): the speaker
embedding (CAM++ on Kaldi fbank), the prompt speech tokens (the speech
tokenizer on Whisper log mel) and the prompt text ids are computed then and
kept in a `VoicePrompt`; requests only tokenize their own text.

What the LM sees per mode (upstream cli/frontend.py and example.py):

    mode           prompt text ids                         prompt speech tokens
    zero_shot      v2: transcript                          the voice's
                   v3: SYSTEM + <|endofprompt|> + transcript
    cross_lingual  none; v3 puts SYSTEM + <|endofprompt|>  none
                   before the text instead
    instruct       v2: instruction + <|endofprompt|>        none
                   v3: SYSTEM + " " + instruction + <|endofprompt|>

SYSTEM is "You are a helpful assistant." The flow always gets the voice's
speech tokens, mel and embedding.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from engine.backends.cosyvoice.config import TOKENIZER_MODES
from engine.backends.cosyvoice.frontend.textnorm import PlainText, TextNormalizer
from engine.backends.cosyvoice.frontend.tokens import (
    END_OF_PROMPT,
    SPECIAL_TOKENS_V2,
    SPECIAL_TOKENS_V3,
    added_token_id,
)
from engine.backends.cosyvoice.model_dir import ModelDir
from engine.backends.cosyvoice.models.features import (
    FBANK_RATE,
    kaldi_fbank,
    resample,
    whisper_log_mel,
)
from engine.errors import ModelLoadError

SYSTEM_PROMPT = "You are a helpful assistant."
MAX_SPEECH_TOKENIZER_S = 30.0  # upstream refuses longer reference audio
EMBEDDING_DIM = 192
# Qwen2's own special tokens, before the ones CosyVoice adds (tokens.py).
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


class Mode(enum.Enum):
    ZERO_SHOT = "zero_shot"
    CROSS_LINGUAL = "cross_lingual"
    INSTRUCT = "instruct"


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class HFTokenizer:
    """The Qwen2 tokenizer of CosyVoice-BlankEN with upstream's added special tokens."""

    def __init__(self, model_dir: ModelDir) -> None:
        try:
            from transformers import AutoTokenizer  # optional dependency
        except ImportError as exc:
            raise ModelLoadError(
                "expected the transformers package to read the CosyVoice tokenizer, got none "
                "installed (pip install transformers, or pass token ids)"
            ) from exc
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir.qwen_path))
        specials = SPECIAL_TOKENS_V2 if model_dir.version == 2 else SPECIAL_TOKENS_V3
        self.tokenizer.add_special_tokens(
            {
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "additional_special_tokens": list(specials),
            }
        )

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text)["input_ids"]]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are keyed by."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ByteTokenizer:
    """Every UTF-8 byte as its own token, no merges; upstream's special tokens at their ids.

    FOR TESTS AND SMOKE RUNS ONLY (`tokenizer="bytes"`): the ids are real
    Qwen2 ids (the single-byte tokens of the vocabulary: ids 0-255 in GPT-2's
    byte order, or as `vocab.json` lists them), so a model reads them, but a
    trained model was never shown text split this way and speaks it badly.
    Real use needs the directory's tokenizer files and `transformers`.
    """

    def __init__(self, version: int, vocab: dict[str, int] | None = None) -> None:
        table = byte_to_unicode()
        if vocab is None:  # GPT-2 order: the printable bytes first, then the rest
            order = sorted(range(256), key=lambda b: (ord(table[b]) >= 256, ord(table[b])))
            self._ids = {b: i for i, b in enumerate(order)}
        else:
            missing = [b for b in range(256) if table[b] not in vocab]
            if missing:
                raise ModelLoadError(
                    f"vocab.json: expected all 256 single-byte tokens, got {len(missing)} missing"
                )
            self._ids = {b: int(vocab[table[b]]) for b in range(256)}
        specials = SPECIAL_TOKENS_V2 if version == 2 else SPECIAL_TOKENS_V3
        self._special_ids = {t: added_token_id(t, version) for t in specials
                             if t not in QWEN_SPECIALS}
        self._special_ids.update(QWEN_SPECIALS)
        names = sorted(self._special_ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in names) + ")")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self._special_ids:
                ids.append(self._special_ids[part])
            else:
                ids.extend(self._ids[b] for b in part.encode("utf-8"))
        return ids


def load_tokenizer(model_dir: ModelDir, mode: str = "auto") -> TextTokenizer | None:
    """The directory's text tokenizer.

    "hf": the directory's tokenizer files through transformers (errors say what
    is missing); "bytes": `ByteTokenizer` (tests only), byte ids read from
    `vocab.json` when the directory has one; "auto": "hf" where it can load,
    else None (text must then come as token ids).
    """
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"expected tokenizer one of {TOKENIZER_MODES}, got {mode!r}")
    if mode == "bytes":
        vocab_path = model_dir.qwen_path / "vocab.json"
        vocab = json.loads(vocab_path.read_text(encoding="utf-8")) if vocab_path.is_file() else None
        return ByteTokenizer(model_dir.version, vocab)
    if not model_dir.has_tokenizer_files:
        if mode == "hf":
            raise ModelLoadError(
                f"{model_dir.qwen_path}: expected tokenizer files (tokenizer.json or vocab.json), "
                "got none"
            )
        return None
    try:
        return HFTokenizer(model_dir)
    except ModelLoadError:
        if mode == "hf":
            raise
        return None


@dataclass(slots=True)
class VoicePrompt:
    """A registered voice, computed once: what every request with this voice reuses.

    `prompt_text_ids` is the LM's zero-shot prompt text (v3: with the system
    prefix and `<|endofprompt|>`); `prompt_speech_tokens` the reference audio's
    speech tokens (LM prompt and flow prompt); `embedding` [192] the CAM++
    speaker embedding (flow only); `prompt_mel` [T, 80] the 24 kHz mel of the
    reference for the flow, filled by the flow code.
    """

    version: int
    prompt_text: str
    prompt_text_ids: list[int]
    prompt_speech_tokens: list[int]
    embedding: np.ndarray
    prompt_mel: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.embedding.shape != (EMBEDDING_DIM,):
            raise ValueError(f"expected a ({EMBEDDING_DIM},) embedding, got {self.embedding.shape}")


@dataclass(slots=True)
class LMInput:
    """What `SpeechLMRunner.add_request` takes.

    `num_prefix_ids`: leading ids of `text_ids` that only a sequence's start needs
    (v3 cross-lingual: the system prompt and <|endofprompt|>); a segment that
    continues its context's sequence (lm/runner.py) feeds the text after them.
    """

    text_ids: list[int]
    prompt_text_ids: list[int]
    prompt_speech_tokens: list[int]
    num_prefix_ids: int = 0


def _onnx_session(path: Any) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    return onnxruntime.InferenceSession(str(path), sess_options=options, providers=providers)


class CosyVoiceFrontend:
    """Tokenizer, speaker model and speech tokenizer of one model directory."""

    def __init__(self, model_dir: ModelDir, tokenizer: TextTokenizer | None = None,
                 normalizer: TextNormalizer | None = None) -> None:
        self.model_dir = model_dir
        self.version = model_dir.version
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        self.normalizer = normalizer if normalizer is not None else PlainText()
        self._campplus: Any = None
        self._speech_tokenizer: Any = None

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ModelLoadError(
                f"{self.model_dir.qwen_path}: expected tokenizer files (tokenizer.json or "
                "vocab.json) and the transformers package to tokenize text, got neither usable; "
                "pass token ids instead"
            )
        return self.tokenizer.encode(text)

    def _session(self, attr: str, path: Any, purpose: str) -> Any:
        if getattr(self, attr) is None:
            if not path.is_file():
                raise ModelLoadError(
                    f"{self.model_dir.path}: expected file {path.name} ({purpose}), got none"
                )
            setattr(self, attr, _onnx_session(path))
        return getattr(self, attr)

    def speaker_embedding(self, wav16k: np.ndarray) -> np.ndarray:
        """Reference audio at 16 kHz -> the CAM++ embedding [192]."""
        session = self._session("_campplus", self.model_dir.campplus_path, "speaker embedding")
        feat = kaldi_fbank(torch.from_numpy(np.asarray(wav16k, dtype=np.float32)))  # [T, 80]
        feat = feat - feat.mean(dim=0, keepdim=True)
        (out,) = session.run(None, {session.get_inputs()[0].name: feat[None].numpy()})
        embedding = np.asarray(out, dtype=np.float32).reshape(-1)
        if embedding.shape != (EMBEDDING_DIM,):
            raise ModelLoadError(
                f"campplus.onnx: expected a {EMBEDDING_DIM}-d embedding, got {embedding.shape}"
            )
        return embedding

    def speech_tokens(self, wav16k: np.ndarray) -> list[int]:
        """Reference audio at 16 kHz (at most 30 s) -> speech tokens (25 per second)."""
        if len(wav16k) > MAX_SPEECH_TOKENIZER_S * FBANK_RATE:
            raise ValueError(
                f"expected reference audio of at most 30 s, got {len(wav16k) / FBANK_RATE:.1f} s"
            )
        path = self.model_dir.speech_tokenizer_path
        session = self._session("_speech_tokenizer", path, "reference audio tokens")
        feat = whisper_log_mel(torch.from_numpy(np.asarray(wav16k, dtype=np.float32)))  # [128, T]
        inputs = session.get_inputs()
        (out,) = session.run(
            None,
            {
                inputs[0].name: feat[None].numpy(),
                inputs[1].name: np.array([feat.shape[1]], dtype=np.int32),
            },
        )
        return [int(t) for t in np.asarray(out).reshape(-1)]

    def prompt_text_ids(self, transcript: str) -> list[int]:
        """The LM's zero-shot prompt text for a transcript, normalized (v3 adds the system
        prefix)."""
        transcript = self.normalizer.normalize(transcript)  # it must read as the audio sounds
        if self.version == 3 and END_OF_PROMPT not in transcript:
            transcript = f"{SYSTEM_PROMPT}{END_OF_PROMPT}{transcript}"
        return self.tokenize(transcript)

    def register_voice(self, wav: np.ndarray, sample_rate: int, transcript: str) -> VoicePrompt:
        """Everything a cloned voice needs, computed once from its reference audio."""
        wav16k = resample(wav, sample_rate, FBANK_RATE)
        return VoicePrompt(
            version=self.version,
            prompt_text=transcript,
            prompt_text_ids=self.prompt_text_ids(transcript),
            prompt_speech_tokens=self.speech_tokens(wav16k),
            embedding=self.speaker_embedding(wav16k),
        )

    def lm_input(
        self,
        text: str | list[int],
        voice: VoicePrompt,
        mode: Mode = Mode.ZERO_SHOT,
        instruction: str | list[int] | None = None,
    ) -> LMInput:
        """The LM's inputs for one segment (`text` as a string or as token ids)."""
        if voice.version != self.version:
            raise ValueError(
                f"expected a CosyVoice {self.version} voice, got one made for {voice.version}"
            )
        text_ids = (self.tokenize(self.normalizer.normalize(text)) if isinstance(text, str)
                    else list(text))
        if mode is Mode.ZERO_SHOT:
            return LMInput(text_ids, list(voice.prompt_text_ids), list(voice.prompt_speech_tokens))
        if mode is Mode.CROSS_LINGUAL:
            if self.version == 3 and isinstance(text, str) and END_OF_PROMPT not in text:
                prefix = self.tokenize(f"{SYSTEM_PROMPT}{END_OF_PROMPT}")
                return LMInput(prefix + text_ids, [], [], num_prefix_ids=len(prefix))
            return LMInput(text_ids, [], [])
        if instruction is None:
            raise ValueError("expected an instruction for instruct mode, got none")
        if isinstance(instruction, str):
            return LMInput(
                text_ids, self.tokenize(normalize_instruction(instruction, self.version)), []
            )
        return LMInput(text_ids, list(instruction), [])


def normalize_instruction(instruction: str, version: int) -> str:
    """Put a style instruction in the form the model was trained on.

    v3: "You are a helpful assistant. <instruction><|endofprompt|>", the
    instruction ending in a full stop (upstream's instruct_list); v2:
    "<instruction><|endofprompt|>".
    """
    text = instruction.strip()
    if text.endswith(END_OF_PROMPT):
        text = text[: -len(END_OF_PROMPT)].rstrip()
    if version == 3:
        if text.startswith(SYSTEM_PROMPT):
            text = text[len(SYSTEM_PROMPT) :].strip()
        if text and text[-1] not in ".!?。！？":
            text += "。" if any("\u4e00" <= ch <= "\u9fff" for ch in text) else "."
        text = f"{SYSTEM_PROMPT} {text}" if text else SYSTEM_PROMPT
    return f"{text}{END_OF_PROMPT}"
