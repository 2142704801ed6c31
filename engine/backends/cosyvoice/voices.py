"""The voices a cosyvoice backend speaks: its default voice and the registered ones.

The default voice is made at load (loader.default_voice); registered voices
come back from their stored features (`add_voice`, frontend/voice_prompts.py)
and live in the engine's `VoiceTable` (listed, retired, removed). A removed
voice's cached flow prompt goes with its last stream
(`TokenToWave.forget_voice`). `features_version` names what stored features
depend on, so features made under another model are recomputed.
"""

from __future__ import annotations

import hashlib
from typing import Any

from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.frontend.textnorm import resolve_text_frontend
from engine.backends.cosyvoice.frontend.voice_prompts import CosyVoice, flow_prompt_of, from_bytes
from engine.backends.cosyvoice.loader import LoadedModel
from engine.backends.cosyvoice.model_dir import LANGUAGES
from engine.errors import EngineError, UnknownVoiceError
from engine.types import VoiceInfo
from engine.voice_table import VoiceTable

BACKEND_NAME = "cosyvoice"
SAMPLE_RATE = 24000


class CosyVoices:
    """The default voice and the registered ones, by id."""

    def __init__(self) -> None:
        self._default: dict[str, CosyVoice] = {}
        self._registered: VoiceTable[CosyVoice] = VoiceTable()

    def set_default(self, voice: CosyVoice) -> None:
        self._default = {voice.info.voice_id: voice}

    def listed(self) -> list[VoiceInfo]:
        return [v.info for v in [*self._default.values(), *self._registered.listed()]]

    def get(self, voice_id: str) -> CosyVoice:
        voice = self._default.get(voice_id) or self._registered.get(voice_id)
        if voice is None:
            expected = ", ".join([*self._default, *self._registered.ids()])
            raise UnknownVoiceError(f"unknown voice {voice_id!r}; expected one of: {expected}")
        return voice

    def add(self, model: LoadedModel, voice_id: str, features: bytes | None, meta: dict[str, Any],
            default_language: str) -> VoiceInfo:
        if features is None:
            raise ValueError("expected cosyvoice voice features (a cloned reference), got none")
        if voice_id in self._default:
            raise EngineError(f"voice id {voice_id!r} names the built-in cosyvoice voice")
        prompt = from_bytes(features, model.version)
        info = VoiceInfo(voice_id=voice_id, name=str(meta.get("name") or voice_id),
                         language=str(meta.get("language") or default_language),
                         backend=BACKEND_NAME, sample_rate=SAMPLE_RATE, is_builtin=False,
                         supports_instructions=model.version == 3,
                         languages=LANGUAGES[model.version])  # a clone speaks them all
        voice = CosyVoice(info, prompt, flow_prompt_of(prompt, model.device))
        self._registered.add(voice_id, voice)
        return info

    def retire(self, voice_id: str) -> None:
        self._registered.retire(voice_id)

    def remove(self, voice_id: str, model: LoadedModel | None) -> None:
        # prepared requests hold their CosyVoice: they finish with it
        voice = self._registered.get(voice_id)
        self._registered.remove(voice_id)
        if voice is not None and model is not None:
            model.t2w.forget_voice(voice.flow)  # its cached prompt, once no stream speaks with it


def features_version(config: CosyVoiceBackendConfig) -> str:
    """Names what voice features depend on: the frontend models' bytes, the tokenizer and text
    normalization (the transcript's ids).

    The files are hashed whole, not named by their size: a re-exported or fine-tuned
    speaker or speech-token model of the same size makes different features, and stored
    voices must then be recomputed (docs/voices.md). Hashing reads them once per start,
    about a second for the largest (a speech tokenizer of a few hundred MB)."""
    root = config.model_dir
    text_frontend = resolve_text_frontend(config.text_frontend)
    digest = hashlib.sha256(f"{config.tokenizer}:{text_frontend}".encode())
    if root is not None:
        for name in ("campplus.onnx", "speech_tokenizer_v2.onnx", "speech_tokenizer_v3.onnx",
                     "cosyvoice2.yaml", "cosyvoice3.yaml", "CosyVoice-BlankEN/vocab.json",
                     "CosyVoice-BlankEN/tokenizer.json"):
            path = root / name
            if path.is_file():
                digest.update(f"{name}:".encode())
                with path.open("rb") as file:
                    while block := file.read(1 << 20):
                        digest.update(block)
    return f"cosyvoice-{digest.hexdigest()[:16]}"
