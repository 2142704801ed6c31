"""Token-to-wave streaming: speech tokens as the LM makes them -> 24 kHz audio chunks, many streams at once.

A backend drives it with plain calls (no threads, no clock):

    t2w.add_stream(sid, prompt)       # FlowPrompt: prompt tokens, prompt mel, x-vector
    t2w.feed(sid, tokens)             # tokens as the LM emits them
    t2w.finish(sid)                   # the LM has stopped: the next chunk is the last
    for chunk in t2w.run(t2w.ready()):  # one batched flow call + batched vocoder calls
        ...chunk.stream_id, chunk.audio [n] float32, chunk.is_final
    t2w.drop(sid)                     # cancel: the stream and any chunk it had ready are gone

Chunking (per stream; upstream keeps the hop on the shared model object, so
concurrent requests disturb each other's hops; here all hop state is the
stream's own):
- the first chunk covers `first_hop_tokens` tokens (default 15, smaller than
  the trained 25) so first audio comes sooner; later chunks end on the flow's
  chunk grid (multiples of 25 tokens counted from the start of the prompt,
  where chunked attention draws its boundaries), at least `min_hop_tokens`
  apart;
- a chunk that is not the last needs `pre_lookahead_len` (3) more tokens, which
  the flow reads as lookahead and does not emit;
- the flow recomputes the prompt plus the token history each chunk (it is a
  diffusion over the whole sequence); upstream keeps the whole history, so a
  chunk costs more the longer the answer. `max_history_tokens` bounds it: only
  the most recent history (cut on the 25-token grid, at least that many tokens)
  is recomputed, with the noise of its absolute frames. docs/cosyvoice.md gives
  the measured cost in fidelity; None keeps upstream's full recomputation.
- CosyVoice 2's vocoder is not causal: as upstream, 8 mel frames are held back
  and re-vocoded with the next chunk, the overlapping source is pinned and
  3840 samples are cross-faded (Hamming). CosyVoice 3's vocoder is causal:
  upstream re-vocodes the whole mel each chunk; we re-vocode only
  `hift_context_frames` of context (its receptive field is shorter), carrying
  the sine phase, which reproduces the full computation.
- A stream's `speed` (0.5-2.0) stretches its mel before the vocoder
  (mel_stretch.py), continuously across chunks; its hops are then at least
  `min_hop_for_speed` tokens, so a stretched chunk still covers the 8 frames
  the v2 vocoder holds back.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from engine.backends.cosyvoice.models.flow import FlowModel, FlowRow
from engine.backends.cosyvoice.models.hift import HiFT
from engine.backends.cosyvoice.models.mel import MelExtractor
from engine.backends.cosyvoice.t2w.mel_stretch import MelStretcher
from engine.backends.cosyvoice.t2w.vocoder import V2VocoderState, V3VocoderState, vocode_batch


@dataclass(slots=True)
class T2WConfig:
    first_hop_tokens: int | None = 15  # None: upstream's first hop (25 + padding to the grid)
    min_hop_tokens: int = 8
    max_history_tokens: int | None = 100  # None: recompute the whole history (upstream)
    hift_context_frames: int = 24  # v3: mel frames re-vocoded before the new ones
    streaming_attention: bool = True  # chunked attention in the flow (how upstream streams)

    def __post_init__(self) -> None:
        # a chunk must cover the 8 frames (4 tokens) the v2 vocoder holds back
        if self.first_hop_tokens is not None and self.first_hop_tokens < 4:
            raise ValueError(f"expected first_hop_tokens >= 4 or None, got {self.first_hop_tokens}")
        if self.min_hop_tokens < 4:
            raise ValueError(f"expected min_hop_tokens >= 4, got {self.min_hop_tokens}")
        if self.max_history_tokens is not None and self.max_history_tokens < 0:
            raise ValueError(f"expected max_history_tokens >= 0 or None, got {self.max_history_tokens}")
        if self.hift_context_frames < 8:
            raise ValueError(f"expected hift_context_frames >= 8, got {self.hift_context_frames}")


@dataclass(slots=True)
class FlowPrompt:
    """A voice as the flow needs it: tokens [Np] int64, mel [P <= 2 Np, 80], embedding [192]."""

    tokens: torch.Tensor
    mel: torch.Tensor
    embedding: torch.Tensor

    @classmethod
    def from_audio(cls, tokens: list[int] | torch.Tensor, wav_24k: torch.Tensor, embedding: torch.Tensor,
                   mel: MelExtractor) -> FlowPrompt:
        """Mel of the 24 kHz reference audio, and tokens and mel trimmed to a 1:2 ratio as upstream's
        frontend does (the LM prompt should use the same trimmed tokens)."""
        feat = mel(wav_24k)[0]  # [frames, 80]
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = min(feat.shape[0] // 2, toks.shape[0])
        return cls(toks[:n], feat[: 2 * n], torch.as_tensor(embedding, dtype=torch.float32).reshape(-1))

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.shape[0] == 0:
            raise ValueError(f"expected prompt tokens [N >= 1], got shape {tuple(self.tokens.shape)}")
        if self.tokens.shape[0] > MAX_PROMPT_TOKENS:  # bounds every flow row (max_chunk_frames)
            raise ValueError(f"expected at most {MAX_PROMPT_TOKENS} prompt tokens (30 s of reference audio), "
                             f"got {self.tokens.shape[0]}")
        if self.mel.dim() != 2 or self.mel.shape[1] != 80 or self.mel.shape[0] > 2 * self.tokens.shape[0]:
            raise ValueError(f"expected prompt mel [<= {2 * self.tokens.shape[0]}, 80], got {tuple(self.mel.shape)}")
        if self.embedding.dim() != 1:
            raise ValueError(f"expected embedding [D], got shape {tuple(self.embedding.shape)}")


@dataclass(slots=True)
class WaveChunk:
    stream_id: str
    audio: torch.Tensor  # [n] float32 at 24 kHz, on the models' device
    is_final: bool
    num_tokens: int  # speech tokens this chunk covered
    mel: torch.Tensor  # [80, 2 * num_tokens] the chunk's new mel frames (for checks and metrics)


def grid_end(prompt_len: int, after: int, hop: int, min_hop: int) -> int:
    """Smallest token end e >= after + min_hop with (prompt_len + e) on the hop grid."""
    e = after + min_hop
    return e + (-(prompt_len + e)) % hop


def first_end(prompt_len: int, hop: int, first_hop: int | None) -> int:
    if first_hop is None:  # upstream: 25 tokens plus what brings the prompt onto the grid
        return hop + (-prompt_len) % hop
    return first_hop


def history_start(offset: int, hop: int, max_history: int | None) -> int:
    """First history token recomputed for a chunk starting at `offset` (a cut on the hop grid)."""
    if max_history is None or offset <= max_history:
        return 0
    return (offset - max_history) // hop * hop


def schedule(prompt_len: int, num_tokens: int, config: T2WConfig, hop: int = 25,
             lookahead: int = 3) -> list[tuple[int, int, int]]:
    """(history start, chunk start, chunk end) of every chunk of a finished answer, in tokens."""
    end, offset, out = first_end(prompt_len, hop, config.first_hop_tokens), 0, []
    while True:
        is_final = end + lookahead > num_tokens
        end = num_tokens if is_final else end
        out.append((history_start(offset, hop, config.max_history_tokens), offset, end))
        if is_final:
            return out
        offset, end = end, grid_end(prompt_len, end, hop, config.min_hop_tokens)


MAX_PROMPT_TOKENS = 750  # a voice prompt: at most 30 s of reference audio at 25 tokens/s


def max_chunk_frames(config: T2WConfig, hop: int = 25, lookahead: int = 3,
                     max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> int | None:
    """The most mel frames one flow row can have: prompt + kept history + chunk + lookahead, x2.

    History is cut on the hop grid with at least `max_history_tokens` kept, so
    fewer than that plus one hop remain; a chunk ends on the grid at least
    `min_hop` (10 at speed 2) after the last, or is the first hop; a final one
    may take up to the lookahead more. None: unbounded history, no limit.
    """
    if config.max_history_tokens is None:
        return None
    history = config.max_history_tokens + hop - 1
    chunk = max(config.first_hop_tokens or 2 * hop, max(config.min_hop_tokens, min_hop_for_speed(2.0)) + hop - 1)
    return 2 * (max_prompt_tokens + history + chunk + lookahead)


def min_hop_for_speed(speed: float) -> int:
    """Fewest tokens a chunk needs at `speed` to still give >= 8 stretched mel frames, with a frame to spare."""
    return math.ceil(4.5 * speed) + 1


@dataclass(slots=True)
class _Stream:
    prompt: FlowPrompt
    prompt_tokens: list[int]  # the prompt's tokens on the host (the prompt tensors may be on the GPU)
    vocoder: V2VocoderState | V3VocoderState
    next_end: int
    min_hop: int
    stretcher: MelStretcher | None = None  # speed != 1
    tokens: list[int] = field(default_factory=list)
    offset: int = 0  # tokens whose mel is emitted
    is_input_done: bool = False


@dataclass(slots=True)
class _Plan:
    """One stream's next chunk: tokens [end, end + lookahead) exist; the flow row to compute."""

    stream_id: str
    stream: _Stream
    end: int
    is_final: bool
    start: int  # first history token recomputed
    offset: int  # tokens whose mel was emitted before this chunk
    row: FlowRow
    mel: torch.Tensor | None = None  # [80, frames] this chunk's new mel, once computed


