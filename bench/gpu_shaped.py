"""A synthetic engine shaped like CosyVoice 3 on one H200, for measuring the process around it.

`GpuShapedBackend` is an `engine.backend.Backend` that the real `engine.Engine` drives inside a
real voxgate app (bench/gpu_shaped_serve.py, bench/gateway_scale.py): every part but the GPU is
the product's own. Its steps take the time the H200 took, waiting with the GIL released, and
its audio comes in CosyVoice's chunks, so the gateway sees the cadence and the load a GPU would
give it. It is not in the CLI's engine list, and it imports nothing of bench/ (the serve
launcher loads it by path into another checkout's server) and of the engine only its types.

What one step does, as `CosyVoiceBackend.step` does on a GPU (its flow on its own thread):
1. new streams of the batch are prefilled in one call, and every stream of the batch that still
   decodes gets one speech token from one batched LM decode step;
2. the flow "thread": the chunks of the tick in flight are collected once its time has passed
   (waited for when no stream of the batch decoded, as the real backend waits), then the next
   tick starts over the batch's ready streams, earliest due first, at most `max_flow_streams`,
   and those due beyond `flow_horizon_s` only while it has fewer than `flow_min_rows` rows
   (the backend's `plan_flow`); it runs beside the next LM steps, as the flow thread does;
3. each item gets its chunk when one is ready, else empty PCM.
The step's wall time is its prefill plus its decode step (the LM's time); a tick's is its flow
passes plus HiFT, and overlaps the LM's steps.

Chunks (t2w/chunking.py, with the flow's K/V cache): the first ends after `first_hop_tokens`
(15), the next on the 25-token grid (so it carries 10 tokens), then 25 tokens each; a chunk that
is not the last waits for 3 lookahead tokens; the last carries what is left. A token is 40 ms of
audio, 960 samples at 24 kHz. An answer is spoken at a natural pace: 14 characters a second
(`chars_per_second`), a Han character or Hangul block 0.18 s and a kana 0.12 s (Mandarin is spoken
at 4-5 syllables a second, not 14 characters; `speech_s`), and the backend knows that length at
prepare (its `est_audio_s`), as it knows its token count; the PCM is a speech-like harmonic signal
with a syllable envelope and a little noise (Opus does real work on it).

The costs (raw output of the 2026-12-04 run on one H200, build a5eb7dd; docs/benchmarks.md, "GPU:
LM, flow and pipeline"), fitted or interpolated in code from the points below:
- LM decode step with CUDA graphs by batch (`gpu_cosyvoice_lm.json`, mode cuda_graphs) plus its
  RAS sampling by batch (same file, `sampling_ms`), linear between batches: 4.2 ms at batch 1,
  5.4 at 128, 6.1 at 256. Every step pays it.
- Flow tick: `flow_steps` (10) estimator passes, each over 2 CFG rows x 50 frames (one chunk) a
  stream. A pass's time is the line fitted to the estimator's CUDA-graph passes by rows x frames
  (`gpu_flow_estimator.json`, 480 frames, 1-128 streams): about 2.7 ms + 1.8 us a row-frame, so
  27 ms + 1.8 ms a stream a tick; 0.26 s for 128 streams, ~500 audio-s/s back to back. That is
  the cached tick's arithmetic (one new chunk a stream); attention over the cached keys is
  left out (a small share of a pass).
These two are the default: the GPU at its best as measured, so that the process around it is
what a run measures. The `pipeline` preset (`GpuShape.pipeline()`, `--shape pipeline`) adds what
the whole pipeline measured beside them, eager paths that this build has since replaced or not
yet measured:
- LM prefill: the pipeline's first step less its steady step at 1, 8, 32 and 64 new streams
  (`gpu.log`, "first 40 steps"), as a line: ~29 ms + 0.9 ms a stream, paid by a step that starts
  a stream. Under turns that start every few steps nearly every step pays it, and first audio
  at 128 sessions takes ~0.8 s with no gateway at all (bench.gpu_shaped_floor).
- HiFT: the pipeline's eager vocoder calls by rows (`gpu.log`, "HiFT ms/call (rows)") as a line:
  ~15 ms + 2.2 ms a stream a tick (its graphs are not measured yet); ~230 audio-s/s at most.
Not modelled: the LM and the flow contending for the GPU (the pipeline's LM steps ran 5-7 ms
beside the flow, with spikes of 0.17-0.31 s), and the real backend's own Python per step, which
holds the GIL (`host_ms_per_step` spins that long if set).

Scheduling: `parallelism` is the batch size (a GPU step of 256 costs about what one of 1 does),
so the engine's scheduler sends every runnable request each step. The cosyvoice backend leaves
it at 1 today; the scheduler then sizes batches by its step-cost line and, with overdue work,
sends only what is due, so streams in progress starve (`parallelism=1` reproduces it: gaps at
32 sessions with no gateway, bench.gpu_shaped_floor).

Memory: `context_capacity` says 300 talking contexts (an H200's flow cache holds about 300
streams of one voice at the default history: docs/cosyvoice-design.md, "The flow's K/V cache");
`max_batch_size` is 256 (cosyvoice's GPU batch).
"""

