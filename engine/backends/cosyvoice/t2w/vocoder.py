"""Per-stream vocoder state for token-to-wave streaming, and the batched vocoder step.

CosyVoice 2 (`V2VocoderState`), as upstream's CosyVoice2Model.token2wav: the
last 8 mel frames of a chunk are held back and vocoded again with the next
one; the source of those frames is pinned to what it was (its noise is random)
and the 3840 overlapping samples are cross-faded with a Hamming window. Unlike
upstream, the sine phase continues from the previous chunk instead of
restarting at each chunk (upstream pins only the overlap, so its phase jumps
right after it).

CosyVoice 3 (`V3VocoderState`): the vocoder is causal with 8 frames of
lookahead (3 in the f0 predictor, 4 in conv_pre, 1 for the iSTFT overlap), so
a chunk emits audio up to 8 frames before its last mel frame, and the final
chunk emits the rest. Each chunk re-vocodes `context` frames before the new
audio (upstream re-vocodes everything), reusing the exact f0 and the phase
already computed for them; the result equals vocoding the whole mel.

Rows whose vocoder inputs have the same length (and finality) run as one batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from engine.backends.cosyvoice.models.hift import HiFT
from engine.backends.cosyvoice.models.source_noise import NoiseCounter

V2_CACHE_FRAMES = 8  # upstream mel_cache_len


@dataclass(slots=True)
class V2VocoderState:
    noise: NoiseCounter  # the source's noise, counter-based on the device
    mel: torch.Tensor | None = None  # [80, 8] held-back frames
    source: torch.Tensor | None = None  # [1, 3840] their source
    speech: torch.Tensor | None = None  # [3840] their audio, to fade out
    phase: torch.Tensor | None = None  # [H] float64 cycles through the last held-back frame

    @classmethod
    def new(cls, seed: int) -> V2VocoderState:
        return cls(noise=NoiseCounter(seed))


@dataclass(slots=True)
class V3VocoderState:
    # frames [mel_start, num_frames)
    mel: torch.Tensor = field(default_factory=lambda: torch.zeros(80, 0))
    mel_start: int = 0
    # exact f0, frames [f0_start, f0_done)
    f0: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    cycles: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 9, dtype=torch.float64))
    f0_start: int = 0
    done: int = 0  # frames whose audio is emitted

    @property
    def num_frames(self) -> int:
        return self.mel_start + self.mel.shape[1]

    @property
    def f0_done(self) -> int:
        return self.f0_start + self.f0.shape[0]


def _groups(keys: list[Any]) -> list[list[int]]:
    by_key: dict[Any, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        by_key[key].append(i)
    return list(by_key.values())


def hamming(n: int) -> torch.Tensor:
    """numpy.hamming(n) (symmetric), upstream's cross-fade window."""
    return torch.from_numpy(np.hamming(n).astype(np.float32))


def _vocode_v2(hift: HiFT, states: list[V2VocoderState], mels: list[torch.Tensor],
               finals: list[bool]) -> list[torch.Tensor]:
    spf = hift.cfg.samples_per_frame
    overlap = V2_CACHE_FRAMES * spf
    window = hamming(2 * overlap).to(mels[0].device) if mels else hamming(2 * overlap)
    inputs = [m if s.mel is None else torch.cat([s.mel, m], dim=1)
              for s, m in zip(states, mels, strict=True)]
    out: list[torch.Tensor] = [torch.zeros(0)] * len(states)
    for idx in _groups([(x.shape[1], False) for x in inputs]):
        mel = torch.stack([inputs[i] for i in idx])  # [G, 80, T]
        if mel.shape[2] == 0:
            continue
        f0 = hift.predict_f0(mel)
        sources, cycles = [], []
        for row, i in enumerate(idx):
            st = states[i]
            cyc = hift.m_source.phase(f0[row:row + 1])
            if st.phase is not None:  # continue the phase exactly where the pinned overlap ends
                cyc = cyc + (st.phase - cyc[0, V2_CACHE_FRAMES - 1])
            src = hift.m_source(f0[row:row + 1], cyc, generator=st.noise)
            if st.source is not None:
                src[:, :, : st.source.shape[1]] = st.source
            sources.append(src)
            cycles.append(cyc[0])
        wav = hift.decode(mel, torch.cat(sources))
        for row, i in enumerate(idx):
            st, w = states[i], wav[row]
            if st.speech is not None:
                w = w.clone()
                w[:overlap] = w[:overlap] * window[:overlap] + st.speech * window[overlap:]
            if finals[i]:
                out[i] = w
                continue
            st.mel = mel[row, :, -V2_CACHE_FRAMES:]
            st.source = sources[row][0, :, -overlap:]
            st.speech = w[-overlap:]
            st.phase = cycles[row][-1]
            out[i] = w[:-overlap]
    return out


