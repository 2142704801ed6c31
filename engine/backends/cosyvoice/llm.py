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

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.backends.cosyvoice.llm_graphs import DECODE_MODES, StaticDecoder
from engine.backends.cosyvoice.model_dir import ModelDir
from engine.backends.cosyvoice.qwen2 import CacheView, Qwen2Config, Qwen2Encoder, SlotKVCache
from engine.backends.cosyvoice.sampling import (
    RasConfig,
    draw_uniforms,
    mask_min_length,
    sample_tokens,
)
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
class PrefillRequest:
    """One prompt for `SpeechLMRunner.add_requests` (the arguments of `add_request`)."""

    text_ids: list[int]
    prompt_text_ids: list[int] = field(default_factory=list)
    prompt_speech_tokens: list[int] = field(default_factory=list)
    is_greedy: bool = False
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    resume_tokens: list[int] = field(default_factory=list)
    seed: int | None = None  # None: the runner draws one


@dataclass(slots=True)
class LMStream:
    """One request's decoding state; its keys and values live in cache row `slot`.

    `num_cached` positions of the slot are filled (prompt plus fed tokens).
    `tokens` are the speech tokens emitted so far (never a stop id).
    Its k-th token is sampled with the uniforms of (`seed`, k) (sampling.py).
    """

    slot: int
    min_len: int
    max_len: int
    is_greedy: bool
    prompt_len: int
    num_cached: int
    tokens: list[int]
    seed: int = 0
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
        decode_mode: str = "dynamic",
        kv_bucket: int = 256,
    ) -> None:
        """`decode_mode`: "dynamic" (exact shapes, any device), "static" (the
        bucketed shapes of llm_graphs.py, eager) or "cuda_graphs" (the same,
        captured per bucket; CUDA only). Prefill is always dynamic."""
        if decode_mode not in DECODE_MODES:
            raise ValueError(f"expected decode_mode one of {DECODE_MODES}, got {decode_mode!r}")
        param = lm.speech_embedding.weight
        self.lm, self.device, self.dtype = lm, param.device, param.dtype
        self.spec = lm.spec
        self.ras = ras or RasConfig()
        self.cache = SlotKVCache(lm.body.config, max_batch, max_len, self.device, self.dtype)
        self.max_batch, self.max_len = max_batch, max_len
        self._free = list(range(max_batch - 1, -1, -1))  # pop() hands out the lowest slot
        self._owners: dict[int, LMStream] = {}
        self._logp = torch.zeros(max_batch, self.spec.num_rows, device=self.device)  # [S, V]
        self._history = torch.full(
            (max_batch, self.ras.win_size), -1, dtype=torch.long, device=self.device
        )
        # Seeds for requests that bring none: reproducible from `seed`, else fresh per run.
        self._seeds = random.Random(seed)
        #: False (upstream): below the minimum length only index 6561 is forbidden, so a v3
        #: model may still stop early on 6562+; True forbids every stop id there.
        self.strict_min_length = False
        self.static: StaticDecoder | None = None
        if decode_mode != "dynamic":
            self.static = StaticDecoder(lm, self.cache, self.spec.num_rows, decode_mode == "cuda_graphs",
                                        kv_bucket)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def _forward(self, streams: list[LMStream], embeds: torch.Tensor,
                 lengths: list[int] | None = None) -> torch.Tensor:
        """embeds [B, T, D] appended to each stream's slot -> log-probs at the last position [B, V].

        `lengths` (prefill of right-padded prompts): row i holds only lengths[i]
        real positions; its log-probs are read there and only those count as
        cached. The padding writes keys past a row's end, which are harmless:
        every later forward writes a position before any query reads it.
        """
        b, t, _ = embeds.shape
        slots_list = [s.slot for s in streams]
        if len(set(slots_list)) != b:
            raise ValueError(f"expected distinct streams, got slots {slots_list}")
        starts = [s.num_cached for s in streams]
        if max(starts) + t > self.max_len:
            raise ValueError(
                f"expected at most {self.max_len} cached positions, got {max(starts) + t}"
            )
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
        counts = lengths if lengths is not None else [t] * b
        with torch.inference_mode():
            hidden = self.lm.forward_hidden(embeds.to(self.dtype), view)  # [B, T, D]
            last = torch.tensor(counts, device=self.device) - 1
            logp = self.lm.head_logp(hidden[torch.arange(b, device=self.device), last])  # [B, V]
        for s, n in zip(streams, counts, strict=True):
            s.num_cached += n
        self._logp[slots] = logp
        return logp

    def add_request(
        self,
        text_ids: Sequence[int],
        prompt_text_ids: Sequence[int] = (),
        prompt_speech_tokens: Sequence[int] = (),
        is_greedy: bool = False,
        min_token_text_ratio: float = 2.0,
        max_token_text_ratio: float = 20.0,
        resume_tokens: Sequence[int] = (),
        seed: int | None = None,
    ) -> LMStream:
        """Prefill `[sos, prompt_text + text, task, prompt_speech_tokens]` into a free slot.

        Length limits follow upstream: from the text's token count (prompt text
        excluded), `min_token_text_ratio` x and `max_token_text_ratio` x; the
        maximum is cut to what the slot can still hold.

        `resume_tokens` are speech tokens the stream already emitted before it
        lost its slot (preemption by recomputation, as vLLM does): they are
        prefilled after the prompt, so the stream goes on exactly where it was
        (with the same `seed`, sampled tokens too).
        """
        (out,) = self.add_requests([PrefillRequest(
            list(text_ids), list(prompt_text_ids), list(prompt_speech_tokens), is_greedy,
            min_token_text_ratio, max_token_text_ratio, list(resume_tokens), seed)])
        if isinstance(out, Exception):
            raise out
        return out

    def _prompt(self, r: PrefillRequest) -> tuple[torch.Tensor, int, int]:
        """One request's prefill embeddings [P + R, D], prompt length P, and its max length."""
        if not r.text_ids:
            raise ValueError("expected at least one text token, got none")
        ids = torch.tensor([*r.prompt_text_ids, *r.text_ids], dtype=torch.long, device=self.device)
        speech = torch.tensor(list(r.prompt_speech_tokens), dtype=torch.long, device=self.device)
        resumed = torch.tensor(list(r.resume_tokens), dtype=torch.long, device=self.device)
        with torch.inference_mode():
            embeds = self.lm.prompt_embeds(ids, speech)  # [P, D]
            prompt_len = embeds.shape[0]
            if resumed.numel():
                embeds = torch.cat([embeds, self.lm.speech_embedding(resumed)])  # [P + R, D]
        if embeds.shape[0] >= self.max_len:
            raise ValueError(
                f"expected a prompt shorter than {self.max_len} positions, got {embeds.shape[0]}"
            )
        max_len = min(int(len(r.text_ids) * r.max_token_text_ratio), self.max_len - prompt_len)
        if len(r.resume_tokens) >= max_len:
            raise ValueError(f"expected fewer resumed tokens than {max_len}, got {len(r.resume_tokens)}")
        return embeds, prompt_len, max_len

    def add_requests(self, requests: list[PrefillRequest]) -> list[LMStream | Exception]:
        """Prefill many prompts in ONE forward (right-padded to the longest), each into a free slot.

        A request the runner cannot take (a bad prompt, no free slot) gets its
        exception in its place of the result; the others are prefilled.
        """
        out: list[LMStream | Exception] = []
        rows: list[tuple[LMStream, torch.Tensor]] = []
        for r in requests:
            try:
                if len(self._free) == 0:
                    raise NoFreeSlotError(
                        f"expected a free KV-cache slot, got all {self.max_batch} in use")
                embeds, prompt_len, max_len = self._prompt(r)
            except (ValueError, NoFreeSlotError) as exc:
                out.append(exc)
                continue
            stream = LMStream(
                slot=self._free.pop(),
                min_len=int(len(r.text_ids) * r.min_token_text_ratio),
                max_len=max_len,
                is_greedy=r.is_greedy,
                prompt_len=prompt_len,
                num_cached=0,
                tokens=[int(t) for t in r.resume_tokens],
                seed=self._seeds.getrandbits(64) if r.seed is None else int(r.seed),
            )
            self._owners[stream.slot] = stream
            self._history[stream.slot] = -1
            recent = stream.tokens[-self.ras.win_size:]
            if recent:
                self._history[stream.slot, -len(recent):] = torch.tensor(recent, device=self.device)
            rows.append((stream, embeds))
            out.append(stream)
        if rows:
            lengths = [e.shape[0] for _, e in rows]
            padded = torch.zeros(len(rows), max(lengths), rows[0][1].shape[1], device=self.device,
                                 dtype=rows[0][1].dtype)  # [B, T, D]
            for i, (_, e) in enumerate(rows):
                padded[i, : e.shape[0]] = e
            try:
                self._forward([s for s, _ in rows], padded, lengths)
            except Exception:
                for s, _ in rows:
                    self.free(s)
                raise
        return out

    def logp(self, streams: list[LMStream]) -> torch.Tensor:
        """The pending next-token log-probs of each stream [B, V] (before any masking)."""
        return self._logp[torch.tensor([s.slot for s in streams], device=self.device)]

    def feed(self, streams: list[LMStream], tokens: list[int]) -> torch.Tensor:
        """Append given speech tokens (one per stream) and return the next log-probs [B, V].

        `step` uses it for sampled tokens; tests use it for teacher forcing.
        """
        if len(tokens) != len(streams):
            raise ValueError(f"expected one token per stream ({len(streams)}), got {len(tokens)}")
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if self.static is not None:
            logp = self._static_forward(streams, ids)
        else:
            with torch.inference_mode():
                embeds = self.lm.token_embeds(ids)  # [B, 1, D]
            logp = self._forward(streams, embeds)  # raises before any state changes
        for s, token in zip(streams, tokens, strict=True):
            s.tokens.append(int(token))
        slots = torch.tensor([s.slot for s in streams], device=self.device)
        self._history[slots] = torch.cat([self._history[slots][:, 1:], ids[:, None]], dim=1)
        return logp

    def _static_forward(self, streams: list[LMStream], ids: torch.Tensor) -> torch.Tensor:
        """One token per stream through the bucketed decoder (llm_graphs.py) -> log-probs [B, V]."""
        assert self.static is not None
        slots_list = [s.slot for s in streams]
        if len(set(slots_list)) != len(slots_list):
            raise ValueError(f"expected distinct streams, got slots {slots_list}")
        positions = [s.num_cached for s in streams]
        if max(positions) + 1 > self.max_len:
            raise ValueError(f"expected at most {self.max_len} cached positions, got {max(positions) + 1}")
        logp = self.static.run(slots_list, positions, ids)
        for s in streams:
            s.num_cached += 1
        self._logp[torch.tensor(slots_list, device=self.device)] = logp
        return logp

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
        if self.strict_min_length:  # every stop id, as vLLM's min_tokens (benchmarks: random weights)
            stops = logp[:, self.spec.speech_token_size:]
            logp[:, self.spec.speech_token_size:] = torch.where(below_min[:, None], float("-inf"), stops)
        uniforms = draw_uniforms([s.seed for s in streams], [len(s.tokens) for s in streams],
                                 self.device)  # [B, 2]
        chosen = sample_tokens(logp, self._history[slots], is_greedy, self.ras, uniforms).tolist()
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
        if self._owners.get(stream.slot) is not stream:
            raise ValueError(f"slot {stream.slot} is already free (or now another stream's)")
        del self._owners[stream.slot]
        self._free.append(stream.slot)
        self._free.sort(reverse=True)
        stream.is_finished = True
