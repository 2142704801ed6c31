"""One piper segment: its prepared state, and how model output becomes its audio and word timings.

This module owns `PiperState`, what `prepare` computes for a segment
(phonemes, ids, word spans, synthesis scales) and where its windows stand
(the flow's inputs still to run, the latent, frames decoded, windows so far), and the per-segment
finishing the backend applies to onnxruntime's output: word timings from the
frames per phoneme id (`segment_timings`), the result of a segment with
nothing speakable (`silent_result`), and the trim to true length, fixed voice
gain and clip of a whole segment (`finish_segment`). The backend (piper)
decides what runs in which call; this module never calls onnxruntime.

Piper voices come at 16 or 22.05 kHz (the "low" and "medium" qualities);
the engine speaks at one rate. `to_engine_rate` resamples a voice of another
rate as its audio comes, window by window, with one streaming resampler
(FFmpeg's swresample through PyAV) per segment, so the pieces join without
a seam and add up to the segment's length at the engine's rate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from engine.backend import StepResult
from engine.backends.piper.alignment import word_timings
from engine.backends.piper.loader import LoadedVoice
from engine.backends.piper.plan import Pace
from engine.errors import BackendFailure
from engine.types import WordTiming

logger = logging.getLogger("voxgate.engine")


@dataclass(slots=True)
class PiperState:
    """What `prepare` computed for one segment, and where its windows stand."""

    voice: LoadedVoice
    phonemes: list[str]
    ids: list[int]
    phoneme_id_spans: list[tuple[int, int]]  # per phoneme: its range in `ids`
    words: list[str]
    word_spans: list[tuple[int, int]]  # per word: its range in `phonemes`
    scales: tuple[float, float, float]  # noise_scale, length_scale, noise_w
    # After the front part, until the last window: the flow's inputs for the frames not yet
    # through the flow (None once all are), and the latent of those that are ([1, C, <= T]).
    prior: dict[str, np.ndarray] | None = None
    latent: np.ndarray | None = None
    num_frames: int = 0
    cursor: int = 0  # frames decoded so far
    num_windows: int = 0
    pace: Pace = Pace.SHORT  # how its windows are cut, set at its first window (piper.step)
    is_catching_up: bool = False  # its next window is due too soon for a long one (piper.step)
    has_caught_up: bool = False  # one window was cut short so already: the rest keep their sizes
    resampler: Any = None  # av.AudioResampler to the engine's rate, for a voice of another rate


def silent_result(state: PiperState, sample_rate: int) -> StepResult:
    """A segment with nothing speakable: no audio, its words at time 0."""
    words = word_timings(state.words, state.word_spans, np.zeros(0), 0, sample_rate)
    return StepResult(words=words, is_finished=True)


def segment_timings(state: PiperState, frames: np.ndarray, sample_rate: int) -> list[WordTiming]:
    """Word timings from the frames per phoneme id ([L_i]); they tile the segment's audio."""
    hop = state.voice.config.hop_length
    id_ends = np.cumsum(frames) * hop  # [L_i] end sample of each id
    phoneme_ends = np.array(
        [id_ends[end - 1] if end > 0 else 0 for _, end in state.phoneme_id_spans],
        dtype=np.int64,
    )  # [P]
    num_samples = int(frames.sum()) * hop
    return word_timings(state.words, state.word_spans, phoneme_ends, num_samples, sample_rate)


def finish_segment(state: PiperState, audio: np.ndarray, durations: np.ndarray,
                   sample_rate: int) -> StepResult:
    """Trim one item to its true length, apply the voice gain, time its words.

    audio: [T] padded raw output; durations: [L_i] frames per phoneme id.
    """
    try:
        hop = state.voice.config.hop_length
        frames = np.rint(durations).astype(np.int64)  # [L_i]
        num_samples = int(frames.sum()) * hop
        if num_samples > audio.shape[0]:
            raise BackendFailure(
                f"expected at most {audio.shape[0]} samples from durations, got {num_samples}"
            )
        pcm = np.clip(audio[:num_samples] * state.voice.gain, -1.0, 1.0).astype(np.float32)
        words = segment_timings(state, frames, sample_rate)
        return StepResult(pcm=pcm, words=words, is_finished=True)
    except Exception as exc:
        logger.exception("piper postprocessing failed")
        error = exc if isinstance(exc, BackendFailure) else BackendFailure(str(exc))
        return StepResult(is_finished=True, error=error)


def to_engine_rate(state: PiperState, result: StepResult, sample_rate: int) -> StepResult:
    """`result` with its audio at `sample_rate`; the voice's own rate passes unchanged.

    Word timings are in ms already (made at the voice's rate): they hold.
    """
    rate = state.voice.config.sample_rate
    if rate == sample_rate or result.error is not None:
        return result
    if state.resampler is None:
        state.resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
    frames = []
    if len(result.pcm):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(result.pcm, np.float32)[None, :],
                                           format="flt", layout="mono")
        frame.sample_rate = rate
        frames += state.resampler.resample(frame)
    if result.is_finished:
        frames += state.resampler.resample(None)  # the filter's tail
        state.resampler = None
    pcm = (np.concatenate([f.to_ndarray().reshape(-1) for f in frames]) if frames
           else np.zeros(0, dtype=np.float32))
    result.pcm = np.clip(pcm, -1.0, 1.0).astype(np.float32, copy=False)
    return result
