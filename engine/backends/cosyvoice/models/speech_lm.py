"""The CosyVoice 2/3 speech-token LM: Qwen2 body, speech embedding, decoder head.

Upstream classes (cosyvoice/llm/llm.py) and their checkpoint layout:

    CosyVoice 2 (Qwen2LM)    llm_embedding [2, D] (row 0 sos, row 1 task id)
                             speech_embedding [6561 + 3, D]
                             llm_decoder [6561 + 3, D] with bias
                             eos 6561; stop ids 6561, 6562, 6563
    CosyVoice 3 (CosyVoice3LM) speech_embedding, llm_decoder [6561 + 200, D] (no bias)
                             sos 6561, eos 6562, task id 6563, fill 6564;
                             every id from 6561 up stops decoding

Prompt (one row of embeddings), as upstream's `inference`:

    [sos, embed_tokens(prompt_text + text), task, speech_embedding(prompt_speech_tokens)]

The decoder head reads the Qwen2 body's final-normed hidden state; log-probs
are taken in float32. No speaker embedding enters these LMs (CosyVoice 2 and 3
ignore it); the flow model uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.backends.cosyvoice.models.qwen2 import CacheView, Qwen2Config, Qwen2Encoder

# `<|endofprompt|>`: the first token CosyVoice adds to Qwen2's vocabulary (frontend/tokens.py's
# FIRST_ADDED_ID; written out here so that the models never import the frontend, and
# tests/unit/engine/cosyvoice/test_lm.py checks the two agree).
END_OF_PROMPT_ID = 151646


@dataclass(slots=True, frozen=True)
class SpeechTokenSpec:
    """Special ids of one version's speech vocabulary."""

    version: int
    speech_token_size: int  # 6561 regular speech tokens: 0..6560
    num_rows: int  # rows of speech_embedding and llm_decoder
    sos: int
    task: int
    eos: int

    @classmethod
    def for_version(cls, version: int, speech_token_size: int) -> SpeechTokenSpec:
        n = speech_token_size
        if version == 2:  # sos/task index llm_embedding, not speech_embedding
            return cls(version, n, n + 3, sos=0, task=1, eos=n)
        if version == 3:
            return cls(version, n, n + 200, sos=n, task=n + 2, eos=n + 1)
        raise ValueError(f"expected version 2 or 3, got {version}")

    def is_stop(self, token: int) -> bool:
        """Upstream's stop_token_ids: every id from speech_token_size up (3 in v2, 200 in v3)."""
        return token >= self.speech_token_size

    @property
    def min_length_mask_index(self) -> int:
        """The one index upstream forbids before the minimum length (6561 in both versions)."""
        return self.speech_token_size


class SpeechLM(nn.Module):
    """Qwen2LM (v2) or CosyVoice3LM (v3) with the official parameter names."""

    def __init__(self, version: int, qwen: Qwen2Config, speech_token_size: int = 6561) -> None:
        super().__init__()
        self.spec = SpeechTokenSpec.for_version(version, speech_token_size)
        d = qwen.hidden_size
        if version == 2:
            self.llm_embedding = nn.Embedding(2, d)
        self.llm = Qwen2Encoder(qwen)
        self.llm_decoder = nn.Linear(d, self.spec.num_rows, bias=version == 2)
        self.speech_embedding = nn.Embedding(self.spec.num_rows, d)

    @property
    def body(self) -> Any:
        return self.llm.model

    def _special(self, index: int) -> torch.Tensor:
        table = self.llm_embedding if self.spec.version == 2 else self.speech_embedding
        return table.weight[index : index + 1]  # [1, D]

    def prompt_embeds(
        self, text_ids: torch.Tensor, prompt_speech_tokens: torch.Tensor
    ) -> torch.Tensor:
        """text_ids [N] (prompt text then text), prompt_speech_tokens [M] -> [1 + N + 1 + M, D]."""
        if self.spec.version == 3 and not bool((text_ids == END_OF_PROMPT_ID).any()):
            raise ValueError(
                f"CosyVoice 3 expects <|endofprompt|> (id {END_OF_PROMPT_ID}) in prompt text or "
                "text, got none"
            )
        text = self.body.model.embed_tokens(text_ids)  # [N, D]
        speech = self.speech_embedding(prompt_speech_tokens)  # [M, D]
        return torch.cat(
            [self._special(self.spec.sos), text, self._special(self.spec.task), speech], dim=0
        )

    def token_embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] speech ids -> [B, 1, D]."""
        embeds: torch.Tensor = self.speech_embedding(tokens)
        return embeds[:, None]

    def forward_hidden(self, embeds: torch.Tensor, view: CacheView) -> torch.Tensor:
        """embeds [B, T, D] -> hidden [B, T, D] (writes the cache)."""
        hidden: torch.Tensor = self.body(embeds, view)
        return hidden

    def head_logp(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> log-probs [..., V] in float32."""
        logits: torch.Tensor = self.llm_decoder(hidden)
        return logits.float().log_softmax(dim=-1)
