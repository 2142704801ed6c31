"""The cosyvoice backend: CosyVoice 2/3 behind the engine's `Backend` interface.

One `step` advances a batch of requests by one LM decode step and whatever
audio became ready (docs/architecture.md, "The streaming model"):

1. requests without an LM stream start one (prefill into a free KV-cache
   slot; when every slot is held, the holder with the latest deadline that is
   not in this batch is preempted and later resumes by recomputation);
2. one batched LM decode step for every request of the batch still
   decoding: one speech token each, fed into that request's token-to-wave
   stream (t2w/streams.py); a request whose LM stopped is marked input-done;
3. one batched token-to-wave run over the batch's streams that have a chunk
   ready (first hop 15 tokens, then the 25-token grid, plus 3 lookahead):
   flow matching then HiFT, all streams in one call each;
4. a `StepResult` per request with the PCM of this step (often empty) and
   `is_finished` with the last chunk.

`release` (finished or cancelled) frees the LM slot and drops the t2w stream
at once, so a cancelled request yields nothing more.

Contexts (`lm_context="continue"`): the segments of one context (one spoken
turn, `SynthesisRequest.context_key`) continue one LM sequence, so the
voice's prompt is prefilled once per context (lm/driver.py, "Continuation").
A segment's LM stream is parked when it finishes; the context's next segment
waits until then and continues it; `release` of a segment that did not finish
(a cancel), `end_context` or a shortage of slots frees it. Each segment is
still one engine request with its own deadline, audio and t2w stream.

Voices: the default voice clones a reference clip (`default_voice_audio` with
its transcript), else a sentence that piper's built-in voice speaks at load
(voice id "joe": CosyVoice cloning joe, so `voxgate serve --engine cosyvoice`
keeps the server's default voice id), else, without the speaker and speech
tokenizer models, the model's plain voice ("default", cross-lingual mode).
Registered voices compute the x-vector, prompt tokens and prompt mel once
(`make_voice_features`), stored as bytes and restored by `add_voice`.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.backend import Backend, BackendRequest, StepResult, due_of
from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.frontend.frontend import LMInput, Mode
from engine.backends.cosyvoice.frontend.textnorm import resolve_text_frontend
from engine.backends.cosyvoice.frontend.voice_prompts import (
    CosyVoice,
    clone_voice,
    flow_prompt_of,
    from_bytes,
    to_bytes,
)
from engine.backends.cosyvoice.lm.driver import LMStart, SpeechLMDriver, stream_seed
from engine.backends.cosyvoice.loader import LoadedModel, load_model
from engine.backends.cosyvoice.model_dir import LANGUAGES
from engine.backends.cosyvoice.t2w.worker import FlowWorker, HostChunk, chunks_to_host
from engine.errors import (
    BackendFailure,
    EngineBusyError,
    EngineError,
    UnknownVoiceError,
    UnsupportedOptionError,
)
from engine.types import SynthesisRequest, VoiceInfo
from engine.voice_table import VoiceTable

log = logging.getLogger("voxgate.engine")


@dataclass(slots=True)
class CosyState:
    """One request between steps. `tokens`: speech tokens emitted so far (kept for resumption).

    `frontend_work`: the LM input, or the CPU executor's future of it (text
    normalization and tokenization run off the worker thread).
    """

    key: str
    voice: CosyVoice
    frontend_work: LMInput | Future[LMInput]
    deadline: float
    seed: int  # the LM's sampling and the stream's t2w noise; kept across preemption
    is_seeded: bool = False  # the request brought its seed (SamplingParams.seed)
    speed: float = 1.0  # the mel is stretched before the vocoder (t2w/mel_stretch.py)
    tokens: list[int] = field(default_factory=list)
    has_slot: bool = False
    is_lm_done: bool = False
    has_stream: bool = False
    num_samples: int = 0
    context: str = ""  # the request's context key, where its LM sequence may continue
    keeps: bool = False  # its LM stream is parked when it finishes (its context's sequence)
    is_done: bool = False  # its last audio was returned: a release then is not a cancel

    @property
    def lm_input(self) -> LMInput:
        work = self.frontend_work
        return work.result() if isinstance(work, Future) else work

    @property
    def is_input_ready(self) -> bool:
        return not isinstance(self.frontend_work, Future) or self.frontend_work.done()


@dataclass(slots=True)
class ContextLM:
    """A context's LM sequence between its segments (`lm_context="continue"`)."""

    key: str  # the LM stream that holds it: its latest segment's request key
    is_running: bool  # that segment still decodes: the next one waits for it
    signature: tuple[Any, ...]  # what a segment shares to continue it (`_signature`)


