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

from engine.backends.cosyvoice.model_dir import ModelDir
from engine.backends.cosyvoice.qwen2 import CacheView, Qwen2Config, Qwen2Encoder, SlotKVCache
from engine.backends.cosyvoice.sampling import RasConfig, mask_min_length, sample_tokens
from engine.backends.cosyvoice.tokens import FIRST_ADDED_ID
from engine.errors import ModelLoadError

# CosyVoice 3 refuses text without `<|endofprompt|>` (upstream asserts it).
END_OF_PROMPT_ID = FIRST_ADDED_ID


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
                f"CosyVoice 3 expects <|endofprompt|> (id {END_OF_PROMPT_ID}) in prompt text or text, got none"
            )
        text = self.body.model.embed_tokens(text_ids)  # [N, D]
        speech = self.speech_embedding(prompt_speech_tokens)  # [M, D]
        return torch.cat(
            [self._special(self.spec.sos), text, self._special(self.spec.task), speech], dim=0
        )

    def token_embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] speech ids -> [B, 1, D]."""
        return self.speech_embedding(tokens)[:, None]

    def forward_hidden(self, embeds: torch.Tensor, view: CacheView) -> torch.Tensor:
        """embeds [B, T, D] -> hidden [B, T, D] (writes the cache)."""
        return self.body(embeds, view)

    def head_logp(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> log-probs [..., V] in float32."""
        return self.llm_decoder(hidden).float().log_softmax(dim=-1)


def _check_state_dict(module: SpeechLM, state: dict[str, Any], source: str) -> None:
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    if missing:
        raise ModelLoadError(
            f"{source}: expected tensor {missing[0]} ({len(missing)} missing), got none"
        )
    if unexpected:
        raise ModelLoadError(
            f"{source}: expected only the tensors of the CosyVoice {module.spec.version} LM, "
            f"got unexpected {unexpected[0]} ({len(unexpected)} in all; a checkpoint of the other version?)"
        )
    for key, shape in want.items():
        if got[key] != shape:
            raise ModelLoadError(
                f"{source}: expected {key} of shape {list(shape)}, got {list(got[key])}"
            )


def load_speech_lm(
    model_dir: ModelDir,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    drop_text_head: bool = True,
) -> SpeechLM:
    """Build the LM from the directory's yaml and Qwen2 config and load `llm.pt` strictly.

    `drop_text_head` frees the Qwen2 text `lm_head` after loading (the speech
    LM never reads it; it is 136M parameters at 0.5B size).
    """
    llm = model_dir.section("llm")
    qwen = Qwen2Config.from_dict(model_dir.qwen_config())
    for name in ("llm_input_size", "llm_output_size"):
        if int(llm.get(name, qwen.hidden_size)) != qwen.hidden_size:
            raise ModelLoadError(
                f"{model_dir.yaml_path.name}: expected llm.{name} = Qwen2 hidden_size "
                f"{qwen.hidden_size}, got {llm.get(name)}"
            )
    speech_token_size = int(llm.get("speech_token_size", 6561))
    with torch.device("meta"):
        lm = SpeechLM(model_dir.version, qwen, speech_token_size)
    state = model_dir.load_checkpoint("llm.pt")
    _check_state_dict(lm, state, str(model_dir.path / "llm.pt"))
    try:
        lm.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # already checked; kept for anything torch adds
        raise ModelLoadError(f"{model_dir.path / 'llm.pt'}: {exc}") from exc
    if drop_text_head:
        lm.body.lm_head.weight = nn.Parameter(torch.empty(0, qwen.hidden_size), requires_grad=False)
    lm = lm.to(device=device, dtype=dtype)
    lm.body.reset_rope(device)  # float32 tables whatever the weights' dtype
    lm.requires_grad_(False)
    return lm.eval()


class NoFreeSlotError(RuntimeError):
    """Every KV-cache slot holds a stream; free one first."""


@dataclass(slots=True)
class LMStream:
    """One request's decoding state; its keys and values live in cache row `slot`.

    `num_cached` positions of the slot are filled (prompt plus fed tokens).
    `tokens` are the speech tokens emitted so far (never a stop id).
    """

    slot: int
    min_len: int
    max_len: int
    is_greedy: bool
    prompt_len: int
    num_cached: int
    tokens: list[int]
    is_finished: bool = False


