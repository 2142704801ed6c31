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
stream continues where it was (recomputation, as vLLM preempts).

Continuation (`can_continue`: the torch driver): a stream started with `keep`
is parked when it finishes, holding its slot, instead of being freed; a later
start with `follows` naming it continues its sequence with the new text
(runner.py, "Continuation"), so a context prefills its voice's prompt once.
The backend says which request follows which (one context, in order) and
`stop`s a parked stream when its context ends; when slots run short it frees
parked streams first (`parked`, least recently parked first).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.backends.cosyvoice.frontend.frontend import LMInput
from engine.backends.cosyvoice.lm.runner import LMStream, PrefillRequest, SpeechLMRunner

LM_BACKENDS = ("torch", "vllm")


def stream_seed(key: str, base_seed: int) -> int:
    """The sampling seed of a stream that brings none: the request key mixed with the backend's seed,
    so a request samples the same whatever shares its batches."""
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
    keep: bool = False  # park the stream when it finishes (a later start may continue it)
    follows: str | None = None  # continue this parked stream (only the segment's text is fed)


@dataclass(slots=True)
class LMOutput:
    """What one stream produced in one step: new speech tokens, and whether it has stopped."""

    tokens: list[int]
    is_finished: bool


class SpeechLMDriver(Protocol):
    #: parks streams started with `keep` and continues them (`LMStart.follows`)
    can_continue: bool

    @property
    def num_free(self) -> int:
        """How many more streams `start` accepts now."""
        ...

    def parked(self) -> list[str]:
        """The parked streams' keys, least recently parked first."""
        ...

    def start(self, requests: list[LMStart]) -> dict[str, Exception]:
        """Prefill streams (batched); the failures by key (NoFreeSlotError, ValueError for a bad prompt)."""
        ...

    def step(self, keys: list[str]) -> dict[str, LMOutput]:
        """Advance these running streams; a finished stream is stopped by the driver itself."""
        ...

    def stop(self, key: str) -> None:
        """Free a stream's resources now (cancel, preemption, a parked stream's context
        ended); unknown keys are ignored."""
        ...


class TorchLMDriver:
    """`SpeechLMRunner` by request id: one batched decode forward per `step`."""

    can_continue = True

    def __init__(self, runner: SpeechLMRunner) -> None:
        self.runner = runner
        self._streams: dict[str, LMStream] = {}
        self._keep: set[str] = set()  # running streams to park when they finish
        self._parked: dict[str, LMStream] = {}  # in the order they were parked

    @property
    def num_free(self) -> int:
        return self.runner.num_free_slots

    def has(self, key: str) -> bool:
        return key in self._streams

    def parked(self) -> list[str]:
        return list(self._parked)

    def can_follow(self, key: str, lm_input: LMInput) -> bool:
        """Whether the parked stream `key` has room for a segment of this text (at least twice
        its minimum length of speech after it)."""
        stream = self._parked.get(key)
        num_text = len(lm_input.text_ids) - lm_input.num_prefix_ids
        return stream is not None and num_text > 0 and self.runner.room_after(stream, num_text) >= 4 * num_text

    def start(self, requests: list[LMStart]) -> dict[str, Exception]:
        failed: dict[str, Exception] = {}
        fresh: list[tuple[LMStart, PrefillRequest]] = []
        for r in requests:
            if r.key in self._streams or r.key in self._parked:
                failed[r.key] = ValueError(f"expected a new LM stream key, got {r.key!r} (already running)")
                continue
            ids = r.lm_input
            follows = None
            if r.follows is not None and self.can_follow(r.follows, ids):
                follows = self._parked.pop(r.follows)
            elif r.follows is not None:
                self.stop(r.follows)  # no room (or gone): this segment starts afresh
            text = ids.text_ids[ids.num_prefix_ids:] if follows is not None else ids.text_ids
            fresh.append((r, PrefillRequest(text, ids.prompt_text_ids, ids.prompt_speech_tokens,
                                            r.is_greedy, resume_tokens=list(r.resume_tokens), seed=r.seed,
                                            follows=follows)))
        outs = self.runner.add_requests([p for _, p in fresh])
        for (r, prefill), out in zip(fresh, outs, strict=True):
            if isinstance(out, Exception):
                failed[r.key] = out
                if prefill.follows is not None and self.runner.owns(prefill.follows):
                    self.runner.free(prefill.follows)  # the continued slot is not left behind
            else:
                self._streams[r.key] = out
                if r.keep:
                    self._keep.add(r.key)
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
                if key in self._keep:
                    self._keep.discard(key)
                    self._parked[key] = self._streams.pop(key)
                else:
                    self.stop(key)
        return out

    def stop(self, key: str) -> None:
        self._keep.discard(key)
        stream = self._streams.pop(key, None) or self._parked.pop(key, None)
        if stream is not None:
            self.runner.free(stream)
