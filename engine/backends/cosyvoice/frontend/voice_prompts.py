"""Voices of the cosyvoice backend: one object for the LM's prompt and the flow's, and its bytes.

Two prompt types meet here, and only here: the frontend's `VoicePrompt` (LM
side: prompt text ids, prompt speech tokens, x-vector) and t2w's `FlowPrompt`
(flow side: tokens, 24 kHz mel, x-vector). `clone_voice` makes both from one
reference and applies upstream's trim (frontend_zero_shot): the prompt mel is
cut to exactly twice the prompt token count and the tokens to half the mel
frames, whichever is shorter, and the LM prompt uses the SAME trimmed tokens
as the flow, so the LM continues speech whose mel the flow conditions on.

A registered voice is stored as `to_bytes` (an .npz: text, ids, tokens,
embedding, mel) and comes back with `from_bytes`, so nothing is recomputed
at start-up (engine/backend.py, registered voices).
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

from engine.backends.cosyvoice.frontend.frontend import (
    EMBEDDING_DIM,
    CosyVoiceFrontend,
    VoicePrompt,
)
from engine.backends.cosyvoice.models.features import resample
from engine.backends.cosyvoice.models.mel import MelExtractor
from engine.backends.cosyvoice.t2w.streams import FlowPrompt
from engine.types import VoiceInfo

FLOW_RATE = 24000
MIN_REFERENCE_S = 0.5


@dataclass(slots=True)
class CosyVoice:
    """A speakable voice: its listing, the LM prompt and the flow prompt (one trim for both).

    `prompt.prompt_speech_tokens == flow.tokens.tolist()`; a voice with no
    reference (`is_plain`) has an empty LM prompt and a zero x-vector and
    speaks in cross-lingual mode.
    """

    info: VoiceInfo
    prompt: VoicePrompt
    flow: FlowPrompt

    @property
    def is_plain(self) -> bool:
        return not self.prompt.prompt_speech_tokens


def flow_prompt_of(prompt: VoicePrompt, device: torch.device | str = "cpu") -> FlowPrompt:
    """The flow's view of a voice prompt whose tokens and mel are already trimmed, on `device`.

    The tensors go to the models' device once, here (a voice is made once and
    speaks many chunks), not with every flow call. A plain voice has no prompt
    tokens, but the flow wants at least one: it gets one token (id 0) with no
    mel frames, which conditions nothing.
    """
    mel = prompt.prompt_mel if prompt.prompt_mel is not None else np.zeros((0, 80), np.float32)
    tokens = prompt.prompt_speech_tokens or [0]
    return FlowPrompt(torch.tensor(tokens, dtype=torch.long, device=device),
                      torch.as_tensor(np.asarray(mel, dtype=np.float32), device=device),
                      torch.from_numpy(np.asarray(prompt.embedding, dtype=np.float32)).to(device))


def clone_voice(frontend: CosyVoiceFrontend, mel: MelExtractor, audio: np.ndarray, sample_rate: int,
                transcript: str) -> VoicePrompt:
    """Everything a cloned voice needs, trimmed to upstream's 1 token : 2 mel frames.

    audio: [T] mono float32 at `sample_rate`. Raises ValueError for audio the
    models cannot use (too short, too long, silent to the tokenizer).
    """
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if len(audio) < MIN_REFERENCE_S * sample_rate:
        raise ValueError(f"expected at least {MIN_REFERENCE_S} s of reference audio, "
                         f"got {len(audio) / sample_rate:.2f} s")
    if not transcript.strip():
        raise ValueError("expected the reference audio's transcript, got none")
    prompt = frontend.register_voice(audio, sample_rate, transcript)
    wav24k = torch.from_numpy(resample(audio, sample_rate, FLOW_RATE))
    flow = FlowPrompt.from_audio(prompt.prompt_speech_tokens, wav24k,
                                 torch.from_numpy(prompt.embedding), mel)
    if flow.tokens.numel() == 0:
        raise ValueError("expected speech tokens from the reference audio, got none")
    # the flow's trim, for the LM too
    prompt.prompt_speech_tokens = [int(t) for t in flow.tokens.tolist()]
    prompt.prompt_mel = flow.mel.numpy().astype(np.float32)  # [2 Np, 80]
    return prompt


def plain_prompt(version: int) -> VoicePrompt:
    """A voice without a reference: no prompt, zero x-vector (the model's unconditioned voice)."""
    return VoicePrompt(version, "", [], [], np.zeros(EMBEDDING_DIM, np.float32),
                       np.zeros((0, 80), np.float32))


def to_bytes(prompt: VoicePrompt) -> bytes:
    """Serialize a trimmed voice prompt (an .npz; no pickle)."""
    buffer = io.BytesIO()
    meta = json.dumps({"version": prompt.version, "prompt_text": prompt.prompt_text})
    np.savez(buffer, meta=np.frombuffer(meta.encode("utf-8"), dtype=np.uint8),
             prompt_text_ids=np.asarray(prompt.prompt_text_ids, dtype=np.int64),
             prompt_speech_tokens=np.asarray(prompt.prompt_speech_tokens, dtype=np.int64),
             embedding=np.asarray(prompt.embedding, dtype=np.float32),
             prompt_mel=np.asarray(prompt.prompt_mel, dtype=np.float32).reshape(-1, 80))
    return buffer.getvalue()


def from_bytes(data: bytes, version: int) -> VoicePrompt:
    """The inverse of `to_bytes`; ValueError for bytes of another format or model version."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(bytes(npz["meta"]).decode("utf-8"))
            prompt = VoicePrompt(int(meta["version"]), str(meta["prompt_text"]),
                                 [int(i) for i in npz["prompt_text_ids"]],
                                 [int(t) for t in npz["prompt_speech_tokens"]],
                                 np.array(npz["embedding"], dtype=np.float32),
                                 np.array(npz["prompt_mel"], dtype=np.float32))
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile) as exc:
        raise ValueError(
            f"expected cosyvoice voice features (.npz), got unreadable bytes ({exc})") from exc
    if prompt.version != version:
        raise ValueError(f"expected features of a CosyVoice {version} voice, got CosyVoice "
                         f"{prompt.version}")
    if prompt.prompt_mel.shape != (2 * len(prompt.prompt_speech_tokens), 80):
        raise ValueError(f"expected a prompt mel of [{2 * len(prompt.prompt_speech_tokens)}, 80], "
                         f"got {list(prompt.prompt_mel.shape)}")
    return prompt
