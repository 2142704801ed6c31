"""The CosyVoice speech LM on vLLM's V1 async engine (`AsyncLLM`), one engine for all sessions.

The LM is exported by vllm_export.py (a Qwen2 folder over the speech
vocabulary). A request is a prompt row of embeddings (SpeechLM.prompt_embeds)
and yields speech token ids as vLLM samples them; `abort` drops a request
between two engine steps.

Sampling. vLLM samples from `softmax(logits)` after its logits processors;
`SpeechLogitsProcessor` below (loaded by vLLM in its engine process by name)
turns the head's logits into upstream's rules:

- adds CosyVoice 2's head bias (vLLM's Qwen2 head has none);
- before a stream's minimum length, forbids index `speech_token_size` (6561),
  exactly the index upstream's torch loop masks (not all stop ids, as vLLM's
  own `min_tokens` would);
- "ras" mode: replaces the row by the exact distribution of upstream's
  repetition-aware sampling (`ras_logits`), so vLLM's plain draw from it is a
  RAS draw (same distribution, not the same random stream).

Modes: "ras" (upstream's torch default), "top_k" (what upstream's own vLLM path
does: top-k 25, no RAS), "greedy" (argmax; for parity tests).

Stop rules as upstream: every id from `speech_token_size` up ends the stream
and is not yielded; at most `max_tokens` tokens.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from engine.backends.cosyvoice.lm.speech_logits import RowState, SpeechLogits
from engine.backends.cosyvoice.lm.vllm_export import read_head_bias, read_meta

# vLLM's import chain (torch inductor, torch.jit) raises DeprecationWarnings that are
# not ours to fix; they would fail any caller running with warnings as errors.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

EXTRA_KEY = "voxgate_speech"
PROCESSOR_FQCN = f"{__name__}:SpeechLogitsProcessor"
MODES = ("ras", "top_k", "greedy")
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(slots=True)
class SpeechSampling:
    """Per-request sampling; defaults are the official yamls' RAS values."""

    max_tokens: int
    min_tokens: int = 0
    mode: str = "ras"
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"expected mode one of {MODES}, got {self.mode!r}")
        if self.max_tokens < 0 or self.min_tokens < 0:
            raise ValueError(
                f"expected min/max tokens >= 0, got {self.min_tokens}/{self.max_tokens}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"expected top_p in (0, 1], got {self.top_p}")
        if self.top_k < 1 or self.win_size < 1 or self.tau_r < 0:
            raise ValueError(
                f"expected top_k >= 1, win_size >= 1, tau_r >= 0, got {self.top_k}, "
                f"{self.win_size}, {self.tau_r}"
            )

    @classmethod
    def for_text(
        cls, num_text_tokens: int, min_ratio: float = 2.0, max_ratio: float = 20.0, **kwargs: Any
    ) -> SpeechSampling:
        """Upstream's lengths: int(n x 2) to int(n x 20) speech tokens for n text tokens (prompt
        text excluded)."""
        return cls(
            max_tokens=int(num_text_tokens * max_ratio),
            min_tokens=int(num_text_tokens * min_ratio),
            **kwargs,
        )

    def to_vllm(self, stop_token_ids: list[int]) -> SamplingParams:
        extra: dict[str, Any] = {"min_tokens": self.min_tokens}
        if self.mode == "ras":
            extra["ras"] = [self.top_p, self.top_k, self.win_size, self.tau_r]
        common: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "stop_token_ids": stop_token_ids,
            "seed": self.seed,
            "output_kind": RequestOutputKind.DELTA,
            "detokenize": False,
            "extra_args": {EXTRA_KEY: extra},
        }
        if self.mode == "greedy":
            return SamplingParams(temperature=0.0, **common)
        if self.mode == "top_k":
            return SamplingParams(temperature=1.0, top_k=self.top_k, **common)
        return SamplingParams(
            temperature=1.0, top_p=1.0, top_k=0, **common
        )  # the processor does RAS


