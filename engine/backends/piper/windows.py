"""A split piper voice run window by window: the front part, the flow's slices, the decoder windows.

This module owns the runtime of a windowed segment (the voice cut at load by
engine/backends/piper/graphs/split.py; the sizes from the `WindowPlan` in
engine/backends/piper/plan.py). A segment's first window runs its front part
(text encoder, durations, prior) once, which fixes its length and word
timings; every window then grows the latent through the flow as far as it
needs (`grow_latent`: a slice with the flow's context on each side, or a
`flow_frames` piece ahead) and decodes its frames with `context_frames` of
context each side, cut from the output (`decode_window`). Flow and decoder
are convolutional with finite receptive fields, so a slice with enough
context equals the whole; one fixed gain per voice is applied to every
window. Which window sizes and which slices a segment gets (its `Pace`) is
decided before it runs, by the backend from the engine's plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from engine.backend import StepResult
from engine.backends.piper.plan import Pace, WindowPlan
from engine.backends.piper.segment import PiperState, segment_timings
from engine.errors import BackendFailure

logger = logging.getLogger("voxgate.engine")


def run_window(state: PiperState, plan: WindowPlan, sample_rate: int, is_solo: bool) -> StepResult:
    """One window of a split voice's segment; the segment's first also runs its front part.

    `is_solo`: the step runs alone, and its calls may take every core.
    """
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
                raise BackendFailure(
                    f"expected at most {padded} frames from durations, got {total}")
            words = segment_timings(state, frames, sample_rate)
            if total == 0:
                return StepResult(words=words, is_finished=True)
            if voice.has_flow:
                state.prior = flow_slice(voice.flow_feeds(outputs, sids), 0, total, padded)
                state.latent = np.zeros((1, state.prior[voice.flow_inputs[0]].shape[1], 0),
                                        np.float32)
            else:
                state.latent = outputs[voice.latent_name][:, :, :total]  # [1, C, T]
        start = state.cursor
        end = plan.window_end(start, state.num_windows, state.num_frames, state.pace,
                              state.is_catching_up)
        context = plan.context_frames
        latent = grow_latent(state, plan, min(state.num_frames, end + context), is_solo)
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
        error = (exc if isinstance(exc, BackendFailure)
                 else BackendFailure(f"piper synthesis failed: {exc}"))
        return StepResult(is_finished=True, error=error)


def grow_latent(state: PiperState, plan: WindowPlan, needed: int, is_solo: bool) -> np.ndarray:
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
    context = plan.flow_context_frames
    is_sliced = state.is_catching_up or plan.is_flow_sliced(state.pace, state.num_windows)
    if is_sliced and 2 * (needed + context) < total - done:
        end = needed
        if done == 0 and plan.is_first_slice_provisional(needed):
            hi = min(total, end + plan.first_flow_context_frames)
            return state.voice.run_flow(flow_slice(prior, 0, hi, total),
                                        is_solo=is_solo)[:, :, :end]
    else:
        end = plan.flow_end(done, needed, total)
    lo, hi = max(0, done - context), min(total, end + context)
    more = state.voice.run_flow(flow_slice(prior, lo, hi, total), is_solo=is_solo)
    state.latent = np.concatenate([latent, more[:, :, done - lo: end - lo]], axis=2)
    if end >= total:
        state.prior = None
    return state.latent


def decode_window(
    decode: Callable[[np.ndarray], np.ndarray], latent: np.ndarray, start: int, end: int,
    context: int, hop: int,
) -> np.ndarray:
    """Raw audio [(end - start) * hop] of frames [start, end) of `latent` [1, C, T].

    `decode(latent_slice) -> [1, N * hop]` is one decoder call; the slice has
    `context` frames on each side where the latent has them, cut from the output.
    """
    total = latent.shape[2]
    lo, hi = max(0, start - context), min(total, end + context)
    audio = decode(latent[:, :, lo:hi]).reshape(-1)  # [(hi - lo) * hop]
    cut = (start - lo) * hop
    return audio[cut: cut + (end - start) * hop]


def flow_slice(prior: dict[str, np.ndarray], start: int, end: int,
               total: int) -> dict[str, np.ndarray]:
    """The flow's feeds for frames [start, end) of a segment of `total` frames.

    Time-indexed tensors ([B, C, total]: z_p, mask) are sliced; the rest (a
    speaker embedding) is passed whole.
    """
    return {name: np.ascontiguousarray(value[:, :, start:end])
            if value.ndim == 3 and value.shape[2] == total else value
            for name, value in prior.items()}