def v3_step(hift: HiFT, mel: torch.Tensor, kept: torch.Tensor, phase0: torch.Tensor,
            starts: torch.Tensor,
            finalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocoder call of rows of equal shape (t2w/vocoder_graphs.py replays it as a graph).

    mel [G, 80, L] from each row's first re-vocoded frame; kept [G, K]: the exact f0 already
    known for its first K frames; phase0 [G, H] float64: the phase before its first frame;
    starts [G] long: its first absolute sample. -> (wave [G, n], f0 [G, T], cycles [G, T, H]).
    """
    f0_new = hift.predict_f0(mel, finalize=finalize)
    f0 = torch.cat([kept.to(f0_new.dtype), f0_new[:, kept.shape[1]:]], dim=1)
    cycles = hift.m_source.phase(f0, phase0)
    sources = hift.m_source(f0, cycles, start=starts)
    return hift.decode(mel[:, :, : f0.shape[1]], sources, finalize=finalize), f0, cycles


Step = Callable[[HiFT, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool],
                tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _vocode_v3(hift: HiFT, states: list[V3VocoderState], mels: list[torch.Tensor],
               finals: list[bool], context: int, step: Step = v3_step) -> list[torch.Tensor]:
    spf = hift.cfg.samples_per_frame
    f0_look = hift.f0_predictor.lookahead
    hold = f0_look + hift.cfg.conv_pre_look_right + 1  # frames of mel that a non-final chunk keeps
    plans = []
    for st, m, _ in zip(states, mels, finals, strict=True):
        if st.mel.device != m.device:  # a new stream's empty history starts on the model's device
            st.mel, st.f0 = st.mel.to(m.device), st.f0.to(m.device)
            st.cycles = st.cycles.to(m.device)
        st.mel = torch.cat([st.mel, m.to(st.mel.dtype)], dim=1)
        start = max(0, st.done - context)
        plans.append(start)
    out: list[torch.Tensor] = [torch.zeros(0)] * len(states)
    # rows of one call share their length, finality and known f0 (equal in steady state)
    keys = [(st.num_frames - s, fin, st.f0_done - s)
            for st, s, fin in zip(states, plans, finals, strict=True)]
    for idx in _groups(keys):
        fin = finals[idx[0]]
        starts = [plans[i] for i in idx]
        mel = torch.stack([states[i].mel[:, s - states[i].mel_start:]
                           for i, s in zip(idx, starts, strict=True)])
        if mel.shape[2] <= (0 if fin else hold):
            for i in idx:  # nothing new can be vocoded yet (or ever, for an empty final chunk)
                out[i] = torch.zeros(0)
            continue
        kept = torch.stack([states[i].f0[s - states[i].f0_start:]
                            for i, s in zip(idx, starts, strict=True)])
        no_phase = torch.zeros(hift.m_source.dim, dtype=torch.float64, device=mel.device)
        phase0 = torch.stack([states[i].cycles[s - 1 - states[i].f0_start] if s > 0 else no_phase
                              for i, s in zip(idx, starts, strict=True)])
        first_samples = torch.tensor([s * spf for s in starts], device=mel.device)
        wav, f0, cycles = step(hift, mel, kept, phase0, first_samples, fin)
        for row, i in enumerate(idx):
            st, s = states[i], starts[row]
            out[i] = wav[row, (st.done - s) * spf:]
            st.f0 = torch.cat([st.f0[: s - st.f0_start], f0[row]])
            st.cycles = torch.cat([st.cycles[: s - st.f0_start], cycles[row]])
            st.done = s + wav.shape[1] // spf
            keep = max(0, st.done - context - 1)  # the next chunk starts at done - context
            st.f0, st.cycles = st.f0[keep - st.f0_start:], st.cycles[keep - st.f0_start:]
            st.f0_start = keep
            st.mel, st.mel_start = st.mel[:, keep - st.mel_start:], keep
    return out


def vocode_batch(hift: HiFT, states: list[V2VocoderState | V3VocoderState],
                 mels: list[torch.Tensor],
                 finals: list[bool], context: int, step: Step | None = None) -> list[torch.Tensor]:
    """New mel [80, n] per stream -> the audio [m] each stream can emit now (float32).
    `step`: v3's call at its shapes (VocoderGraphs.step replays graphs; default eager)."""
    dtype = hift.window.dtype  # the flow may run in a lower precision than the vocoder
    mels = [m.to(dtype) for m in mels]
    with torch.inference_mode():
        if hift.cfg.causal:
            return _vocode_v3(hift, [cast(V3VocoderState, s) for s in states], mels, finals,
                              context, step or v3_step)
        return _vocode_v2(hift, [cast(V2VocoderState, s) for s in states], mels, finals)