class SpeechLogitsProcessor(LogitsProcessor):  # type: ignore[misc, unused-ignore]  # Any without vLLM
    """Head bias, min-length mask and RAS for every request of the engine (see module doc)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        folder = vllm_config.model_config.model
        meta = read_meta(folder)
        max_rows = int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", 256)
                       or 256)
        self.logits = SpeechLogits(int(meta["min_length_mask_index"]), read_head_bias(folder),
                                   device, max_rows=max_rows, pin_memory=is_pin_memory)
        self.rows: dict[int, RowState] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = (sampling_params.extra_args or {}).get(EXTRA_KEY)
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(
                f"expected extra_args[{EXTRA_KEY!r}] to be a dict, got {type(extra).__name__}"
            )

    def is_argmax_invariant(self) -> bool:
        return False  # the bias and the mask change greedy tokens

    @staticmethod
    def _new_state(
        params: SamplingParams, _prompt: list[int] | None, output: list[int]
    ) -> RowState | None:
        extra = (params.extra_args or {}).get(EXTRA_KEY)
        if not extra:
            return None
        ras = extra.get("ras")
        return RowState(
            int(extra.get("min_tokens", 0)),
            None if ras is None else (float(ras[0]), int(ras[1]), int(ras[2]), float(ras[3])),
            output,
        )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # logits: [B, V] float32; the work (and why it builds no tensor per step) in
        # speech_logits.py
        return self.logits.apply(logits, self.rows)


@dataclass(slots=True)
class VllmLMConfig:
    """The one engine's settings. `gpu_memory_utilization` is its share of the GPU
    (weights + KV cache); `kv_cache_memory_bytes`, if set, fixes the KV cache instead
    (on the CPU it is the only size that applies)."""

    model: str
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.3
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_model_len: int = 4096
    enforce_eager: bool = False
    seed: int = 0
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"expected dtype one of {DTYPES}, got {self.dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"expected gpu_memory_utilization in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"expected kv_cache_memory_bytes > 0, got {self.kv_cache_memory_bytes}"
            )
        if self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError(
                f"expected max_num_seqs >= 1 and max_model_len >= 2, got "
                f"{self.max_num_seqs} and {self.max_model_len}"
            )


class VllmSpeechLM:
    """`generate(request_id, prompt_embeds, sampling)` streams speech token ids; `abort` ends
    one."""

    def __init__(self, config: VllmLMConfig) -> None:
        self.config = config
        meta = read_meta(config.model)
        self.vocab_size = int(meta["vocab_size"])
        self.stop_token_ids: list[int] = [int(t) for t in meta["stop_token_ids"]]
        self._stop = frozenset(self.stop_token_ids)
        self._engine: Any = None
        self._running: set[str] = set()
        self._aborted: set[str] = set()  # running ids whose tokens must not be yielded any more

    def start(self) -> None:
        """Start the engine (its core runs in a child process); blocking, seconds to minutes."""
        # The processor is written for the V1 model runner's interface (the one vLLM
        # runs on the CPU); keep the GPU on the same runner.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        c = self.config
        args = AsyncEngineArgs(
            model=c.model,
            skip_tokenizer_init=True,
            enable_prompt_embeds=True,
            dtype=cast(Any, c.dtype),  # checked against DTYPES
            gpu_memory_utilization=c.gpu_memory_utilization,
            kv_cache_memory_bytes=c.kv_cache_memory_bytes,
            max_num_seqs=c.max_num_seqs,
            max_model_len=c.max_model_len,
            enforce_eager=c.enforce_eager,
            seed=c.seed,
            logits_processors=[PROCESSOR_FQCN],
            disable_log_stats=True,
            **c.engine_kwargs,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self._engine = AsyncLLM.from_engine_args(args)

    def shutdown(self) -> None:
        """Stop the engine from outside its event loop (its loop tasks are cancelled)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    async def stop(self) -> None:
        """Stop the engine from inside its event loop, and wait for its tasks there to end."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        resources = getattr(engine.engine_core, "resources", None)
        tasks = [
            t
            for t in (
                getattr(engine, "output_handler", None),
                getattr(resources, "output_queue_task", None),
            )
            if t is not None
        ]
        engine.shutdown()
        if tasks:
            await asyncio.wait(tasks)
        # vLLM leaves its ZMQ context to the garbage collector, which warns; its sockets
        # are closed by now, so end it here (the asyncio context shadows a plain one).
        ctx = getattr(engine.engine_core, "ctx", None)
        owner = getattr(ctx, "_shadow_obj", ctx)
        if owner is not None and not owner.closed:
            owner.destroy(linger=0)

    async def generate(
        self, request_id: str, prompt_embeds: torch.Tensor, sampling: SpeechSampling
    ) -> AsyncIterator[int]:
        """prompt_embeds [T, D] -> speech token ids as sampled, stop token excluded.

        Closing the iterator or cancelling its task aborts the request in vLLM.
        """
        if self._engine is None:
            raise RuntimeError("expected a started engine (call start()), got none")
        if prompt_embeds.dim() != 2:
            raise ValueError(
                f"expected prompt_embeds [T, D], got shape {list(prompt_embeds.shape)}"
            )
        if sampling.max_tokens == 0:
            return
        if request_id in self._running:
            raise ValueError(f"expected a new request id, got {request_id!r} (still running)")
        params = sampling.to_vllm(self.stop_token_ids)
        prompt = {"prompt_embeds": prompt_embeds.detach().cpu()}
        stream = self._engine.generate(prompt, params, request_id)
        self._running.add(request_id)
        try:
            async for out in stream:
                for token in out.outputs[0].token_ids:
                    # Tokens vLLM made before an abort may still be queued: drop them.
                    if token in self._stop or request_id in self._aborted:
                        return
                    yield int(token)
                if out.finished:
                    return
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)
            await stream.aclose()  # aborts the request in vLLM if it is still running

    async def abort(self, request_id: str) -> None:
        """End a request now: its `generate` yields nothing more, and vLLM drops it
        before its next step. Unknown or finished ids are ignored."""
        if self._engine is None or request_id not in self._running:
            return
        self._aborted.add(request_id)
        await self._engine.abort(request_id)

    @property
    def num_unfinished(self) -> int:
        """Requests vLLM still holds (0 once every stream ended or was aborted)."""
        return 0 if self._engine is None else int(self._engine.get_num_unfinished_requests())
