"""The chunk schedule of token-to-wave streaming, and what a stream is made of (t2w/streams.py runs
it).

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
- without the K/V cache, the flow recomputes the prompt plus the token
  history each chunk (it is a diffusion over the whole sequence); upstream
  keeps the whole history, so a chunk costs more the longer the answer.
  `max_history_tokens` bounds it: only the most recent history (cut on the
  25-token grid, at least that many tokens) is recomputed, with the noise of
  its absolute frames. docs/cosyvoice-design.md, "Bounded history", gives the
  measured cost in fidelity; None keeps upstream's full recomputation.
- with the K/V cache (CosyVoice 3, `cached`: t2w/cached_flow.py), a chunk
  costs its own frames: the prompt is trimmed to whole 25-token chunks, the
  grid counts from the answer's start, and each run computes the one chunk
  holding a stream's next token (after a partial first hop, the next chunk
  ends on the grid whatever `min_hop_tokens` says, so the first hop's chunk
  is computed again whole). The cache's ring keeps the history.
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
from dataclasses import dataclass

import torch

from engine.backends.cosyvoice.models.mel import MelExtractor


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
            raise ValueError("expected max_history_tokens >= 0 or None, got "
                             f"{self.max_history_tokens}")
        if self.hift_context_frames < 8:
            raise ValueError(f"expected hift_context_frames >= 8, got {self.hift_context_frames}")


@dataclass(slots=True)
class FlowPrompt:
    """A voice as the flow needs it: tokens [Np] int64, mel [P <= 2 Np, 80], embedding [192]."""

    tokens: torch.Tensor
    mel: torch.Tensor
    embedding: torch.Tensor

    @classmethod
    def from_audio(cls, tokens: list[int] | torch.Tensor, wav_24k: torch.Tensor,
                   embedding: torch.Tensor, mel: MelExtractor) -> FlowPrompt:
        """Mel of the 24 kHz reference audio, and tokens and mel trimmed to a 1:2 ratio as
        upstream's frontend does (the LM prompt should use the same trimmed tokens)."""
        feat = mel(wav_24k)[0]  # [frames, 80]
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = min(feat.shape[0] // 2, toks.shape[0])
        return cls(toks[:n], feat[: 2 * n],
                   torch.as_tensor(embedding, dtype=torch.float32).reshape(-1))

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.shape[0] == 0:
            raise ValueError("expected prompt tokens [N >= 1], got shape "
                             f"{tuple(self.tokens.shape)}")
        if self.tokens.shape[0] > MAX_PROMPT_TOKENS:  # bounds every flow row (max_chunk_frames)
            raise ValueError(f"expected at most {MAX_PROMPT_TOKENS} prompt tokens (30 s of "
                             f"reference audio), got {self.tokens.shape[0]}")
        max_frames = 2 * self.tokens.shape[0]
        if self.mel.dim() != 2 or self.mel.shape[1] != 80 or self.mel.shape[0] > max_frames:
            raise ValueError(f"expected prompt mel [<= {2 * self.tokens.shape[0]}, 80], got "
                             f"{tuple(self.mel.shape)}")
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
    chunk = max(config.first_hop_tokens or 2 * hop,
                max(config.min_hop_tokens, min_hop_for_speed(2.0)) + hop - 1)
    return 2 * (max_prompt_tokens + history + chunk + lookahead)


def min_hop_for_speed(speed: float) -> int:
    """Fewest tokens a chunk needs at `speed` to still give >= 8 stretched mel frames, with a frame
    to spare."""
    return math.ceil(4.5 * speed) + 1
