"""The one interface every speech backend implements, and the scheduler drives.

A backend is stepped, never called per request: each `step` advances a batch
of requests (from any number of sessions) by one unit of the backend's work
and returns what each produced. For piper a unit is one decoder window (the
first step of a segment also runs its front part); for cosyvoice it is one LM
decode step plus whatever token-to-wave chunks became ready. The engine calls
`prepare`, `step` and `release` from one worker thread, never from the event
loop, so a backend needs no locking of its own: a request cancelled while a
step runs is released on that thread before the next step, never during it.
A backend whose steps share no state says so (`concurrent_steps`, piper):
the engine then runs `parallelism` one-request steps side by side on lane
threads, and prepare, release and the voice methods may run while they do;
a request is still never in two steps at once nor released during its step.
The engine decides, the backend runs: with each item of a step it hands the
backend a `StepPlan` (the item's due time, whether the step runs alone or
beside another lane's work due soon, whether the item's context is the only
one with prepared work), and a backend that sizes its work by the load
(piper's window pace) reads that plan rather than counting steps itself.
A backend that cannot run an item of a step now (cosyvoice: no room in its
memory for one more stream) says so in the item's result (`StepResult.waiting`,
with the reason): the engine counts it and tries the item again once work
has moved, never holding it without a word.

Registered voices (docs/voices.md) use four optional methods, also called in
that worker thread (the engine's voice verbs run them there):
`make_voice_features` computes a reference voice's prompt features once, at
registration; the gateway stores them and hands them back to `add_voice` on
every start-up, so nothing is recomputed. `retire_voice` takes a deleted voice
out of `voices()` while sessions that hold it may still speak with it;
`remove_voice` forgets it. A backend that can register voices says so with
`can_register_voices = True`; one that cannot keeps the defaults and the
gateway answers `unsupported_option`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.errors import UnknownVoiceError, UnsupportedOptionError
from engine.types import RequestId, SynthesisRequest, VoiceInfo, WordTiming


@dataclass(slots=True, frozen=True)
class StepPlan:
    """What the engine saw when it started a step with an item, for the backend to run it by.

    `due` is the item's `due_of` then (on time.monotonic()'s clock). `is_alone`: no
    other lane's step runs beside this one (its calls may take every core).
    `is_contended`: another lane's step runs work due within that backend's
    `busy_lead_s` (look-ahead work beside it does not count). `is_lone`: the item's
    context is the only one with prepared work (one talking session). A backend
    stepped without an engine (a test, a bench) reads `StepPlan(due_of(item))` (`plan_of`).
    """

    due: float
    is_alone: bool = True
    is_contended: bool = False
    is_lone: bool = False


@dataclass(slots=True)
class BackendRequest:
    """A request as a backend holds it between steps.

    `state` is the backend's own (phonemes, KV cache slot, hop state...).
    `est_audio_s` is the backend's estimate of the audio the request will
    produce, used by the scheduler's deadline and admission policy; a backend
    may refine it in `step` (piper: exact once a segment's frames are known),
    and the engine reads it after every step, so the next segment of the
    context is due when this one's audio really ends.
    `due` is when the request's next piece of audio must exist (time.monotonic()'s
    clock): the engine sets it before each schedule from the request's playback
    clock (engine/clock.py). Stepped without an engine (a test, a bench), it is
    0.0 unless the caller sets it: every item equally and long overdue.
    Backends leave it.
    `plan` is set by the engine as it starts a step with the request (`StepPlan`);
    backends read it and leave it (None: stepped without an engine).
    """

    request: SynthesisRequest
    state: Any = None
    est_audio_s: float = 0.0
    due: float = 0.0
    plan: StepPlan | None = None

    @property
    def request_id(self) -> RequestId:
        return self.request.request_id


def due_of(item: BackendRequest) -> float:
    """When the request's next piece of audio must exist (`BackendRequest.due`)."""
    return item.due


def plan_of(item: BackendRequest) -> StepPlan:
    """The plan the engine gave the item for this step; stepped without one, its due alone."""
    return item.plan if item.plan is not None else StepPlan(due_of(item))


@dataclass(slots=True)
class StepResult:
    """What one request produced in one step.

    `pcm` may be empty (an LM step that made tokens but no audio yet).
    `is_finished` means the request produced its last audio in this step.
    `error` ends only this request (the engine reports it as `internal`).
    `waiting`: the request did not run in this step, and why (a short name, the
    label of the engine's wait metric: cosyvoice's "flow_cache", "lm_slot").
    """

    pcm: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    words: list[WordTiming] | None = None
    is_finished: bool = False
    error: BaseException | None = None
    waiting: str | None = None


