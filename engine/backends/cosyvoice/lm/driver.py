"""The backend's seam to the speech LM: start, step and stop token streams by request id.

The backend never touches `SpeechLMRunner` or vLLM directly: it asks a
`SpeechLMDriver` to start a stream (prefill), to advance a set of streams by
one step (one token each for the torch runner; whatever arrived for vLLM),
and to stop one (finished or cancelled). Two implementations:

- `TorchLMDriver` (`lm_backend="torch"`, here): the slot KV cache of runner.py in
  this process, one batched decode per step, CUDA graphs on a GPU;
- `VllmLMDriver` (`lm_backend="vllm"`, driver_vllm.py): the LM on vLLM's
  AsyncLLM, its loop on its own thread; `step` collects what each request
  made since the last call, `stop` aborts.

loader.py picks one by `lm_backend`.

Preemption: when every slot is held, the backend may `stop` a stream that is
not in the current batch and later `start` it again with `resume_tokens` (the
tokens it already emitted): the runner prefills them after the prompt and the
stream continues where it was (recomputation, as vLLM preempts). Which stream
gives way is the backend's scheduler's choice (scheduler.py), never the driver's.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.backends.cosyvoice.frontend.frontend import LMInput
from engine.backends.cosyvoice.lm.runner import LMStream, PrefillRequest, SpeechLMRunner


def stream_seed(key: str, base_seed: int) -> int:
    """The sampling seed of a stream that brings none: the request key mixed with the backend's
    seed, so a request samples the same whatever shares its batches."""
    return zlib.crc32(key.encode()) ^ base_seed


@dataclass(slots=True)
class LMStart:
    """A stream to start: its prompt, its sampling, and the tokens it already emitted (resumption).

    `seed` fixes its sampled tokens (None: the driver picks one); resuming with
    the same seed continues the same token sequence. `is_seeded`: the request
    asked for that determinism (SamplingParams.seed). The torch runner seeds
    every stream (counter-based uniforms cost nothing); vLLM only seeded ones,
    since a seeded row makes its sampler loop per row instead of one fused op.
    """

    key: str
    lm_input: LMInput
    is_greedy: bool
    resume_tokens: Sequence[int] = ()
    seed: int | None = None
    is_seeded: bool = False


@dataclass(slots=True)
class LMOutput:
    """What one stream produced in one step: new speech tokens, and whether it has stopped."""

    tokens: list[int]
    is_finished: bool


class SpeechLMDriver(Protocol):
    @property
    def num_free(self) -> int:
        """How many more streams `start` accepts now."""
        ...

    def start(self, requests: list[LMStart]) -> dict[str, Exception]:
        """Prefill streams (batched); the failures by key (NoFreeSlotError, ValueError for a bad
        prompt)."""
        ...

    def step(self, keys: list[str]) -> dict[str, LMOutput]:
        """Advance these running streams; a finished stream is stopped by the driver itself."""
        ...

    def stop(self, key: str) -> None:
        """Free a stream's resources now (cancel, preemption); unknown keys are ignored."""
        ...

    def close(self) -> None:
        """Stop every stream and any thread of the driver's own (the backend is closing)."""
        ...


class TorchLMDriver:
    """`SpeechLMRunner` by request id: one batched decode forward per `step`."""

    def __init__(self, runner: SpeechLMRunner) -> None:
        self.runner = runner
        self._streams: dict[str, LMStream] = {}

    @property
    def num_free(self) -> int:
        return self.runner.num_free_slots

    def start(self, requests: list[LMStart]) -> dict[str, Exception]:
        failed: dict[str, Exception] = {}
        fresh: list[tuple[LMStart, PrefillRequest]] = []
        for r in requests:
            if r.key in self._streams:
                failed[r.key] = ValueError(f"expected a new LM stream key, got {r.key!r} "
                                           "(already running)")
                continue
            ids = r.lm_input
            fresh.append((r, PrefillRequest(
                ids.text_ids, ids.prompt_text_ids, ids.prompt_speech_tokens, r.is_greedy,
                resume_tokens=list(r.resume_tokens), seed=r.seed)))
        outs = self.runner.add_requests([p for _, p in fresh])
        for (r, _), out in zip(fresh, outs, strict=True):
            if isinstance(out, Exception):
                failed[r.key] = out
            else:
                self._streams[r.key] = out
        return failed

    def step(self, keys: list[str]) -> dict[str, LMOutput]:
        streams = [self._streams[k] for k in keys]
        if not streams:
            return {}
        chosen = self.runner.step(streams)
        out: dict[str, LMOutput] = {}
        for key, stream, token in zip(keys, streams, chosen, strict=True):
            out[key] = LMOutput([] if token is None else [token], stream.is_finished)
            if stream.is_finished:
                self.stop(key)
        return out

    def stop(self, key: str) -> None:
        stream = self._streams.pop(key, None)
        if stream is not None:
            self.runner.free(stream)

    def close(self) -> None:
        for key in list(self._streams):
            self.stop(key)