class CosyVoiceBackend(Backend):
    name = "cosyvoice"
    can_register_voices = True
    sample_rate = 24000
    needs_transcript = True

    def __init__(self, config: CosyVoiceBackendConfig | None = None) -> None:
        self.config = config or CosyVoiceBackendConfig()
        if self.config.model_dir is None:
            raise ValueError("the cosyvoice engine needs a model directory; expected "
                             "--engine-option model_dir=PATH or VOXGATE_COSYVOICE_MODEL_DIR, got none")
        self.max_batch_size = self.config.batch_size  # 256 on a GPU, 8 on the CPU unless set
        self.model: LoadedModel | None = None
        self.lm: SpeechLMDriver | None = None
        self._default: dict[str, CosyVoice] = {}
        self._registered: VoiceTable[CosyVoice] = VoiceTable()
        self._running: dict[str, CosyState] = {}  # requests holding an LM slot
        self._contexts: dict[str, ContextLM] = {}  # lm_context="continue": each context's sequence
        self.voice_features_version = _features_version(self.config)
        self.num_preemptions = 0
        # the text frontend (normalization, tokenization) runs here, off the engine's worker thread
        self._cpu = ThreadPoolExecutor(self.config.cpu_workers, thread_name_prefix="voxgate-cosyvoice-cpu")
        self.flow_worker: FlowWorker | None = None  # flow + vocoder on their own thread (GPU default)
        self._pending: dict[str, HostChunk] = {}  # chunks computed for requests not in that step's batch

    # -- Backend --------------------------------------------------------------

    def load(self) -> None:
        self.model = load_model(self.config)
        self.lm = self.model.lm
        voice = self.model.default_voice
        self._default = {voice.info.voice_id: voice}
        try:  # the flow's K/V cache: the default voice's prompt now, not with its first stream
            self.model.t2w.prepare_voice(voice.flow)
        except EngineBusyError as exc:
            log.warning("cosyvoice default voice: its prompt is not cached (%s)", exc)
        if self.config.uses_flow_thread:
            self.flow_worker = FlowWorker(self.model.t2w, self.model.device)
        log.info("cosyvoice %d loaded from %s on %s; default voice %r", self.model.version,
                 self.config.model_dir, self.model.device, voice.info.voice_id)

    def voices(self) -> list[VoiceInfo]:
        return [v.info for v in [*self._default.values(), *self._registered.listed()]]

    def get_voice(self, voice_id: str) -> CosyVoice:
        voice = self._default.get(voice_id) or self._registered.get(voice_id)
        if voice is None:
            expected = ", ".join([*self._default, *self._registered.ids()])
            raise UnknownVoiceError(f"unknown voice {voice_id!r}; expected one of: {expected}")
        return voice

    def prepare(self, request: SynthesisRequest) -> BackendRequest:
        model = self._loaded()
        voice = self.get_voice(request.voice)
        if request.instructions and model.version != 3:
            raise UnsupportedOptionError(f"instructions need a CosyVoice 3 model; expected none, "
                                         f"got {request.instructions!r}")
        if request.instructions:
            mode = Mode.INSTRUCT
        elif voice.is_plain or _other_language(request.language, voice.info.language):
            mode = Mode.CROSS_LINGUAL  # the flow keeps the voice; the LM gets no prompt
        else:
            mode = Mode.ZERO_SHOT
        lm_input = self._cpu.submit(model.frontend.lm_input, request.text, voice.prompt, mode,
                                    request.instructions)
        key = str(request.request_id)
        seed = request.params.seed if request.params.seed is not None else stream_seed(key, self.config.seed)
        state = CosyState(key, voice, lm_input, request.deadline, seed, request.params.seed is not None,
                          request.params.speed, context=request.context_key)
        if not request.text.strip():
            state.is_lm_done = True  # nothing to say: finishes empty at its first step
        est = max(0.2, len(request.text.strip()) / self.config.chars_per_second / state.speed)
        return BackendRequest(request=request, state=state, est_audio_s=est)

    def step(self, batch: list[BackendRequest]) -> list[StepResult]:
        model, lm = self._loaded(), self.lm
        assert lm is not None
        results = {id(item): StepResult() for item in batch}
        states: list[tuple[BackendRequest, CosyState]] = []
        for item in batch:
            if isinstance(item.state, CosyState):
                states.append((item, item.state))
            else:
                results[id(item)] = StepResult(is_finished=True, error=BackendFailure(
                    f"expected a prepared cosyvoice request, got {item.state!r}"))
        for item, exc in self._start_streams(states):  # 1. start (or resume) LM streams
            results[id(item)] = StepResult(is_finished=True, error=exc)  # a bad prompt fails only itself
            self.release(item)
        decoding = [s for _, s in states if s.has_slot]
        outputs = lm.step([s.key for s in decoding]) if decoding else {}
        for state in decoding:  # 2. new tokens into the t2w streams
            out = outputs[state.key]
            state.tokens += out.tokens
            if out.tokens:
                model.t2w.feed(state.key, out.tokens)
            if out.is_finished:
                state.has_slot, state.is_lm_done = False, True
                self._running.pop(state.key, None)
                self._park(state)
                if state.tokens:  # a context's segment keeps its flow for the next (t2w/streams.py)
                    model.t2w.finish(state.key, keep=state.keeps)
                else:  # stopped before its first token: no audio at all
                    model.t2w.drop(state.key)
                    state.has_stream = False
        for done in self._flow(states, is_idle=not decoding):  # 3. flow + HiFT, batched
            self._pending[done.stream_id] = done
        for item, state in states:  # 4. results
            if results[id(item)].error is not None:
                continue
            chunk = self._pending.pop(state.key, None)
            if chunk is not None:
                state.num_samples += len(chunk.pcm)
                results[id(item)] = StepResult(pcm=chunk.pcm, is_finished=chunk.is_final)
            elif state.is_lm_done and not state.has_stream:
                results[id(item)] = StepResult(is_finished=True)  # nothing was spoken
            state.is_done = results[id(item)].is_finished
        return [results[id(item)] for item in batch]

    def release(self, item: BackendRequest) -> None:
        state = item.state
        if isinstance(state, CosyState) and self.model is not None and self.lm is not None:
            ctx = self._contexts.get(state.context) if state.context else None
            if ctx is not None and not state.is_done:  # a cancel: the context will not go on
                self._end_context(state.context)
                self.lm.stop(state.key)
            elif ctx is None or ctx.key != state.key:
                self.lm.stop(state.key)
            # else: its finished stream (LM and flow) stays parked for the context's next segment
            if ctx is None or ctx.key != state.key or not state.is_done:
                self.model.t2w.drop(state.key)
            self._pending.pop(state.key, None)
            self._running.pop(state.key, None)
            state.has_slot = state.has_stream = False
            state.is_lm_done = True
        item.state = None

    def context_capacity(self) -> int:
        """Contexts the memory holds: the LM's slots (a context decodes in one at a time; its parked
        sequence gives way to new streams), and with the flow's K/V cache the streams it holds (a
        context's flow stream lives while its audio is made). 0 before load."""
        if self.model is None:
            return 0
        slots = self.config.num_streams
        flow = self.flow_cache_info().get("stream_capacity")  # the cache's own lock: safe off the worker
        return min(slots, int(flow)) if flow else slots

    def end_context(self, context_key: str) -> None:
        """The context ended (its turn is over or cancelled): free its parked LM sequence."""
        if self.lm is not None:
            self._end_context(context_key)

    def _end_context(self, name: str) -> None:
        assert self.lm is not None
        ctx = self._contexts.pop(name, None)
        if ctx is not None and not ctx.is_running:  # a running one is its request's to stop
            self.lm.stop(ctx.key)
        if ctx is not None and self.model is not None:  # its flow: freed once its last chunk is out
            self.model.t2w.unpark(ctx.key)

    def _park(self, state: CosyState) -> None:
        """A context's segment finished decoding: its stream is parked (driver) for the next one."""
        ctx = self._contexts.get(state.context) if state.context else None
        if ctx is not None and ctx.key == state.key:
            ctx.is_running = False
        elif state.keeps and self.lm is not None:  # its context ended meanwhile: nothing follows
            self.lm.stop(state.key)
            state.keeps = False

    # -- registered voices ----------------------------------------------------

    def voice_features_executor(self) -> ThreadPoolExecutor:
        # Cloning reads only the frontend's ONNX sessions and the mel filter (no stream state),
        # so it runs on the CPU executor beside the steps, not on the GPU worker (issue 19, item 5).
        return self._cpu

    def make_voice_features(self, audio: np.ndarray, sample_rate: int, transcript: str) -> bytes | None:
        model = self._loaded()
        return to_bytes(clone_voice(model.frontend, model.mel, audio, sample_rate, transcript))

    def add_voice(self, voice_id: str, features: bytes | None, meta: dict[str, Any]) -> VoiceInfo:
        model = self._loaded()
        if features is None:
            raise ValueError("expected cosyvoice voice features (a cloned reference), got none")
        if voice_id in self._default:
            raise EngineError(f"voice id {voice_id!r} names the built-in cosyvoice voice")
        prompt = from_bytes(features, model.version)
        info = VoiceInfo(voice_id=voice_id, name=str(meta.get("name") or voice_id),
                         language=str(meta.get("language") or self.config.default_voice_language),
                         backend=self.name, sample_rate=self.sample_rate, is_builtin=False,
                         supports_instructions=model.version == 3,
                         languages=LANGUAGES[model.version])  # a clone speaks them all
        self._registered.add(voice_id, CosyVoice(info, prompt, flow_prompt_of(prompt, model.device)))
        return info

    def retire_voice(self, voice_id: str) -> None:
        self._registered.retire(voice_id)

    def remove_voice(self, voice_id: str) -> None:
        # prepared requests hold their CosyVoice: they finish with it
        voice = self._registered.get(voice_id)
        self._registered.remove(voice_id)
        if voice is not None and self.model is not None:
            self.model.t2w.forget_voice(voice.flow)  # its cached prompt, once no stream speaks with it

    # -- capacity (the flow's K/V cache) --------------------------------------

    def can_admit(self, voice_id: str | None = None) -> bool:
        """Whether the flow's K/V cache holds one more stream now (of `voice_id`, default: the
        default voice): the engine refuses a new context as busy when it does not. Thread-safe."""
        if self.model is None:
            return True
        voices = [*self._default.values()] if not voice_id else [
            v for v in (self._default.get(voice_id), self._registered.get(voice_id)) if v is not None]
        # an unknown voice is admitted: its request fails as unknown_voice, not busy
        return not voices or self.model.t2w.can_add_stream(voices[0].flow)

    def flow_cache_info(self) -> dict[str, float]:
        """The cache's figures (GiB a stream, in use, in all; `stream_capacity`: streams it holds
        now plus how many more fit); empty without the cache."""
        cached = self.model.t2w.cached if self.model is not None else None
        return cached.cache.info() if cached is not None else {}

    # -- internals ------------------------------------------------------------

    def _loaded(self) -> LoadedModel:
        if self.model is None:
            raise EngineError("cosyvoice backend is not loaded; expected load() before use")
        return self.model

    def close(self) -> None:
        """Stop the flow thread and the CPU executor (the process is ending)."""
        if self.flow_worker is not None:
            self.flow_worker.close()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    def _flow(self, states: list[tuple[BackendRequest, CosyState]], is_idle: bool) -> list[HostChunk]:
        """The batch's ready chunks, the most starved first, at most `flow_streams` per flow call.

        Serial (the CPU default): computed now. With the flow thread: the chunks of
        the batch in flight when it is done (waited for when the LM had nothing to
        do this step, so an idle step never spins), and the next batch submitted
        at once, so it computes while the LM decodes its next step.
        """
        model = self._loaded()
        ready = set(model.t2w.ready())
        due = sorted((due_of(item), i, s.key)
                     for i, (item, s) in enumerate(states) if s.key in ready)
        keys = [key for _, _, key in due[:self.config.flow_streams]]
        worker = self.flow_worker
        if worker is None:
            return chunks_to_host(model.t2w.run(keys)) if keys else []
        chunks = worker.collect(wait=is_idle and worker.is_busy)
        if not worker.is_busy:
            ready = set(model.t2w.ready())  # what the collected batch just moved on
            keys = [key for key in keys if key in ready]
            if keys:
                worker.submit(keys)
        return chunks

    def _start_streams(self, states: list[tuple[BackendRequest, CosyState]]
                       ) -> list[tuple[BackendRequest, Exception]]:
        """Prefill the LM streams of the batch's new (or preempted) requests in one call.

        When slots run short, holders that are not in this batch give theirs up,
        the one due last first; they resume later from their tokens.
        """
        model, lm = self._loaded(), self.lm
        assert lm is not None
        waiting = [(item, s) for item, s in states if not s.has_slot and not s.is_lm_done]
        # The text frontend ran on the CPU executor since `prepare` (beside the steps before
        # this one); what is not done yet is waited for, so a request starts at the same step
        # it would have inline.
        errors: list[tuple[BackendRequest, Exception]] = []
        ready: list[tuple[BackendRequest, CosyState]] = []
        for item, s in waiting:
            try:
                s.lm_input  # noqa: B018 - waits for the frontend and raises its error, if any
            except (ValueError, EngineError) as exc:
                errors.append((item, exc))
                continue
            ready.append((item, s))
        waiting = self._in_context_order(ready)
        # streams the flow's cache cannot hold now wait (a context's next segment while its last
        # one's chunks are still computed, say); the engine's admission (`can_admit`) keeps it short
        new = [s for _, s in waiting if not s.has_stream]
        held = {s.key for s in new[:model.t2w.num_can_add([s.voice.flow for s in new])]}
        waiting = [(item, s) for item, s in waiting if s.has_stream or s.key in held]
        if not waiting:
            return errors
        starts = {s.key: self._lm_start(s) for _, s in waiting}
        continuing = {start.follows for start in starts.values() if start.follows is not None}
        fresh = [(item, s) for item, s in waiting if starts[s.key].follows is None]
        # Slots for the fresh streams: parked sequences not continued now go first (least
        # recently parked first), then running holders not in this batch (due last first).
        for key in lm.parked():
            if lm.num_free >= len(fresh):
                break
            if key not in continuing:
                self._evict(key)
        in_batch = {s.key for _, s in states}
        idle = sorted((s for k, s in self._running.items() if k not in in_batch),
                      key=lambda s: s.deadline, reverse=True)
        while lm.num_free < len(fresh) and idle:
            victim = idle.pop(0)
            self._preempt(victim)
        fits = {s.key for _, s in fresh[:lm.num_free]}  # the fresh streams beyond wait for a later step
        waiting = [(item, s) for item, s in waiting if starts[s.key].follows is not None or s.key in fits]
        failed = lm.start([starts[s.key] for _, s in waiting])
        for item, state in waiting:
            start = starts[state.key]
            if state.key in failed:
                errors.append((item, failed[state.key]))
                if start.follows is not None:
                    self._end_context(state.context)  # its sequence was freed with it (its flow too)
                continue
            state.has_slot = True
            self._running[state.key] = state
            state.keeps = start.keep
            if start.keep:
                self._contexts[state.context] = ContextLM(state.key, True, _signature(state))
            if not state.has_stream:
                try:
                    model.t2w.add_stream(state.key, state.voice.flow, seed=state.seed, speed=state.speed,
                                         follows=start.follows)  # a context's flow goes on (K/V cache)
                except EngineBusyError as exc:  # the flow's cache is full: refused, never out of memory
                    errors.append((item, exc))
                    continue
                state.has_stream = True
        return errors

    def _in_context_order(self, ready: list[tuple[BackendRequest, CosyState]]
                          ) -> list[tuple[BackendRequest, CosyState]]:
        """The requests that may start now, earliest due first: with `lm_context="continue"`, a
        context's segment waits while the segment before it still decodes, and one segment of
        a context starts per step (the next continues it once it has finished)."""
        ready = sorted(ready, key=lambda pair: due_of(pair[0]))
        if not self._continues():
            return ready
        out: list[tuple[BackendRequest, CosyState]] = []
        starting: set[str] = set()
        for item, s in ready:
            ctx = self._contexts.get(s.context) if s.context else None
            if s.context and not s.tokens and (s.context in starting or (ctx is not None and ctx.is_running)):
                continue  # a resumed segment (it has tokens) never waits: it started before
            if s.context:
                starting.add(s.context)
            out.append((item, s))
        return out

    def _continues(self) -> bool:
        return self.config.lm_context == "continue" and self.lm is not None and self.lm.can_continue

    def _lm_start(self, s: CosyState) -> LMStart:
        """How `s` starts: afresh, resumed (its tokens after its prompt), or continuing its context."""
        is_greedy = self.config.sampling == "greedy"
        start = LMStart(s.key, s.lm_input, is_greedy, s.tokens, s.seed, s.is_seeded)
        if not (self._continues() and s.context and not s.tokens):  # a resumed stream starts alone
            return start
        start.keep = True
        ctx = self._contexts.get(s.context)
        if ctx is not None and ctx.signature == _signature(s):
            start.follows = ctx.key
        elif ctx is not None:  # another voice or mode: its sequence cannot go on
            self._end_context(s.context)
        return start

    def _evict(self, key: str) -> None:
        """Free a parked sequence for a fresh stream's slot; its context's next segment starts afresh."""
        assert self.lm is not None
        self.lm.stop(key)
        if self.model is not None:
            self.model.t2w.unpark(key)
        for name, ctx in list(self._contexts.items()):
            if ctx.key == key:
                del self._contexts[name]

    def _preempt(self, victim: CosyState) -> None:
        """Take a running stream's slot; it resumes later from its tokens, alone (not continued)."""
        assert self.lm is not None
        self.lm.stop(victim.key)
        victim.has_slot = False
        self._running.pop(victim.key)
        self.num_preemptions += 1
        ctx = self._contexts.get(victim.context) if victim.context else None
        if ctx is not None and ctx.key == victim.key:
            del self._contexts[victim.context]
        victim.keeps = False