class Backend(ABC):
    """A speech model behind the engine's scheduler."""

    name: str = "backend"
    sample_rate: int = 22050
    max_batch_size: int = 8
    #: items a step can run side by side at the cost of one (e.g. one per core):
    #: the scheduler never sends fewer than this when that many are waiting
    parallelism: int = 1
    #: a step's items share no work (each is a call of its own, `parallelism` at a time):
    #: the scheduler then sends `parallelism` items per step, so that every step is as short
    #: as one item's work and the earliest deadline is chosen again after each
    serial_items: bool = False
    #: steps of different requests may run at once on separate threads, and prepare,
    #: release and the voice methods while a step runs (they share no state with it):
    #: the engine then runs `parallelism` one-request steps side by side (lanes)
    concurrent_steps: bool = False
    #: a step whose work is due within this many seconds is busy: a step that starts
    #: beside it is `StepPlan.is_contended` (work due later is look-ahead that can wait)
    busy_lead_s: float = 0.5
    #: Implements `add_voice`, `retire_voice` and `remove_voice` (registered voices).
    can_register_voices: bool = False
    #: Registration refuses reference audio without its transcript (cosyvoice's prompt text).
    needs_transcript: bool = False
    #: Names the format of `make_voice_features`' output: stored features made under
    #: another version (another model) are recomputed from the stored audio.
    voice_features_version: str = ""

    @abstractmethod
    def load(self) -> None:
        """Load weights and warm up; blocking, run off the event loop."""

    @abstractmethod
    def voices(self) -> list[VoiceInfo]:
        """The voices this backend can speak with now."""

    @abstractmethod
    def prepare(self, request: SynthesisRequest) -> BackendRequest:
        """Validate and pre-process one request (text frontend, voice lookup).

        Raises UnknownVoiceError or UnsupportedOptionError for bad requests.
        """

    @abstractmethod
    def step(self, batch: list[BackendRequest]) -> list[StepResult]:
        """Advance every request of the batch by one unit; one result per item, in order."""

    def release(self, item: BackendRequest) -> None:
        """Free what the request holds (a finished or cancelled request)."""
        item.state = None

    def close(self) -> None:  # noqa: B027 - a default that does nothing, not a missing abstract
        """Stop every thread and pool of the backend's own; the engine stopped (`Engine.stop`)
        and no step, prepare or release runs after this. The default has none."""

    def context_capacity(self) -> int:
        """Talking contexts the backend's memory holds at once; 0: no bound of its own.

        A backend that keeps memory per talking context (cosyvoice on a GPU: an LM
        slot and a share of the flow's K/V cache) says how many fit, so admission is
        sized by memory as well as by the measured step cost. Called off the worker
        thread: a backend answers from counters, without touching step state.
        """
        return 0

    # -- registered voices (optional) ---------------------------------------

    def voice_features_executor(self) -> Executor | None:
        """Where `make_voice_features` may run instead of the worker thread, or None.

        Registration analyses up to 30 s of reference audio (cosyvoice: an ONNX
        speech tokenizer and speaker model); on the worker thread that stalls
        every stream's next step. A backend whose feature making touches no state
        a step uses returns an executor of its own, and the engine runs it there.
        """
        return None

    def make_voice_features(self, audio: np.ndarray, sample_rate: int,
                            transcript: str) -> bytes | None:
        """A reference voice's prompt features, serialized; None when the backend needs none.

        audio: [T] mono float32 in [-1, 1] at `sample_rate` (the upload's own rate).
        Raises ValueError for audio the backend cannot use (the gateway answers 422).
        """
        return None

    def add_voice(self, voice_id: str, features: bytes | None, meta: dict[str, Any]) -> VoiceInfo:
        """Make a registered voice speakable (and listed) under `voice_id`; returns its info.

        `meta` carries `name`, `language` and, where `features` is None, `base_voice`
        (the installed voice that speaks for it). Replaces a voice of the same id.
        """
        raise UnsupportedOptionError(f"the {self.name} backend cannot register voices")

    def retire_voice(self, voice_id: str) -> None:
        """Stop listing a registered voice; requests and sessions holding it keep speaking."""
        raise UnknownVoiceError(f"unknown registered voice {voice_id!r}")

    def remove_voice(self, voice_id: str) -> None:
        """Forget a registered (or retired) voice; requests already prepared finish with it."""
        raise UnknownVoiceError(f"unknown registered voice {voice_id!r}")