class SpeechLMRunner:
    """Batched decoding of many streams over one slot KV cache allocated up front.

    A backend drives it as: `add_request` (prefill a prompt into a free slot),
    `step` (one token for each of a batch of streams, one batched forward),
    `free` (give the slot back). Nothing is allocated per step besides
    activations.
    """

    def __init__(
        self,
        lm: SpeechLM,
        max_batch: int,
        max_len: int,
        ras: RasConfig | None = None,
        seed: int | None = None,
    ) -> None:
        param = lm.speech_embedding.weight
        self.lm, self.device, self.dtype = lm, param.device, param.dtype
        self.spec = lm.spec
        self.ras = ras or RasConfig()
        self.cache = SlotKVCache(lm.body.config, max_batch, max_len, self.device, self.dtype)
        self.max_batch, self.max_len = max_batch, max_len
        self._free = list(range(max_batch - 1, -1, -1))  # pop() hands out the lowest slot
        self._logp = torch.zeros(max_batch, self.spec.num_rows, device=self.device)  # [S, V]
        self._history = torch.full(
            (max_batch, self.ras.win_size), -1, dtype=torch.long, device=self.device
        )
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def _forward(self, streams: list[LMStream], embeds: torch.Tensor) -> torch.Tensor:
        """embeds [B, T, D] appended to each stream's slot -> log-probs at the last position [B, V]."""
        b, t, _ = embeds.shape
        starts = [s.num_cached for s in streams]
        if max(starts) + t > self.max_len:
            raise ValueError(
                f"expected at most {self.max_len} cached positions, got {max(starts) + t}"
            )
        slots_list = [s.slot for s in streams]
        slots = torch.tensor(slots_list, device=self.device)
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(
            t, device=self.device
        )
        is_range = slots_list == list(range(slots_list[0], slots_list[0] + b))
        view = CacheView(
            self.cache,
            slots,
            positions,
            kv_len=max(starts) + t,
            row_range=(slots_list[0], slots_list[0] + b) if is_range else None,
        )
        with torch.inference_mode():
            hidden = self.lm.forward_hidden(embeds.to(self.dtype), view)  # [B, T, D]
            logp = self.lm.head_logp(hidden[:, -1])  # [B, V]
        for s in streams:
            s.num_cached += t
        self._logp[slots] = logp
        return logp

    def add_request(
        self,
        text_ids: list[int],
        prompt_text_ids: list[int] = (),  # type: ignore[assignment]
        prompt_speech_tokens: list[int] = (),  # type: ignore[assignment]
        is_greedy: bool = False,
        min_token_text_ratio: float = 2.0,
        max_token_text_ratio: float = 20.0,
    ) -> LMStream:
        """Prefill `[sos, prompt_text + text, task, prompt_speech_tokens]` into a free slot.

        Length limits follow upstream: from the text's token count (prompt text
        excluded), `min_token_text_ratio` x and `max_token_text_ratio` x; the
        maximum is cut to what the slot can still hold.
        """
        if not text_ids:
            raise ValueError("expected at least one text token, got none")
        if not self._free:
            raise NoFreeSlotError(f"expected a free KV-cache slot, got all {self.max_batch} in use")
        ids = torch.tensor([*prompt_text_ids, *text_ids], dtype=torch.long, device=self.device)
        speech = torch.tensor(list(prompt_speech_tokens), dtype=torch.long, device=self.device)
        with torch.inference_mode():
            embeds = self.lm.prompt_embeds(ids, speech)  # [P, D]
        prompt_len = embeds.shape[0]
        if prompt_len >= self.max_len:
            raise ValueError(
                f"expected a prompt shorter than {self.max_len} positions, got {prompt_len}"
            )
        max_len = min(int(len(text_ids) * max_token_text_ratio), self.max_len - prompt_len)
        stream = LMStream(
            slot=self._free.pop(),
            min_len=int(len(text_ids) * min_token_text_ratio),
            max_len=max_len,
            is_greedy=is_greedy,
            prompt_len=prompt_len,
            num_cached=0,
            tokens=[],
        )
        self._history[stream.slot] = -1
        try:
            self._forward([stream], embeds[None])
        except Exception:
            self.free(stream)
            raise
        return stream

    def logp(self, streams: list[LMStream]) -> torch.Tensor:
        """The pending next-token log-probs of each stream [B, V] (before any masking)."""
        return self._logp[torch.tensor([s.slot for s in streams], device=self.device)]

    def feed(self, streams: list[LMStream], tokens: list[int]) -> torch.Tensor:
        """Append given speech tokens (one per stream) and return the next log-probs [B, V].

        `step` uses it for sampled tokens; tests use it for teacher forcing.
        """
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        for s, token in zip(streams, tokens, strict=True):
            s.tokens.append(int(token))
        slots = torch.tensor([s.slot for s in streams], device=self.device)
        self._history[slots] = torch.cat([self._history[slots][:, 1:], ids[:, None]], dim=1)
        with torch.inference_mode():
            embeds = self.lm.token_embeds(ids)  # [B, 1, D]
        return self._forward(streams, embeds)

    def step(self, streams: list[LMStream]) -> list[int | None]:
        """Choose one token per stream from its pending log-probs, then feed the live ones.

        Returns each stream's new token, or None where it chose a stop id.
        A stream is finished after a stop id or its `max_len`-th token.
        """
        if any(s.is_finished for s in streams):
            raise ValueError("expected only unfinished streams, got a finished one")
        slots = torch.tensor([s.slot for s in streams], device=self.device)
        below_min = torch.tensor([len(s.tokens) < s.min_len for s in streams], device=self.device)
        is_greedy = torch.tensor([s.is_greedy for s in streams], device=self.device)
        logp = mask_min_length(self._logp[slots], below_min, self.spec.min_length_mask_index)
        chosen = sample_tokens(
            logp, self._history[slots], is_greedy, self.ras, self.generator
        ).tolist()
        out: list[int | None] = []
        live: list[tuple[LMStream, int]] = []
        for s, token in zip(streams, chosen, strict=True):
            if self.spec.is_stop(token):
                s.is_finished = True
                out.append(None)
                continue
            out.append(token)
            if len(s.tokens) + 1 >= s.max_len:
                s.tokens.append(token)
                s.is_finished = True
            else:
                live.append((s, token))
        if live:
            self.feed([s for s, _ in live], [t for _, t in live])
        return out

    def free(self, stream: LMStream) -> None:
        """Return the stream's slot; its cache rows are simply overwritten by the next user."""
        if stream.slot in self._free:
            raise ValueError(f"slot {stream.slot} is already free")
        self._free.append(stream.slot)
        self._free.sort(reverse=True)
        stream.is_finished = True
