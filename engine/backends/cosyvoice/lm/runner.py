"""Batched decoding of the speech LM over one slot KV cache: prefill, step, free.

`SpeechLMRunner` holds the cache (qwen2.SlotKVCache, allocated once), the
pending log-probs of every slot and each stream's recent tokens for
repetition-aware sampling (sampling.py). A decode step chooses and feeds every
stream's token on the device (decode_step.py) with dynamic shapes, or the
bucketed static shapes of graphs.py (eager, or replayed as CUDA graphs).
The model itself is models/speech_lm.py.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.backends.cosyvoice.lm.decode_step import (
    ACTIVE,
    BELOW_MIN,
    COUNTER,
    FLAGS,
    FORCED,
    GREEDY,
    POSITION,
    STEP_WIDTH,
    TOKEN,
    DecodeState,
    Vocabulary,
    decode_rows,
)
from engine.backends.cosyvoice.lm.graphs import DECODE_MODES, StaticDecoder
from engine.backends.cosyvoice.lm.sampling import RasConfig, seed_words
from engine.backends.cosyvoice.models.qwen2 import CacheView, SlotKVCache
from engine.backends.cosyvoice.models.speech_lm import SpeechLM


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
        bucketed shapes of graphs.py, eager) or "cuda_graphs" (the same,
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
        self.state = DecodeState(
            logp=torch.zeros(max_batch, self.spec.num_rows, device=self.device),  # [S, V]
            history=torch.full((max_batch, self.ras.win_size), -1, dtype=torch.long,
                               device=self.device),
            seed_words=torch.zeros(max_batch, 2, dtype=torch.long, device=self.device),
            strict=torch.zeros(1, dtype=torch.bool, device=self.device))
        self._vocab = Vocabulary(self.spec.speech_token_size, self.spec.min_length_mask_index)
        # Seeds for requests that bring none: reproducible from `seed`, else fresh per run.
        self._seeds = random.Random(seed)
        self.static: StaticDecoder | None = None
        if decode_mode != "dynamic":
            self.static = StaticDecoder(lm, self.cache, self.state, self._vocab, self.ras,
                                        decode_mode == "cuda_graphs", kv_bucket)

    @property
    def _logp(self) -> torch.Tensor:
        return self.state.logp

    @property
    def _history(self) -> torch.Tensor:
        return self.state.history

    @property
    def strict_min_length(self) -> bool:
        """False (upstream): below the minimum length only index 6561 is forbidden, so a v3
        model may still stop early on 6562+; True forbids every stop id there (benchmarks
        on random weights, which would stop any time)."""
        return bool(self.state.strict.item())

    @strict_min_length.setter
    def strict_min_length(self, value: bool) -> None:
        self.state.strict.fill_(bool(value))

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
        self.state.logp[slots] = logp
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
            raise ValueError(f"expected fewer resumed tokens than {max_len}, got "
                             f"{len(r.resume_tokens)}")
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
            self.state.seed_words[stream.slot] = torch.tensor(seed_words(stream.seed))
            self.state.history[stream.slot] = -1
            recent = stream.tokens[-self.ras.win_size:]
            if recent:
                self.state.history[stream.slot, -len(recent):] = torch.tensor(
                    recent, device=self.device)
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
        return self.state.logp[torch.tensor([s.slot for s in streams], device=self.device)]

    def _inputs(self, streams: list[LMStream], forced: list[int] | None) -> np.ndarray:
        """The step's input rows [B, STEP_WIDTH] (decode_step.py); checks the batch first."""
        slots = [s.slot for s in streams]
        if len(set(slots)) != len(slots):
            raise ValueError(f"expected distinct streams, got slots {slots}")
        top = max(s.num_cached for s in streams)
        if top + 1 > self.max_len:
            raise ValueError(f"expected at most {self.max_len} cached positions, got {top + 1}")
        rows = np.zeros((len(streams), STEP_WIDTH), dtype=np.int64)
        rows[:, ACTIVE] = 1
        rows[:, POSITION] = [s.num_cached for s in streams]
        rows[:, COUNTER] = [len(s.tokens) for s in streams]
        rows[:, FLAGS] = [(BELOW_MIN if len(s.tokens) < s.min_len else 0)
                          | (GREEDY if s.is_greedy else 0)
                          for s in streams]
        if forced is not None:
            rows[:, FLAGS] |= FORCED
            rows[:, TOKEN] = forced
        return rows

    def _decode(self, streams: list[LMStream], rows: np.ndarray) -> list[int]:
        """Choose and feed one token per stream (decode_step.py) -> the chosen ids."""
        slots = [s.slot for s in streams]
        if self.static is not None:
            chosen = self.static.step(slots, rows)
        else:
            index = torch.tensor(slots, device=self.device)
            step_in = torch.from_numpy(rows).to(self.device)
            is_range = slots == list(range(slots[0], slots[0] + len(slots)))
            with torch.inference_mode():
                tokens, logp, window = decode_rows(
                    self.lm, self.cache, self.state, self._vocab, self.ras, index, index, step_in,
                    int(rows[:, POSITION].max()) + 1,
                    (slots[0], slots[0] + len(slots)) if is_range else None, self.dtype)
                self.state.logp[index] = logp
                self.state.history[index] = window
            chosen = tokens.cpu().numpy()
        return [int(t) for t in chosen]

    def feed(self, streams: list[LMStream], tokens: list[int]) -> torch.Tensor:
        """Append given speech tokens (one per stream) and return the next log-probs [B, V].

        Teacher forcing (tests, benchmarks): the step of `step`, with the tokens given.
        """
        if len(tokens) != len(streams):
            raise ValueError(f"expected one token per stream ({len(streams)}), got {len(tokens)}")
        self._decode(streams, self._inputs(streams, [int(t) for t in tokens]))
        for s, token in zip(streams, tokens, strict=True):
            s.tokens.append(int(token))
            s.num_cached += 1
        return self.logp(streams)

    def step(self, streams: list[LMStream]) -> list[int | None]:
        """Choose one token per stream from its pending log-probs and feed it, in one device step.

        Returns each stream's new token, or None where it chose a stop id.
        A stream is finished after a stop id or its `max_len`-th token.
        """
        if any(s.is_finished for s in streams):
            raise ValueError("expected only unfinished streams, got a finished one")
        chosen = self._decode(streams, self._inputs(streams, None))
        out: list[int | None] = []
        for s, token in zip(streams, chosen, strict=True):
            if self.spec.is_stop(token):
                s.is_finished = True
                out.append(None)
                continue
            s.tokens.append(token)
            s.num_cached += 1
            s.is_finished = len(s.tokens) >= s.max_len
            out.append(token)
        return out

    def free(self, stream: LMStream) -> None:
        """Return the stream's slot; its cache rows are simply overwritten by the next user."""
        if self._owners.get(stream.slot) is not stream:
            raise ValueError(f"slot {stream.slot} is already free (or now another stream's)")
        del self._owners[stream.slot]
        self._free.append(stream.slot)
        self._free.sort(reverse=True)
        stream.is_finished = True
