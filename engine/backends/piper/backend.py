"""The piper backend: Piper VITS voices on onnxruntime, streamed in decoder windows.

Each voice's graph is split at its flow and decoder (piper_windows): a
segment's first step runs its text part (encoder, durations, prior) once, the
flow over the frames the first window needs, and decodes that window; later
steps decode the next windows (the flow runs 256 frames ahead of them at a time). Window
sizes follow the playback clock: a segment due now on a box that keeps up
gets a small first window and the flow slice (first audio soon; a smaller
one, its front part on threads that spin while it runs, when its session is
the only one talking: `Pace.LONE`); one with
lead, or whose listener already waits, gets long windows and the flow in long
pieces (more audio per second of work). So the engine's unit of work is a
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
duration output that piper_voices patches into the graph. The same durations
give the word timings (piper_align).

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
are split into onnxruntime calls and run. Its options are in piper_config, a
segment's state and the finishing of its output in piper_segment.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from engine.backend import Backend, BackendRequest, StepResult
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
from engine.backends.piper.segment import PiperState, finish_segment, segment_timings, silent_result
from engine.backends.piper.windows import Pace, decode_window, flow_slice
from engine.errors import (
    BackendFailure,
    EngineError,
    UnknownVoiceError,
    UnsupportedOptionError,
)
from engine.types import SynthesisRequest, VoiceInfo

# The config and the segment state live in their own modules; tests import them from here.
__all__ = ["PiperBackend", "PiperBackendConfig", "PiperState", "pack_by_length"]

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
        # Retired ones are deleted but still held by sessions: unlisted, still speakable.
        self._registered: dict[str, tuple[VoiceInfo, str]] = {}
        self._retired: dict[str, tuple[VoiceInfo, str]] = {}
        self.sample_rate = 22050
        self.parallelism = self.config.num_parallel_calls
        # One call per item: a bigger batch only makes a longer step (a new turn's first
        # window would wait behind it), never a cheaper one.
        self.serial_items = self.config.one_call_per_item
        # Calls share no state: the engine runs `parallelism` steps side by side (lanes).
        self.concurrent_steps = self.config.one_call_per_item
        self._num_running = 0  # steps running now (lanes); a lone one may use every core
        self._num_busy = 0  # of them, steps of work due soon (`window_busy_lead_s`)
        self._running_lock = threading.Lock()
        # Segments prepared and not yet released, by context (`_context_of`): one context
        # alone means one talking session, whose first audio may take `Pace.LONE`.
        self._live: dict[str, int] = {}
        self._plan = self.config.window_plan
        self._pool = (ThreadPoolExecutor(self.config.num_parallel_calls, thread_name_prefix="piper")
                      if self.config.num_parallel_calls > 1 else None)

    # -- Backend --------------------------------------------------------------

    def load(self) -> None:
        voices: dict[str, LoadedVoice] = {}
        for voice_id, entry in self._files.items():
            voice = load_voice(entry, self.config.num_threads, self.config.target_peak)
            if entry.is_builtin:
                self.sample_rate = voice.info.sample_rate
            voices[voice_id] = voice
        for voice_id, voice in list(voices.items()):
            # StepResult carries no rate: every voice must speak at the backend's.
            if voice.info.sample_rate != self.sample_rate:
                logger.warning(
                    "piper voice %r skipped: expected sample rate %d, got %d",
                    voice_id,
                    self.sample_rate,
                    voice.info.sample_rate,
                )
                del voices[voice_id]
        self._voices = voices
        logger.info("piper backend loaded voices: %s", ", ".join(voices))

    def voices(self) -> list[VoiceInfo]:
        installed = [voice.info for voice in self._voices.values()]
        return installed + [info for info, _ in list(self._registered.values())]

    def get_voice(self, voice_id: str) -> LoadedVoice:
        """A loaded voice by id or alias; raises UnknownVoiceError."""
        if not self._voices:
            raise EngineError("piper backend is not loaded; expected load() before prepare()")
        voice = self._voices.get(self._aliases.get(voice_id, voice_id))
        if voice is None:
            entry = self._registered.get(voice_id) or self._retired.get(voice_id)
            voice = None if entry is None else self._voices.get(entry[1])
        if voice is None:
            expected = ", ".join([*self._voices, *self._registered])
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
            backend=self.name,
            sample_rate=self.sample_rate,
            is_builtin=False,
        )
        self._retired.pop(voice_id, None)
        self._registered[voice_id] = (info, base.info.voice_id)
        return info

    def retire_voice(self, voice_id: str) -> None:
        entry = self._registered.pop(voice_id, None)
        if entry is None:
            raise UnknownVoiceError(f"unknown registered voice {voice_id!r}")
        self._retired[voice_id] = entry

    def remove_voice(self, voice_id: str) -> None:
        # Prepared requests hold their LoadedVoice: they finish with it.
        if (
            self._registered.pop(voice_id, None) is None
            and self._retired.pop(voice_id, None) is None
        ):
            raise UnknownVoiceError(f"unknown registered voice {voice_id!r}")

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
        key = self._context_of(request)
        with self._running_lock:
            self._live[key] = self._live.get(key, 0) + 1
        return BackendRequest(request=request, state=state, est_audio_s=est)

    def release(self, item: BackendRequest) -> None:
        if isinstance(item.state, PiperState):
            key = self._context_of(item.request)
            with self._running_lock:
                left = self._live.get(key, 0) - 1
                if left > 0:
                    self._live[key] = left
                else:
                    self._live.pop(key, None)
        item.state = None

    @staticmethod
    def _context_of(request: SynthesisRequest) -> str:
        """The talking context a request belongs to (a request without one is its own)."""
        return request.context_key or f"request:{request.request_id}"

    def _is_lone(self, request: SynthesisRequest) -> bool:
        """Whether the request's context is the only one with prepared work."""
        with self._running_lock:
            return self._live.keys() <= {self._context_of(request)}

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
                results[index] = silent_result(state, self.sample_rate)  # nothing speakable
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
        now = time.monotonic()
        leads = [self._lead(item, now) for item in batch]
        # Busy: this step's work is due soon (not look-ahead that could wait).
        is_busy = min(leads, default=0.0) <= self.config.window_busy_lead_s
        with self._running_lock:
            self._num_running += 1
            self._num_busy += is_busy
            is_alone = self._num_running == 1  # no other lane's step runs beside this one
            is_contended = self._num_busy - is_busy > 0  # another lane's step is due soon too
        try:
            for index in windowed:
                state = batch[index].state
                if state.num_windows == 0:
                    is_lone = not is_contended and self._is_lone(batch[index].request)
                    state.pace = self._pace(leads[index], is_contended, is_lone)
                else:
                    state.is_catching_up = self._is_catching_up(state, leads[index])
                    state.has_caught_up |= state.is_catching_up
            if len(calls) > 1 and self._pool is not None:
                outputs = list(self._pool.map(
                    lambda k: self._run_call(states_per_call[k], k < num_windowed, False), range(len(calls))))
            else:  # one after another, each on every core unless another lane runs beside it
                outputs = [self._run_call(states, k < num_windowed, is_alone)
                           for k, states in enumerate(states_per_call)]
        finally:
            with self._running_lock:
                self._num_running -= 1
                self._num_busy -= is_busy
        for indices, output in zip(calls, outputs, strict=True):
            for index, result in zip(indices, output, strict=True):
                results[index] = result
        for index in windowed:
            state = batch[index].state
            if state.num_windows == 1:  # its front part ran: the segment's length is known
                batch[index].est_audio_s = state.num_frames * state.voice.config.hop_length / self.sample_rate
        return [r if r is not None else StepResult(is_finished=True) for r in results]

    @staticmethod
    def _lead(item: BackendRequest, now: float) -> float:
        """Seconds until the item's next audio is due (`due` is on time.monotonic()'s clock)."""
        return (item.request.deadline if item.due is None else item.due) - now

    def _pace(self, lead: float, is_contended: bool, is_lone: bool = False) -> Pace:
        """How a segment's windows are cut, decided at its first window (WindowPlan).

        Short pieces (a small first window, a flow slice) only for a segment whose
        next audio is due soon (`lead` seconds from now) and whose step runs alone
        or beside look-ahead work only: light load, where first audio is what
        counts. Beside another lane's step of work due soon, small windows cost
        every stream (context decoded twice, a step each, and a stream with 0.1 s
        of audio back for more while others wait), so such a segment, urgent or
        due within `window_medium_lead_s` (its lead is positive: its listener
        hears the turn), gets one medium first window, the flow sliced for it,
        then long ones: its audio comes in half the time of a long first window
        (docs/benchmarks.md, "Round nine": at 12 sessions on seed 1 TTFA p95 fell
        from 270-429 to 167-213 ms). A segment with lead to spare, or whose
        listener has waited longer than `window_behind_s` already, takes long
        windows: the box is behind, and long windows, more audio per second of
        work, catch up sooner. An urgent segment whose context is the only one
        with work (`is_lone`: one talking session) starts with a smaller window:
        no other stream's work is there to delay its second.
        """
        config = self.config
        is_urgent = -config.window_behind_s <= lead <= config.window_urgent_lead_s
        if is_urgent and not is_contended:
            return Pace.LONE if is_lone else Pace.SHORT
        if is_urgent or 0.0 < lead <= config.window_medium_lead_s:
            return Pace.MEDIUM
        return Pace.LONG

    def _is_catching_up(self, state: PiperState, lead: float) -> bool:
        """Whether a segment's later window, its audio due in `lead` s, is cut short (WindowPlan).

        Where its listener runs dry within `window_catchup_lead_s` (or ran dry no
        longer than `window_behind_s` ago) and the window would be longer than a
        short one; once per segment, so a box behind keeps the long windows that
        make more audio per second of work (docs/benchmarks.md, "Round eleven").
        """
        config = self.config
        return (config.window_catchup_lead_s > 0 and not state.has_caught_up
                and self._plan.can_catch_up(state.num_windows, state.pace)
                and -config.window_behind_s <= lead <= config.window_catchup_lead_s)

    def _run_call(self, states: list[PiperState], is_window: bool, is_solo: bool) -> list[StepResult]:
        if is_window:
            return [self._run_window(states[0], is_solo)]
        return self._run_group(states, is_solo=is_solo)

    def _run_window(self, state: PiperState, is_solo: bool) -> StepResult:
        """One window of a split voice; the segment's first also runs its front part."""
        voice = state.voice
        hop = voice.config.hop_length
        sids = None
        if voice.config.num_speakers > 1:
            sids = np.full(1, voice.config.default_speaker_id, dtype=np.int64)
        try:
            words = None
            if state.latent is None:
                ids = np.array([state.ids], dtype=np.int64)  # [1, L]
                lengths = np.array([len(state.ids)], dtype=np.int64)  # [1]
                scales = np.array(state.scales, dtype=np.float32)  # [3]
                outputs, durations = voice.run_front(ids, lengths, scales, sids, is_solo=is_solo,
                                                     is_lone=state.pace is Pace.LONE)
                frames = np.rint(durations[0, : len(state.ids)]).astype(np.int64)  # [L]
                state.num_frames = total = int(frames.sum())
                padded = next(iter(outputs.values())).shape[2]
                if total > padded:
                    raise BackendFailure(f"expected at most {padded} frames from durations, got {total}")
                words = segment_timings(state, frames, self.sample_rate)
                if total == 0:
                    return StepResult(words=words, is_finished=True)
                if voice.has_flow:
                    state.prior = flow_slice(voice.flow_feeds(outputs, sids), 0, total, padded)
                    state.latent = np.zeros((1, state.prior[voice.flow_inputs[0]].shape[1], 0), np.float32)
                else:
                    state.latent = outputs[voice.latent_name][:, :, :total]  # [1, C, T]
            start = state.cursor
            end = self._plan.window_end(start, state.num_windows, state.num_frames, state.pace,
                                        state.is_catching_up)
            context = self._plan.context_frames
            latent = self._run_flow(state, min(state.num_frames, end + context), is_solo)
            raw = decode_window(lambda z: voice.run_decoder(z, sids, is_solo=is_solo), latent,
                                start, end, context, hop)
            pcm = np.clip(raw * voice.gain, -1.0, 1.0).astype(np.float32)
            state.cursor, state.num_windows = end, state.num_windows + 1
            is_finished = end >= state.num_frames
            if is_finished:
                state.latent = None  # the latent is the big part of the state: free it at once
            return StepResult(pcm=pcm, words=words, is_finished=is_finished)
        except Exception as exc:  # onnxruntime raises its own types
            logger.exception("piper window failed")
            error = exc if isinstance(exc, BackendFailure) else BackendFailure(f"piper synthesis failed: {exc}")
            return StepResult(is_finished=True, error=error)

    def _run_flow(self, state: PiperState, needed: int, is_solo: bool) -> np.ndarray:
        """Grow the segment's latent to at least `needed` frames through the flow; the latent to decode.

        On slices with the flow's context on each side, which equal the whole: for a
        long segment cut in short pieces (`Pace.SHORT`: its first two windows;
        `Pace.MEDIUM`: its first) a slice is only the frames its window needs; the
        rest run `flow_frames` ahead (`WindowPlan.flow_end`). Running the flow over a
        whole long segment at its first window would make that window, and every
        stream waiting behind it, pay for audio due seconds later; and a short first
        window covers only ~120 ms of playback, within which the second must follow
        (at 12 sessions a second window that also ran a 256-frame flow piece came
        58 ms late). A short first slice whose frames the second slice recomputes
        anyway runs on less context and is not kept
        (`WindowPlan.is_first_slice_provisional`): first audio sooner, no more work.
        """
        prior, latent = state.prior, state.latent
        assert latent is not None
        if prior is None or latent.shape[2] >= needed:
            return latent
        total, done = state.num_frames, latent.shape[2]
        context = self._plan.flow_context_frames
        is_sliced = state.is_catching_up or self._plan.is_flow_sliced(state.pace, state.num_windows)
        if is_sliced and 2 * (needed + context) < total - done:
            end = needed
            if done == 0 and self._plan.is_first_slice_provisional(needed):
                hi = min(total, end + self._plan.first_flow_context_frames)
                return state.voice.run_flow(flow_slice(prior, 0, hi, total), is_solo=is_solo)[:, :, :end]
        else:
            end = self._plan.flow_end(done, needed, total)
        lo, hi = max(0, done - context), min(total, end + context)
        more = state.voice.run_flow(flow_slice(prior, lo, hi, total), is_solo=is_solo)
        state.latent = np.concatenate([latent, more[:, :, done - lo: end - lo]], axis=2)
        if end >= total:
            state.prior = None
        return state.latent

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
            audio, durations = voice.run(ids, lengths, scales, sids, is_solo=is_solo)  # [B, T], [B, L]
        except Exception as exc:  # onnxruntime raises its own types
            logger.exception("piper step failed for a batch of %d", len(states))
            failure = BackendFailure(f"piper synthesis failed: {exc}")
            return [StepResult(is_finished=True, error=failure) for _ in states]
        return [
            finish_segment(state, audio[row], durations[row, : len(state.ids)], self.sample_rate)
            for row, state in enumerate(states)
        ]