from __future__ import annotations

import bisect
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from engine.backend import Backend, BackendRequest, StepResult, due_of
from engine.errors import UnknownVoiceError
from engine.types import SynthesisRequest, VoiceInfo

# -- the measured points (H200, 2026-12-04, build a5eb7dd) -------------------------------------

#: LM decode step with CUDA graphs, ms by batch; and RAS sampling, ms by batch
LM_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LM_DECODE_MS = (3.03, 3.16, 3.22, 3.29, 3.39, 3.48, 3.69, 4.03, 4.73, 6.21, 9.14)
LM_SAMPLING_MS = (1.19, 1.21, 1.18, 1.19, 1.19, 1.21, 1.19, 1.35, 1.42, 1.56, 1.83)
#: (new streams, the pipeline's first step less its steady step, ms): the prefill
PREFILL_POINTS = ((1, 39.0 - 5.0), (8, 38.3 - 5.3), (32, 58.0 - 5.7), (64, 92.8 - 5.6))
#: (CFG rows x frames, ms) of one estimator pass replayed as a CUDA graph (480 frames)
FLOW_PASS_POINTS = (
    (960, 4.40),
    (1920, 6.00),
    (3840, 9.39),
    (7680, 16.40),
    (15360, 30.59),
    (30720, 58.61),
    (61440, 113.76),
    (122880, 224.12),
)
#: (streams, ms) of one HiFT call in the pipeline (eager)
HIFT_POINTS = ((1.0, 22.0), (6.2, 25.0), (22.3, 58.0), (36.3, 98.0))


SIGNAL_S = 20.0  # the PCM every stream reads from, at its own offset
_SYLLABLES = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7a3]")
_KANA = re.compile(r"[\u3041-\u3096\u30a1-\u30fa\u30fc\uff66-\uff9d]")


def speech_s(text: str, shape: GpuShape) -> float:
    """Seconds `text` takes to speak at speed 1, by script (module doc). Its own rule, not the
    engine's guess (engine.types.estimate_audio_s): a build before that guess changed gets the
    same audio for the same text."""
    num_syllables = len(_SYLLABLES.findall(text))
    num_kana = len(_KANA.findall(text))
    num_other = len(text) - num_syllables - num_kana
    return (num_other / shape.chars_per_second + num_syllables * shape.s_per_syllable
            + num_kana * shape.s_per_kana)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through `points`, the intercept at least 0."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return max(mean_y - slope * mean_x, 0.0), slope


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """`ys` at `x`, linear between the points of `xs` (sorted) and along the last segment beyond."""
    if x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


_PREFILL = fit_line(PREFILL_POINTS)
_FLOW_PASS = fit_line(FLOW_PASS_POINTS)
_HIFT = fit_line(HIFT_POINTS)