class TokenToWave:
    def __init__(self, flow: FlowModel, hift: HiFT, config: T2WConfig | None = None) -> None:
        if flow.version != (3 if hift.cfg.causal else 2):
            raise ValueError(f"expected flow and HiFT of one version, got flow v{flow.version} and "
                             f"{'causal' if hift.cfg.causal else 'non-causal'} HiFT")
        self.flow, self.hift = flow, hift
        self.config = config or T2WConfig()
        self.hop = flow.chunk_tokens
        self.lookahead = flow.pre_lookahead_len
        self.sample_rate = hift.cfg.sampling_rate
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.RLock()  # the hop state, between the LM's thread and the flow's

    # -- stream lifecycle -------------------------------------------------------------------------

    def add_stream(self, stream_id: str, prompt: FlowPrompt, seed: int = 0, speed: float = 1.0) -> None:
        if stream_id in self._streams:
            raise ValueError(f"expected a new stream id, got {stream_id!r} (already streaming)")
        stretcher = MelStretcher(speed) if speed != 1.0 else None  # validates the range
        vocoder = V3VocoderState() if self.hift.cfg.causal else V2VocoderState.new(seed)
        min_hop = self.config.min_hop_tokens
        end = first_end(prompt.tokens.shape[0], self.hop, self.config.first_hop_tokens)
        if stretcher is not None:
            min_hop = max(min_hop, min_hop_for_speed(speed))
            end = max(end, min_hop)
        with self._lock:
            if stream_id in self._streams:
                raise ValueError(f"expected a new stream id, got {stream_id!r} (already streaming)")
            self._streams[stream_id] = _Stream(prompt=prompt, prompt_tokens=prompt.tokens.tolist(),
                                               vocoder=vocoder, next_end=end, min_hop=min_hop,
                                               stretcher=stretcher)

    def feed(self, stream_id: str, tokens: list[int] | torch.Tensor) -> None:
        stream = self._get(stream_id)
        if stream.is_input_done:
            raise ValueError(f"expected tokens before finish(), got more for {stream_id!r}")
        new = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        vocab = self.flow.input_embedding.num_embeddings
        if any(not 0 <= t < vocab for t in new):
            raise ValueError(f"expected speech tokens in [0, {vocab}), got {[t for t in new if not 0 <= t < vocab]}")
        with self._lock:
            stream.tokens.extend(new)

    def finish(self, stream_id: str) -> None:
        with self._lock:
            self._get(stream_id).is_input_done = True

    def drop(self, stream_id: str) -> None:
        """Forget a stream (cancel); unknown ids are ignored, so a late cancel is harmless."""
        with self._lock:
            self._streams.pop(stream_id, None)

    def has_stream(self, stream_id: str) -> bool:
        return stream_id in self._streams

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def ready(self) -> list[str]:
        """Streams with a chunk that can be computed now, in the order they were added."""
        with self._lock:
            return [sid for sid, s in self._streams.items() if self._plan(s) is not None]

    def _get(self, stream_id: str) -> _Stream:
        try:
            return self._streams[stream_id]
        except KeyError:
            raise KeyError(f"expected a known stream id, got {stream_id!r}") from None

    def _plan(self, s: _Stream) -> tuple[int, bool] | None:
        """(end token, is_final) of the stream's next chunk, or None while it waits for tokens."""
        if len(s.tokens) >= s.next_end + self.lookahead:
            return s.next_end, False
        if s.is_input_done:
            return len(s.tokens), True
        return None

    # -- one batched step ---------------------------------------------------------------------------

    def history_start(self, offset: int) -> int:
        return history_start(offset, self.hop, self.config.max_history_tokens)

    def run(self, stream_ids: list[str]) -> list[WaveChunk]:
        """Compute the next chunk of each listed stream that has one ready, as one batch.

        Streams that were dropped, or have nothing ready, are skipped. A final
        chunk ends its stream. Three phases: `plan` and `commit` hold the lock
        (they read and move the streams' hop state), `compute` does not, so the
        LM's thread may feed, finish, add or drop streams while a flow batch runs
        on another thread (t2w/worker.py); a stream dropped meanwhile yields nothing.
        """
        plans = self.plan(stream_ids)
        return self.commit(plans, self.compute(plans)) if plans else []

    def plan(self, stream_ids: list[str]) -> list[_Plan]:
        with self._lock:
            plans: list[_Plan] = []
            for sid in dict.fromkeys(stream_ids):
                s = self._streams.get(sid)
                plan = self._plan(s) if s is not None else None
                if s is None or plan is None:
                    continue
                end, is_final = plan
                start = self.history_start(s.offset)
                la = 0 if is_final else self.lookahead
                p = s.prompt.tokens.shape[0]
                tokens = torch.tensor([*s.prompt_tokens, *s.tokens[start:end + la]], dtype=torch.long)
                noise_index = torch.cat([torch.arange(2 * p), 2 * (p + start) + torch.arange(2 * (end - start))])
                row = FlowRow(tokens, s.prompt.mel, s.prompt.embedding, la, noise_index)
                plans.append(_Plan(sid, s, end, is_final, start, s.offset, row))
            return plans

    def compute(self, plans: list[_Plan]) -> list[torch.Tensor]:
        """The audio of each planned chunk (the models run here; no lock held)."""
        mels = self.flow.infer([p.row for p in plans], streaming=self.config.streaming_attention)
        new_mels = []
        for plan, mel in zip(plans, mels, strict=True):
            prompt_len = plan.stream.prompt.tokens.shape[0]
            plan.mel = mel[:, 2 * (prompt_len + plan.offset - plan.start):]
            new_mels.append(plan.mel)
        voc_mels = [m if p.stream.stretcher is None else p.stream.stretcher.push(m, p.is_final)
                    for p, m in zip(plans, new_mels, strict=True)]
        return vocode_batch(self.hift, [p.stream.vocoder for p in plans], voc_mels,
                            [p.is_final for p in plans], self.config.hift_context_frames)

    def commit(self, plans: list[_Plan], audios: list[torch.Tensor]) -> list[WaveChunk]:
        """Move each stream past its chunk; chunks of streams dropped since `plan` are discarded."""
        with self._lock:
            out = []
            for p, audio in zip(plans, audios, strict=True):
                if self._streams.get(p.stream_id) is not p.stream:
                    continue  # dropped (cancelled) while its chunk was computed
                assert p.mel is not None
                out.append(WaveChunk(p.stream_id, audio, p.is_final, p.end - p.offset, p.mel))
                if p.is_final:
                    del self._streams[p.stream_id]
                else:
                    p.stream.offset = p.end
                    p.stream.next_end = grid_end(p.stream.prompt.tokens.shape[0], p.end, self.hop,
                                                 p.stream.min_hop)
            return out