def _signature(s: CosyState) -> tuple[Any, ...]:
    """What a context's segments share to continue one sequence: the voice and the LM's prompt
    (mode, instructions)."""
    ids = s.lm_input
    return (id(s.voice), tuple(ids.prompt_text_ids), len(ids.prompt_speech_tokens), ids.num_prefix_ids)


def _other_language(requested: str | None, spoken: str) -> bool:
    if not requested or not spoken:
        return False
    return requested.replace("_", "-").split("-")[0].lower() != spoken.split("-")[0].lower()


def _features_version(config: CosyVoiceBackendConfig) -> str:
    """Names what voice features depend on: the frontend models' bytes, the tokenizer and text
    normalization (the transcript's ids).

    The files are hashed whole, not named by their size: a re-exported or fine-tuned
    speaker or speech-token model of the same size makes different features, and stored
    voices must then be recomputed (docs/voices.md). Hashing reads them once per start,
    about a second for the largest (a speech tokenizer of a few hundred MB)."""
    root = config.model_dir
    digest = hashlib.sha256(f"{config.tokenizer}:{resolve_text_frontend(config.text_frontend)}".encode())
    if root is not None:
        for name in ("campplus.onnx", "speech_tokenizer_v2.onnx", "speech_tokenizer_v3.onnx",
                     "cosyvoice2.yaml", "cosyvoice3.yaml", "CosyVoice-BlankEN/vocab.json",
                     "CosyVoice-BlankEN/tokenizer.json"):
            path = root / name
            if path.is_file():
                digest.update(f"{name}:".encode())
                with path.open("rb") as file:
                    while block := file.read(1 << 20):
                        digest.update(block)
    return f"cosyvoice-{digest.hexdigest()[:16]}"