@dataclass(slots=True, frozen=True)
class GpuShape:
    """The costs and shapes of the synthetic engine (module docstring); every field can be set."""

    prefill_fixed_ms: float = 0.0
    prefill_ms_per_stream: float = 0.0
    flow_pass_fixed_ms: float = _FLOW_PASS[0]
    flow_pass_ms_per_row_frame: float = _FLOW_PASS[1]
    flow_steps: int = 10
    chunk_frames: int = 50  # mel frames of one chunk (25 tokens) a CFG row computes per pass
    hift_fixed_ms: float = 0.0
    hift_ms_per_stream: float = 0.0
    lm_scale: float = 1.0  # multiplies the LM's decode and sampling times
    max_flow_streams: int = 128
    max_batch_size: int = 256
    #: requests a step runs at the cost of one (Backend.parallelism): the whole batch on a GPU
    parallelism: int = 256
    context_capacity: int = 300
    first_hop_tokens: int = 15
    hop_tokens: int = 25
    lookahead_tokens: int = 3
    samples_per_token: int = 960  # 40 ms at 24 kHz
    sample_rate: int = 24000
    chars_per_second: float = 14.0
    s_per_syllable: float = 0.18  # a Han character or a Hangul block (speech_s)
    s_per_kana: float = 0.12
    host_ms_per_step: float = 0.0
    #: the cosyvoice backend's flow rows by horizon (its config, scheduler.plan_flow): rows due
    #: later than this join a tick only while it has fewer than `flow_min_rows`; 0: every row
    flow_horizon_s: float = 0.5
    flow_min_rows: int = 16

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"expected {f.name} >= 0, got {getattr(self, f.name)}")
        for name in (
            "flow_steps",
            "max_flow_streams",
            "max_batch_size",
            "parallelism",
            "first_hop_tokens",
            "hop_tokens",
            "flow_min_rows",
            "samples_per_token",
            "sample_rate",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"expected {name} >= 1, got {getattr(self, name)}")

    @classmethod
    def pipeline(cls) -> GpuShape:
        """The default with the pipeline's measured prefill and eager HiFT (module docstring)."""
        return cls(
            prefill_fixed_ms=_PREFILL[0],
            prefill_ms_per_stream=_PREFILL[1],
            hift_fixed_ms=_HIFT[0],
            hift_ms_per_stream=_HIFT[1],
        )

    @classmethod
    def from_spec(cls, items: Sequence[str]) -> GpuShape:
        """A shape from `--shape` items: `pipeline` (the preset), then `KEY=VALUE` overrides."""
        kinds = {f.name: f.type for f in fields(cls)}
        shape = cls()
        values: dict[str, Any] = {}
        for item in items:
            if item == "pipeline":
                shape = cls.pipeline()
                continue
            key, sep, value = item.partition("=")
            if not sep or key not in kinds:
                raise ValueError(
                    f"expected 'pipeline' or KEY=VALUE with KEY one of {', '.join(kinds)}, "
                    f"got {item!r}"
                )
            values[key] = int(value) if kinds[key] == "int" else float(value)
        return replace(shape, **values)

    def lm_step_ms(self, batch: int) -> float:
        decode = interpolate(LM_BATCHES, LM_DECODE_MS, batch)
        return self.lm_scale * (decode + interpolate(LM_BATCHES, LM_SAMPLING_MS, batch))

    def prefill_ms(self, streams: int) -> float:
        return self.prefill_fixed_ms + self.prefill_ms_per_stream * streams if streams else 0.0

    def tick_ms(self, streams: int) -> float:
        """One flow tick (one chunk for each of `streams`) and its vocoder call."""
        rows_x_frames = 2 * streams * self.chunk_frames
        flow = self.flow_steps * (
            self.flow_pass_fixed_ms + self.flow_pass_ms_per_row_frame * rows_x_frames
        )
        return flow + self.hift_fixed_ms + self.hift_ms_per_stream * streams

    def audio_s_per_s(self, streams: int) -> float:
        """Audio seconds per wall second of back-to-back ticks of `streams` whole chunks."""
        return (
            streams
            * self.hop_tokens
            * self.samples_per_token
            / self.sample_rate
            / (self.tick_ms(streams) / 1e3)
        )

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _Stream:
    """One request between steps: tokens made, audio computed so far, a chunk in flight."""

    key: str
    num_tokens: int  # the answer's length in speech tokens
    offset: int  # where its PCM starts in the shared signal
    made: int = 0
    emitted: int = 0  # tokens whose audio is computed or being computed
    is_started: bool = False
    is_in_flight: bool = False
    is_lm_done: bool = False

    def next_chunk(self, shape: GpuShape) -> int | None:
        """Where the next chunk ends, if it may be computed now (chunking.schedule's rule)."""
        if self.is_in_flight or self.emitted >= self.num_tokens:
            return None
        hop = shape.hop_tokens
        end = shape.first_hop_tokens if self.emitted == 0 else (self.emitted // hop + 1) * hop
        if end + shape.lookahead_tokens > self.num_tokens:  # the last chunk: what is left
            return self.num_tokens if self.is_lm_done else None
        return end if self.made >= end + shape.lookahead_tokens else None


@dataclass(slots=True)
class _Tick:
    ends_at: float
    chunks: list[tuple[str, int, int, bool]]  # (stream, first token, end token, is_final)


@dataclass(slots=True)
class GpuShapedStats:
    """What the synthetic GPU did (read by bench.gateway_scale through the serve launcher)."""

    lm_steps: int = 0
    lm_items: int = 0  # requests over all steps (mean batch: lm_items / lm_steps)
    lm_busy_s: float = 0.0
    prefills: int = 0
    prefill_streams: int = 0
    ticks: int = 0
    tick_streams: int = 0
    flow_busy_s: float = 0.0
    flow_waits: int = 0
    chunks: int = 0
    audio_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def speech_like(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A voiced harmonic signal with a gliding pitch, a syllable-rate envelope and some noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    pcm = 0.2 * envelope * voiced + 0.01 * rng.standard_normal(len(t))
    return pcm.astype(np.float32)


class GpuShapedBackend(Backend):
    """The synthetic GPU engine (module docstring). `clock` and `sleep` are injectable for tests."""

    name = "gpu-shaped"

    def __init__(
        self,
        shape: GpuShape | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.shape = shape or GpuShape()
        self.sample_rate = self.shape.sample_rate
        self.max_batch_size = self.shape.max_batch_size
        self.parallelism = self.shape.parallelism
        self.clock = clock
        self.sleep = sleep
        self.stats = GpuShapedStats()
        self._signal = np.zeros(0, dtype=np.float32)
        self._period = 1
        self._streams: dict[str, _Stream] = {}
        self._pending: dict[str, tuple[np.ndarray, bool]] = {}  # chunks of streams not in a batch
        self._tick: _Tick | None = None
        self._num_prepared = 0
        self._lock = threading.Lock()  # stats are read from another thread

    def load(self) -> None:
        # the signal, and past its end its start again, longer than any chunk: a chunk starts
        # within the period (offsets wrap) and never runs off the end
        shape = self.shape
        longest = shape.first_hop_tokens + shape.hop_tokens + shape.lookahead_tokens
        period = speech_like(SIGNAL_S, self.sample_rate)
        self._signal = np.concatenate([period, period[: longest * shape.samples_per_token]])
        self._period = len(period)

    def voices(self) -> list[VoiceInfo]:
        return [
            VoiceInfo(
                voice_id="joe",
                name="joe (GPU-shaped synthetic)",
                language="en-US",
                backend=self.name,
                sample_rate=self.sample_rate,
            )
        ]

    def context_capacity(self) -> int:
        return self.shape.context_capacity

    def prepare(self, request: SynthesisRequest) -> BackendRequest:
        if request.voice != "joe":
            raise UnknownVoiceError(f"unknown voice {request.voice!r}; expected one of: joe")
        text = request.text.strip()
        speed = request.params.speed
        est = max(0.2, speech_s(text, self.shape) / speed) if text else 0.0
        tokens = math.ceil(est * self.sample_rate / self.shape.samples_per_token)
        self._num_prepared += 1  # streams start at different places of the signal
        state = _Stream(
            str(request.request_id), tokens, self._num_prepared * 7919 * 97, is_lm_done=not tokens
        )
        return BackendRequest(request=request, state=state, est_audio_s=est)

    def step(self, batch: list[BackendRequest]) -> list[StepResult]:
        started = self.clock()
        shape = self.shape
        states = [item.state for item in batch if isinstance(item.state, _Stream)]
        for state in states:
            self._streams.setdefault(state.key, state)
        new = [s for s in states if not s.is_started and not s.is_lm_done]
        decoding = [s for s in states if not s.is_lm_done]
        lm_ms = shape.prefill_ms(len(new)) + (shape.lm_step_ms(len(decoding)) if decoding else 0.0)
        for s in new:
            s.is_started = True
        for s in decoding:  # one token each
            s.made += 1
            s.is_lm_done = s.made >= s.num_tokens
        if shape.host_ms_per_step:
            _spin(shape.host_ms_per_step / 1e3)
        self._wait_until(started + lm_ms / 1e3)
        self._collect(wait=not decoding)
        self._start_tick(batch)
        with self._lock:
            self.stats.lm_steps += 1
            self.stats.lm_items += len(batch)
            self.stats.lm_busy_s += lm_ms / 1e3
            self.stats.prefills += bool(new)
            self.stats.prefill_streams += len(new)
        return [self._result(item) for item in batch]

    def release(self, item: BackendRequest) -> None:
        if isinstance(item.state, _Stream):
            self._streams.pop(item.state.key, None)
            self._pending.pop(item.state.key, None)
        item.state = None

    def snapshot(self) -> dict[str, float]:
        """The counters, from any thread."""
        with self._lock:
            return self.stats.to_dict()

    # -- the flow "thread" -------------------------------------------------------------------

    def _collect(self, wait: bool) -> None:
        tick = self._tick
        if tick is None:
            return
        if self.clock() < tick.ends_at:
            if not wait:
                return
            self.stats.flow_waits += 1
            self._wait_until(tick.ends_at)
        self._tick = None
        audio_s = 0.0
        for key, first, end, is_final in tick.chunks:
            state = self._streams.get(key)
            if state is None:  # released while its chunk was computed
                continue
            state.is_in_flight = False
            at = (state.offset + first * self.shape.samples_per_token) % self._period
            pcm = self._signal[at : at + (end - first) * self.shape.samples_per_token]
            self._pending[key] = (pcm, is_final)
            audio_s += len(pcm) / self.sample_rate
        with self._lock:
            self.stats.chunks += len(tick.chunks)
            self.stats.audio_s += audio_s

    def _start_tick(self, batch: list[BackendRequest]) -> None:
        if self._tick is not None:
            return
        ready: list[tuple[float, int, _Stream, int]] = []
        for i, item in enumerate(batch):
            state = item.state
            if isinstance(state, _Stream) and (end := state.next_chunk(self.shape)) is not None:
                ready.append((due_of(item), i, state, end))
        ready.sort(key=lambda r: (r[0], r[1]))
        if self.shape.flow_horizon_s:  # the dues are the engine's, on the monotonic clock
            horizon = time.monotonic() + self.shape.flow_horizon_s
            num_soon = sum(1 for r in ready if r[0] <= horizon)
            ready = ready[: max(num_soon, self.shape.flow_min_rows)]
        ready = ready[: self.shape.max_flow_streams]
        if not ready:
            return
        chunks = []
        for _, _, state, end in ready:
            chunks.append((state.key, state.emitted, end, end >= state.num_tokens))
            state.emitted = end
            state.is_in_flight = True
        tick_s = self.shape.tick_ms(len(ready)) / 1e3
        self._tick = _Tick(self.clock() + tick_s, chunks)
        with self._lock:
            self.stats.ticks += 1
            self.stats.tick_streams += len(ready)
            self.stats.flow_busy_s += tick_s

    def _result(self, item: BackendRequest) -> StepResult:
        state = item.state
        if not isinstance(state, _Stream):
            return StepResult(
                is_finished=True,
                error=ValueError(f"expected a prepared gpu-shaped request, got {state!r}"),
            )
        chunk = self._pending.pop(state.key, None)
        if chunk is not None:
            return StepResult(pcm=chunk[0], is_finished=chunk[1])
        if state.num_tokens == 0:
            return StepResult(is_finished=True)  # nothing to say
        return StepResult()

    def _wait_until(self, deadline: float) -> None:
        """Wait as a CUDA call does: the GIL released (time.sleep)."""
        remaining = deadline - self.clock()
        if remaining > 0:
            self.sleep(remaining)


def _spin(seconds: float) -> None:
    """Hold the GIL for `seconds` (pure Python), as a backend's own bookkeeping would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
