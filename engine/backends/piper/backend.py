"""The piper backend: Piper VITS voices on onnxruntime, streamed in decoder windows.

Each voice's graph is split at its flow and decoder (graphs/split.py): a
segment's first step runs its text part (encoder, durations, prior) once, the
flow over the frames the first window needs, and decodes that window; later
steps decode the next windows (the flow runs 256 frames ahead of them at a
time; windows.py). Window sizes follow the playback clock and the engine's
plan for the step (`StepPlan`, mapped onto a `Pace` by plan.py's
`PacePolicy`): a segment due now on a box that keeps up gets a small first
window and the flow slice (first audio soon; a smaller one, its front part
on threads that spin while it runs, when its session is the only one
talking: `Pace.LONE`); one with lead, or whose listener already waits, gets
long windows and the flow in long pieces (more audio per second of work).
The backend never counts lanes or sessions itself: the engine knows what
runs beside each step and says so. So the engine's unit of work is a
window, a cancel stops a segment within one window, and a new turn's first
audio waits behind one window (the engine runs one window per core side by
side: lanes, `concurrent_steps`).
Durations, word timings and the segment's length are known after the front
part and travel with the first window; one fixed gain per voice is applied
to every window, and windows with their context equal the whole decode.

A voice that cannot be split (`windowed=False`, or an unknown graph) is
synthesized whole, one segment per item per step, as follows. Items that share a voice and synthesis
scales (and, by default, are of equal length: `max_padding_waste`) run in
ONE onnxruntime call: phoneme ids padded to the longest item, `input_lengths`
per item. The model masks the padding, but its vocoder still
writes audio past each item's end (convolution biases over the masked frames),
so every item is cut to its true length, sum(durations) * hop_length, from the
duration output that the loader patches into the graph. The same durations
give the word timings (alignment.py).

Loudness: piper's own `synthesize` peak-normalizes each sentence, which makes
consecutive segments of one turn jump in level. We apply one fixed gain per
voice instead, measured once at load on a reference sentence (`target_peak`),
and clip to [-1, 1].

`SamplingParams.seed` is not honoured: the exported graph draws its noise with
onnxruntime's RandomNormalLike, which takes no per-call seed. With both noise
scales at 0 the output is deterministic.

Registered reference voices (docs/voices.md): piper cannot clone a voice from
reference audio, so a registered voice computes no features and speaks with an
installed base voice (`meta["base_voice"]`, the server's default voice unless
the registration names another). It is a named alias with its own listing.

This module owns the backend itself: voices, prepare, and how a step's items
are split into onnxruntime calls and run. Its options are in config.py, a
segment's state and the finishing of its output in segment.py, the window
sizes and paces in plan.py, a windowed segment's run in windows.py.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from engine.backend import Backend, BackendRequest, StepResult, plan_of
from engine.backends.piper.alignment import align_words
from engine.backends.piper.config import PiperBackendConfig
from engine.backends.piper.loader import (
    DEFAULT_VOICE_ID,
    LoadedVoice,
    VoiceFiles,
    default_voice_files,
    discover_voices,
    load_voice,
)
from engine.backends.piper.segment import PiperState, finish_segment, silent_result, to_engine_rate
from engine.backends.piper.windows import run_window
from engine.errors import (
    BackendFailure,
    EngineError,
    UnknownVoiceError,
    UnsupportedOptionError,
)
from engine.types import SynthesisRequest, VoiceInfo
from engine.voice_table import VoiceTable

logger = logging.getLogger("voxgate.engine")


def pack_by_length(lengths: list[int], max_waste: float | None) -> list[list[int]]:
    """Split items (by index) into calls whose padding stays within `max_waste`.

    Longest first, greedily: an item joins the current call while
    count * longest <= (1 + max_waste) * sum of lengths.
    """
    if max_waste is None:
        return [list(range(len(lengths)))] if lengths else []
    calls: list[list[int]] = []
    total = longest = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        if calls and (len(calls[-1]) + 1) * longest <= (1 + max_waste) * (total + length):
            calls[-1].append(index)
            total += length
        else:
            calls.append([index])
            total = longest = length
    return calls


class PiperBackend(Backend):
    """Piper voices through onnxruntime; one step finishes every segment of its batch."""

    name = "piper"
    can_register_voices = True

    def __init__(self, config: PiperBackendConfig | None = None) -> None:
        self.config = config or PiperBackendConfig()
        self.max_batch_size = self.config.max_batch_size
        files = [default_voice_files()]
        if self.config.voices_dir is not None:
            files.extend(discover_voices(self.config.voices_dir))
        self._files: dict[str, VoiceFiles] = {}
        for entry in files:
            if entry.voice_id in self._files:
                logger.warning("piper voice id %r appears twice; keeping the first", entry.voice_id)
                continue
            self._files[entry.voice_id] = entry
        self._aliases = {alias: f.voice_id for f in self._files.values() for alias in f.aliases}
        self._voices: dict[str, LoadedVoice] = {}
        # Registered voices: id -> (listing, id of the installed voice that speaks for it).
        self._registered: VoiceTable[tuple[VoiceInfo, str]] = VoiceTable()
        self.sample_rate = 22050
        self.parallelism = self.config.num_parallel_calls
        # One call per item: a bigger batch only makes a longer step (a new turn's first
        # window would wait behind it), never a cheaper one.
        self.serial_items = self.config.one_call_per_item
        # Calls share no state: the engine runs `parallelism` steps side by side (lanes).
        self.concurrent_steps = self.config.one_call_per_item
        # A step of work due within this makes the steps started beside it contended
        # (`StepPlan.is_contended`): they take no short windows.
        self.busy_lead_s = self.config.window_busy_lead_s
        self._plan = self.config.window_plan
        self._policy = self.config.pace_policy
        self._pool = (ThreadPoolExecutor(self.config.num_parallel_calls,
                                         thread_name_prefix="voxgate-piper")
                      if self.config.num_parallel_calls > 1 else None)

    # -- Backend --------------------------------------------------------------

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def load(self) -> None:
        voices: dict[str, LoadedVoice] = {}
        for voice_id, entry in self._files.items():
            voice = load_voice(entry, self.config.num_threads, self.config.target_peak)
            if entry.is_builtin:
                self.sample_rate = voice.info.sample_rate
            voices[voice_id] = voice
        for voice_id, voice in voices.items():
            # StepResult carries no rate: a voice of another rate is resampled (to_engine_rate).
            if voice.info.sample_rate != self.sample_rate:
                logger.info("piper voice %r speaks at %d Hz: resampled to %d", voice_id,
                            voice.info.sample_rate, self.sample_rate)
        self._voices = voices
        logger.info("piper backend loaded voices: %s", ", ".join(voices))

    def voices(self) -> list[VoiceInfo]:
        installed = [voice.info for voice in self._voices.values()]
        return installed + [info for info, _ in self._registered.listed()]

    def get_voice(self, voice_id: str) -> LoadedVoice:
        """A loaded voice by id or alias; raises UnknownVoiceError."""
        if not self._voices:
            raise EngineError("piper backend is not loaded; expected load() before prepare()")
        voice = self._voices.get(self._aliases.get(voice_id, voice_id))
        if voice is None:
            entry = self._registered.get(voice_id)
            voice = None if entry is None else self._voices.get(entry[1])
        if voice is None:
            expected = ", ".join([*self._voices, *self._registered.ids()])
            raise UnknownVoiceError(f"unknown voice {voice_id!r}; expected one of: {expected}")
        return voice

    def add_voice(self, voice_id: str, features: bytes | None, meta: dict[str, Any]) -> VoiceInfo:
        if features is not None:
            raise ValueError(
                f"piper voices take no prompt features; expected None, got {len(features)} bytes"
            )
        if voice_id in self._files or voice_id in self._aliases:
            raise EngineError(f"voice id {voice_id!r} names an installed piper voice")
        base = self.get_voice(str(meta.get("base_voice") or DEFAULT_VOICE_ID))
        info = VoiceInfo(
            voice_id=voice_id,
            name=str(meta.get("name") or voice_id),
            language=base.info.language,  # piper speaks its base voice's language
            languages=base.info.languages,
            backend=self.name,
            sample_rate=self.sample_rate,
            is_builtin=False,
        )
        self._registered.add(voice_id, (info, base.info.voice_id))
        return info

    def retire_voice(self, voice_id: str) -> None:
        self._registered.retire(voice_id)

    def remove_voice(self, voice_id: str) -> None:
        # Prepared requests hold their LoadedVoice: they finish with it.
        self._registered.remove(voice_id)

    def get_files(self, voice_id: str) -> VoiceFiles:
        """Where a known voice (loaded or not) lives on disk; raises UnknownVoiceError."""
        files = self._files.get(self._aliases.get(voice_id, voice_id))
        if files is None:
            expected = ", ".join(self._files)
            raise UnknownVoiceError(f"unknown voice {voice_id!r}; expected one of: {expected}")
        return files

    def prepare(self, request: SynthesisRequest) -> BackendRequest:
        voice = self.get_voice(request.voice)
        if request.instructions:
            raise UnsupportedOptionError(
                f"piper voices take no instructions; expected none, got {request.instructions!r}"
            )
        self._check_language(voice, request.language)
        params = request.params
        config = voice.config
        noise_scale = config.noise_scale if params.noise_scale is None else params.noise_scale
        noise_w = config.noise_w_scale if params.noise_w_scale is None else params.noise_w_scale
        length_scale = config.length_scale / params.speed
        phonemes = voice.phonemize(request.text)
        ids, id_spans = voice.phonemes_to_ids(phonemes)
        words = request.text.split()
        word_spans = align_words([voice.phonemize_word(w) for w in words], phonemes)
        state = PiperState(
            voice,
            phonemes,
            ids,
            id_spans,
            words,
            word_spans,
            (float(noise_scale), float(length_scale), float(noise_w)),
        )
        est = 0.0
        if phonemes:
            est = voice.sec_overhead + len(phonemes) * voice.sec_per_phoneme
            est *= length_scale / config.length_scale
        return BackendRequest(request=request, state=state, est_audio_s=est)

    def step(self, batch: list[BackendRequest]) -> list[StepResult]:
        results: list[StepResult | None] = [None] * len(batch)
        groups: dict[tuple[str, tuple[float, float, float]], list[int]] = {}
        windowed: list[int] = []
        for index, item in enumerate(batch):
            state = item.state
            if not isinstance(state, PiperState):
                results[index] = StepResult(
                    is_finished=True,
                    error=BackendFailure(f"expected a prepared piper request, got {state!r}"),
                )
            elif not state.phonemes:
                # nothing speakable
                results[index] = silent_result(state, state.voice.config.sample_rate)
            elif self.config.windowed and state.voice.is_split:
                windowed.append(index)
            else:
                key = (state.voice.info.voice_id, state.scales)
                groups.setdefault(key, []).append(index)
        calls: list[list[int]] = [[index] for index in windowed]
        for group in groups.values():
            lengths = [len(batch[i].state.ids) for i in group]
            if self.config.one_call_per_item:
                calls += [[index] for index in group]
            else:
                calls += [[group[k] for k in call]
                          for call in pack_by_length(lengths, self.config.max_padding_waste)]
        # onnxruntime releases the GIL: separate calls of one step run on separate cores.
        states_per_call = [[batch[i].state for i in indices] for indices in calls]
        num_windowed = len(windowed)
        plans = [plan_of(item) for item in batch]
        now = time.monotonic()
        for index in windowed:
            state, plan = batch[index].state, plans[index]
            if state.num_windows == 0:
                state.pace = self._policy.pace(plan, now)
            else:
                state.is_catching_up = (not state.has_caught_up
                                        and self._plan.can_catch_up(state.num_windows, state.pace)
                                        and self._policy.is_catching_up(plan, now))
                state.has_caught_up |= state.is_catching_up
        # No other lane's step runs beside this one: its calls may take every core.
        is_alone = all(plan.is_alone for plan in plans)
        if len(calls) > 1 and self._pool is not None:
            outputs = list(self._pool.map(
                lambda k: self._run_call(states_per_call[k], k < num_windowed, False),
                range(len(calls))))
        else:  # one after another, each on every core unless another lane runs beside it
            outputs = [self._run_call(states, k < num_windowed, is_alone)
                       for k, states in enumerate(states_per_call)]
        for indices, output in zip(calls, outputs, strict=True):
            for index, result in zip(indices, output, strict=True):
                results[index] = result
        for index in windowed:
            state = batch[index].state
            if state.num_windows == 1:  # its front part ran: the segment's length is known
                config = state.voice.config
                batch[index].est_audio_s = state.num_frames * config.hop_length / config.sample_rate
        # every voice speaks at the backend's rate (a voice of another is resampled)
        return [StepResult(is_finished=True) if r is None
                else to_engine_rate(item.state, r, self.sample_rate)
                if isinstance(item.state, PiperState) else r
                for item, r in zip(batch, results, strict=True)]

    def _run_call(self, states: list[PiperState], is_window: bool,
                  is_solo: bool) -> list[StepResult]:
        if is_window:
            return [run_window(states[0], self._plan, states[0].voice.config.sample_rate, is_solo)]
        return self._run_group(states, is_solo=is_solo)

    # -- internals ------------------------------------------------------------

    @staticmethod
    def _check_language(voice: LoadedVoice, language: str | None) -> None:
        if not language:
            return
        wanted = language.replace("_", "-").lower()
        spoken = voice.info.language.lower()
        if not (spoken == wanted or spoken.split("-")[0] == wanted.split("-")[0]):
            raise UnsupportedOptionError(
                f"voice {voice.info.voice_id!r} speaks {voice.info.language}; "
                f"expected language {voice.info.language} or none, got {language!r}"
            )

    def _run_group(self, states: list[PiperState], is_solo: bool = False) -> list[StepResult]:
        """One onnxruntime call for items of one voice and one set of scales."""
        voice = states[0].voice
        config = voice.config
        lengths = np.array([len(s.ids) for s in states], dtype=np.int64)  # [B]
        ids = np.zeros((len(states), int(lengths.max())), dtype=np.int64)  # [B, L]
        for row, state in enumerate(states):
            ids[row, : len(state.ids)] = state.ids
        scales = np.array(states[0].scales, dtype=np.float32)  # [3]
        sids = None
        if config.num_speakers > 1:
            sids = np.full(len(states), config.default_speaker_id, dtype=np.int64)
        try:
            # [B, T], [B, L]
            audio, durations = voice.run(ids, lengths, scales, sids, is_solo=is_solo)
        except Exception as exc:  # onnxruntime raises its own types
            logger.exception("piper step failed for a batch of %d", len(states))
            failure = BackendFailure(f"piper synthesis failed: {exc}")
            return [StepResult(is_finished=True, error=failure) for _ in states]
        return [
            finish_segment(state, audio[row], durations[row, : len(state.ids)], config.sample_rate)
            for row, state in enumerate(states)
        ]
