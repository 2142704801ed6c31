"""The cosyvoice backend: CosyVoice 2/3 behind the engine's `Backend` interface.

Shaped as nano-vllm is (docs/cosyvoice-design.md, "Backend design"): one
sequence table holds every request's stream (sequences.py), a pure scheduler
decides each tick from it (scheduler.py), and the runs only carry the plan
out (tick.py). One `step` is

1. plan: the batch's sequences (their due times the engine's `due_of`) ->
   which start in an LM slot, which holders outside the batch give theirs
   up, which wait for room (reported, never held silently);
2. LM run: one batched prefill for the starts, then one batched decode step
   for every slot holder of the batch: one speech token each, fed into its
   token-to-wave stream (t2w/streams.py);
3. token-to-wave run: the flow rows of the tick (every stream with a chunk
   ready, the earliest due first, capped), flow matching then HiFT, on the
   flow thread on a GPU (t2w/worker.py); each chunk's audio goes to its
   sequence's outbox;
4. results: per request this tick's audio (often none), `is_finished` with
   its last, or why it waited.

`release` (finished or cancelled) takes the sequence out of the table and
frees what its state holds, its LM slot and its flow stream with its cache
blocks, so a cancelled request yields nothing more. `close` stops the flow
thread, the CPU executor and the LM driver's own threads (vLLM's).

Voices: the default voice clones a reference clip (`default_voice_audio` with
its transcript), else a sentence that piper's built-in voice speaks at load
(voice id "joe": CosyVoice cloning joe, so `voxgate serve --engine cosyvoice`
keeps the server's default voice id), else, without the speaker and speech
tokenizer models, the model's plain voice ("default", cross-lingual mode).
Registered voices compute the x-vector, prompt tokens and prompt mel once
(`make_voice_features`), stored as bytes and restored by `add_voice` (voices.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from engine.backend import Backend, BackendRequest, StepResult, due_of
from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.frontend.frontend import Mode
from engine.backends.cosyvoice.frontend.voice_prompts import CosyVoice, clone_voice, to_bytes
from engine.backends.cosyvoice.lm.driver import SpeechLMDriver, stream_seed
from engine.backends.cosyvoice.loader import LoadedModel, has_cuda, load_model
from engine.backends.cosyvoice.scheduler import plan_flow, plan_lm
from engine.backends.cosyvoice.sequences import SeqState, Sequence, SequenceTable
from engine.backends.cosyvoice.t2w.worker import FlowWorker
from engine.backends.cosyvoice.tick import SeqInputs, inputs_of, run_flow, run_lm
from engine.backends.cosyvoice.voices import SAMPLE_RATE, CosyVoices, features_version
from engine.errors import BackendFailure, EngineBusyError, EngineError, UnsupportedOptionError
from engine.types import SynthesisRequest, VoiceInfo, estimate_audio_s

log = logging.getLogger("voxgate.engine")

#: seconds of audio a speech token makes at speed 1 (25 tokens a second)
TOKEN_S = 0.04


class CosyVoiceBackend(Backend):
    name = "cosyvoice"
    can_register_voices = True
    sample_rate = SAMPLE_RATE
    needs_transcript = True

    def __init__(self, config: CosyVoiceBackendConfig | None = None) -> None:
        self.config = config or CosyVoiceBackendConfig()
        if self.config.model_dir is None:
            raise ValueError("the cosyvoice engine needs a model directory; expected "
                             "--engine-option model_dir=PATH or VOXGATE_COSYVOICE_MODEL_DIR, "
                             "got none")
        self.resolved = self.config.resolve(has_cuda())  # every "auto" decided once, here
        self.max_batch_size = self.resolved.batch_size  # 256 on a GPU, 8 on the CPU unless set
        self.model: LoadedModel | None = None
        self.lm: SpeechLMDriver | None = None
        self.voice_book = CosyVoices()
        self.table = SequenceTable()
        self._items: dict[str, BackendRequest] = {}  # each sequence's request: its due, every tick
        self.voice_features_version = features_version(self.config)
        self.num_preemptions = 0
        # the text frontend (normalization, tokenization) runs here, off the engine's worker thread
        self._cpu = ThreadPoolExecutor(self.config.cpu_workers,
                                       thread_name_prefix="voxgate-cosyvoice-cpu")
        # flow + vocoder on their own thread (GPU default)
        self.flow_worker: FlowWorker | None = None

    # -- Backend --------------------------------------------------------------

    def load(self) -> None:
        self.model = load_model(self.config, self.resolved)
        self.lm = self.model.lm
        voice = self.model.default_voice
        self.voice_book.set_default(voice)
        try:  # the flow's K/V cache: the default voice's prompt now, not with its first stream
            self.model.t2w.prepare_voice(voice.flow)
        except EngineBusyError as exc:
            log.warning("cosyvoice default voice: its prompt is not cached (%s)", exc)
        if self.resolved.uses_flow_thread:
            self.flow_worker = FlowWorker(self.model.t2w, self.model.device)
        log.info("cosyvoice %d loaded from %s on %s; default voice %r; %s", self.model.version,
                 self.config.model_dir, self.model.device, voice.info.voice_id, self.resolved)

    def close(self) -> None:
        """Stop the flow thread, the CPU executor and the LM driver (vLLM's loop and engine)."""
        if self.flow_worker is not None:
            self.flow_worker.close()
        self._cpu.shutdown(wait=True, cancel_futures=True)
        if self.lm is not None:
            self.lm.close()

    def voices(self) -> list[VoiceInfo]:
        return self.voice_book.listed()

    def prepare(self, request: SynthesisRequest) -> BackendRequest:
        model = self._loaded()
        voice = self.voice_book.get(request.voice)
        if request.instructions and model.version != 3:
            raise UnsupportedOptionError(f"instructions need a CosyVoice 3 model; expected none, "
                                         f"got {request.instructions!r}")
        if request.instructions:
            mode = Mode.INSTRUCT
        elif voice.is_plain or _other_language(request.language, voice.info.language):
            mode = Mode.CROSS_LINGUAL  # the flow keeps the voice; the LM gets no prompt
        else:
            mode = Mode.ZERO_SHOT
        key = str(request.request_id)
        if key in self.table:
            raise EngineError(f"expected a new request id, got {key!r} (already prepared)")
        work = self._cpu.submit(model.frontend.lm_input, request.text, voice.prompt, mode,
                                request.instructions)
        params = request.params
        seed = params.seed if params.seed is not None else stream_seed(key, self.config.seed)
        seq = Sequence(key, seed, SeqInputs(voice, work, params.speed, params.seed is not None))
        if not request.text.strip():
            seq.state = SeqState.DONE  # nothing to say: finishes empty at its first step
        self.table.add(seq)
        est = max(0.2, estimate_audio_s(request.text.strip(), params.speed,
                                        1.0 / self.config.chars_per_second))
        item = BackendRequest(request=request, state=seq, est_audio_s=est)
        self._items[key] = item
        return item

    def step(self, batch: list[BackendRequest]) -> list[StepResult]:
        model, lm = self._loaded(), self.lm
        assert lm is not None
        for held in self._items.values():  # urgency as the engine sees it now, every sequence
            if isinstance(held.state, Sequence):
                held.state.due = due_of(held)
        results: dict[int, StepResult] = {}
        seqs: list[tuple[BackendRequest, Sequence]] = []
        for item in batch:
            seq = item.state
            if isinstance(seq, Sequence) and self.table.get(seq.key) is seq:
                seqs.append((item, seq))
            else:
                results[id(item)] = StepResult(is_finished=True, error=BackendFailure(
                    f"expected a prepared cosyvoice request, got {seq!r}"))
        errors = _frontend_errors([seq for _, seq in seqs])
        live = [seq for _, seq in seqs if seq.key not in errors]
        plan = plan_lm(self.table, live, lm.num_free, self._num_flows_fit)  # 1. plan
        self.num_preemptions += len(plan.preempt)
        is_greedy = self.config.sampling == "greedy"
        errors.update(run_lm(plan, self.table, lm, model.t2w, is_greedy))  # 2. LM run
        run_flow(self.table, model.t2w, self.flow_worker, self._plan_flow,  # 3. token to wave
                 wait=not plan.decode)
        for item, seq in seqs:  # 4. results
            if seq.key in errors:  # a bad prompt, a refused stream: fails only its own request
                results[id(item)] = StepResult(is_finished=True, error=errors[seq.key])
                self.release(item)
            elif seq.key in plan.waiting and not seq.outbox:  # audio made meanwhile goes out
                results[id(item)] = StepResult(waiting=plan.waiting[seq.key].value)
            else:
                if seq.state in (SeqState.FLUSHING, SeqState.DONE):  # the LM ended: the length
                    # is known, so the next segment's due follows it, not the guess at prepare
                    item.est_audio_s = len(seq.tokens) * TOKEN_S / inputs_of(seq).speed
                results[id(item)] = StepResult(pcm=seq.take_audio(),
                                               is_finished=seq.state is SeqState.DONE)
        return [results[id(item)] for item in batch]

    def _plan_flow(self, ready: list[str]) -> list[str]:
        """The rows of the tick starting now (the dues are the engine's monotonic clock)."""
        config = self.config
        horizon = time.monotonic() + config.flow_horizon_s if config.flow_horizon_s else None
        return plan_flow(self.table, ready, self.resolved.flow_streams, horizon=horizon,
                         min_rows=config.flow_min_rows)

    def release(self, item: BackendRequest) -> None:
        seq = item.state
        if isinstance(seq, Sequence):
            self._items.pop(seq.key, None)
            if self.table.get(seq.key) is seq:
                self.table.remove(seq.key)
                if seq.holds_slot and self.lm is not None:
                    self.lm.stop(seq.key)
                if seq.holds_flow and self.model is not None:
                    # its cache blocks: now, or when a chunk of it in flight ends
                    self.model.t2w.drop(seq.key)
            work = inputs_of(seq).frontend_work
            if isinstance(work, Future):  # still queued on the CPU executor: not run for nothing
                work.cancel()
        item.state = None

    def context_capacity(self) -> int:
        """Contexts the sequence table holds at once: the LM's slots, and with the flow's K/V cache
        the streams it holds (a stream lives while its audio is made). 0 before load."""
        if self.model is None:
            return 0
        slots = self.resolved.num_streams
        # the cache's own lock: safe off the worker
        flow = self.flow_cache_info().get("stream_capacity")
        return min(slots, int(flow)) if flow else slots

    def flow_cache_info(self) -> dict[str, float]:
        """The cache's figures (GiB a stream, in use, in all; `stream_capacity`: streams it holds
        now plus how many more fit); empty without the cache."""
        cached = self.model.t2w.cached if self.model is not None else None
        return cached.cache.info() if cached is not None else {}

    # -- registered voices ----------------------------------------------------

    def get_voice(self, voice_id: str) -> CosyVoice:
        return self.voice_book.get(voice_id)

    def voice_features_executor(self) -> ThreadPoolExecutor:
        # Cloning reads only the frontend's ONNX sessions and the mel filter (no stream state),
        # so it runs on the CPU executor beside the steps, not on the GPU worker.
        return self._cpu

    def make_voice_features(self, audio: np.ndarray, sample_rate: int,
                            transcript: str) -> bytes | None:
        model = self._loaded()
        return to_bytes(clone_voice(model.frontend, model.mel, audio, sample_rate, transcript))

    def add_voice(self, voice_id: str, features: bytes | None, meta: dict[str, Any]) -> VoiceInfo:
        return self.voice_book.add(self._loaded(), voice_id, features, meta,
                                   self.config.default_voice_language)

    def retire_voice(self, voice_id: str) -> None:
        self.voice_book.retire(voice_id)

    def remove_voice(self, voice_id: str) -> None:
        self.voice_book.remove(voice_id, self.model)

    # -- internals ------------------------------------------------------------

    def _loaded(self) -> LoadedModel:
        if self.model is None:
            raise EngineError("cosyvoice backend is not loaded; expected load() before use")
        return self.model

    def _num_flows_fit(self, seqs: list[Sequence]) -> int:
        """How many of these new sequences' flow streams the K/V cache holds together now."""
        return self._loaded().t2w.num_can_add([inputs_of(s).voice.flow for s in seqs])


def _frontend_errors(seqs: list[Sequence]) -> dict[str, Exception]:
    """The new sequences whose LM input failed. The text frontend ran on the CPU executor since
    `prepare` (beside the steps before this one); what is not done yet is waited for, so a
    request starts at the same step it would have inline."""
    errors: dict[str, Exception] = {}
    for seq in seqs:
        if seq.state is not SeqState.WAITING:
            continue
        try:
            inputs_of(seq).lm_input  # noqa: B018 - waits for the frontend; raises its error
        except (ValueError, EngineError) as exc:
            errors[seq.key] = exc
    return errors


def _other_language(requested: str | None, spoken: str) -> bool:
    if not requested or not spoken:
        return False
    return requested.replace("_", "-").split("-")[0].lower() != spoken.split("-")[0].lower()
