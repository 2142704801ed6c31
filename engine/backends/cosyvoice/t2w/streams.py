"""Token-to-wave streaming: speech tokens as the LM makes them -> 24 kHz audio chunks, many streams
at once.

A backend drives it with plain calls (no threads, no clock):

    t2w.add_stream(sid, prompt)       # FlowPrompt: prompt tokens, prompt mel, x-vector
    t2w.feed(sid, tokens)             # tokens as the LM emits them
    t2w.finish(sid)                   # the LM has stopped: the next chunk is the last
    for chunk in t2w.run(t2w.ready()):  # one batched flow call + batched vocoder calls
        ...chunk.stream_id, chunk.audio [n] float32, chunk.is_final
    t2w.drop(sid)                     # cancel: the stream and any chunk it had ready are gone

Chunking, the history the flow sees and the vocoders' joins: t2w/chunking.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engine.backends.cosyvoice.flow_runtime.solve_graphs import ChunkRow
from engine.backends.cosyvoice.models.flow import FlowModel, FlowRow
from engine.backends.cosyvoice.models.hift import HiFT
from engine.backends.cosyvoice.t2w.cached_flow import CachedFlow, TrimmedPrompt
from engine.backends.cosyvoice.t2w.chunking import (
    MAX_PROMPT_TOKENS,
    FlowPrompt,
    T2WConfig,
    WaveChunk,
    first_end,
    grid_end,
    history_start,
    max_chunk_frames,
    min_hop_for_speed,
    schedule,
)
from engine.backends.cosyvoice.t2w.mel_stretch import MelStretcher
from engine.backends.cosyvoice.t2w.vocoder import V2VocoderState, V3VocoderState, vocode_batch
from engine.backends.cosyvoice.t2w.vocoder_graphs import VocoderGraphs

__all__ = ["MAX_PROMPT_TOKENS", "FlowPrompt", "T2WConfig", "TokenToWave", "WaveChunk", "first_end",
           "grid_end", "history_start", "max_chunk_frames", "min_hop_for_speed", "schedule"]


@dataclass(slots=True)
class _Stream:
    prompt: FlowPrompt
    # the prompt's tokens on the host (the prompt tensors may be on the GPU)
    prompt_tokens: list[int]
    vocoder: V2VocoderState | V3VocoderState
    next_end: int
    min_hop: int
    stretcher: MelStretcher | None = None  # speed != 1
    trim: TrimmedPrompt | None = None  # with the K/V cache: the prompt cut to whole chunks
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
    # None: an empty answer's last chunk (cached: nothing to compute)
    row: FlowRow | ChunkRow | None
    first_frame: int = 0  # cached: the chunk's first new frame
    mel: torch.Tensor | None = None  # [80, frames] this chunk's new mel, once computed


class TokenToWave:
    def __init__(self, flow: FlowModel, hift: HiFT, config: T2WConfig | None = None,
                 cached: CachedFlow | None = None,
                 vocoder_graphs: VocoderGraphs | None = None) -> None:
        if flow.version != (3 if hift.cfg.causal else 2):
            raise ValueError(f"expected flow and HiFT of one version, got flow v{flow.version} and "
                             f"{'causal' if hift.cfg.causal else 'non-causal'} HiFT")
        self.flow, self.hift, self.cached, self.vocoder_graphs = flow, hift, cached, vocoder_graphs
        self.config = config or T2WConfig()
        if cached is not None and (self.config.first_hop_tokens or 0) > flow.chunk_tokens:
            raise ValueError(f"expected first_hop_tokens <= {flow.chunk_tokens} with the K/V cache "
                             f"(one chunk a run), got {self.config.first_hop_tokens}")
        self.hop = flow.chunk_tokens
        self.lookahead = flow.pre_lookahead_len
        self.sample_rate = hift.cfg.sampling_rate
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.RLock()  # the hop state, between the LM's thread and the flow's

    # -- stream lifecycle -------------------------------------------------------------------------

    def add_stream(self, stream_id: str, prompt: FlowPrompt, seed: int = 0,
                   speed: float = 1.0) -> None:
        """A new stream. Raises EngineBusyError when the K/V cache cannot hold it."""
        if stream_id in self._streams:
            raise ValueError(f"expected a new stream id, got {stream_id!r} (already streaming)")
        stretcher = MelStretcher(speed) if speed != 1.0 else None  # validates the range
        vocoder = V3VocoderState() if self.hift.cfg.causal else V2VocoderState.new(seed)
        min_hop = self.config.min_hop_tokens
        if stretcher is not None:
            min_hop = max(min_hop, min_hop_for_speed(speed))
        stream = _Stream(prompt=prompt, prompt_tokens=prompt.tokens.tolist(), vocoder=vocoder,
                         next_end=0, min_hop=min_hop, stretcher=stretcher)
        self._start(stream_id, stream)
        with self._lock:
            if stream_id in self._streams:
                if self.cached is not None:
                    self.cached.cache.release_stream(stream_id)
                raise ValueError(f"expected a new stream id, got {stream_id!r} (already streaming)")
            self._streams[stream_id] = stream

    def _start(self, stream_id: str, s: _Stream) -> None:
        """A stream's first chunk end; with the cache, its trimmed prompt and its memory."""
        s.trim = None if self.cached is None else self.cached.trim(s.prompt)
        prompt_len = s.prompt.tokens.shape[0] if s.trim is None else len(s.trim.tokens)
        s.next_end = first_end(prompt_len, self.hop, self.config.first_hop_tokens)
        if s.stretcher is not None:
            s.next_end = max(s.next_end, s.min_hop)
        if self.cached is not None:
            s.next_end = min(s.next_end, self.hop)  # one chunk a run
            self.cached.ensure_voice(s.prompt)  # its voice's prompt computed (or found) ...
            # ... then its memory: EngineBusyError if none
            self.cached.cache.add_stream(stream_id, s.prompt)

    def num_can_add(self, prompts: list[FlowPrompt]) -> int:
        """How many of these new streams (in order) fit together now."""
        return len(prompts) if self.cached is None else self.cached.cache.num_admissible(prompts)

    def prepare_voice(self, prompt: FlowPrompt) -> None:
        """Compute a voice's cached prompt now (at load) rather than with its first stream.
        Raises EngineBusyError when the cache cannot hold it."""
        if self.cached is not None:
            self.cached.ensure_voice(prompt)

    def forget_voice(self, prompt: FlowPrompt) -> None:
        """The voice is removed: its cached prompt goes (at once, or with its last stream)."""
        if self.cached is not None:
            self.cached.cache.forget_voice(prompt)

    def feed(self, stream_id: str, tokens: list[int] | torch.Tensor) -> None:
        stream = self._get(stream_id)
        if stream.is_input_done:
            raise ValueError(f"expected tokens before finish(), got more for {stream_id!r}")
        new = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        vocab = self.flow.input_embedding.num_embeddings
        if any(not 0 <= t < vocab for t in new):
            raise ValueError(f"expected speech tokens in [0, {vocab}), got "
                             f"{[t for t in new if not 0 <= t < vocab]}")
        with self._lock:
            stream.tokens.extend(new)

    def finish(self, stream_id: str) -> None:
        """The stream's tokens are all in: its next chunk that reaches the end is its last."""
        with self._lock:
            self._get(stream_id).is_input_done = True

    def drop(self, stream_id: str) -> None:
        """Forget a stream (cancel); unknown ids are ignored, so a late cancel is harmless.
        Its cached history is freed (once a chunk of it in flight is done)."""
        with self._lock:
            self._streams.pop(stream_id, None)
            if self.cached is not None:
                self.cached.cache.release_stream(stream_id)

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
        """(end token, is_final) of the stream's next chunk, or None while it waits for tokens.

        Cached, a chunk never crosses the grid: when the answer ends up to 2 tokens
        past a grid point, the chunk before it is one more run (its lookahead
        partly absent, as at the end of the whole answer)."""
        if len(s.tokens) >= s.next_end + self.lookahead:
            return s.next_end, False
        if s.is_input_done:
            if s.trim is not None and len(s.tokens) > s.next_end:
                return s.next_end, False
            return len(s.tokens), True
        return None

    # -- one batched step --------------------------------------------------------------------------

    def history_start(self, offset: int) -> int:
        return history_start(offset, self.hop, self.config.max_history_tokens)

    def run(self, stream_ids: list[str]) -> list[WaveChunk]:
        """Compute the next chunk of each listed stream that has one ready, as one batch.

        Streams that were dropped, or have nothing ready, are skipped. A final
        chunk ends its stream. Three phases: `plan` and `commit` hold the lock
        (they read and move the streams' hop state), `compute` does not, so the
        LM's thread may feed, finish, add or drop streams while a flow batch runs
        on another thread (t2w/worker.py); a stream dropped meanwhile yields nothing,
        and its cached memory is freed when the batch ends (never under a chunk in flight).
        """
        plans = self.plan(stream_ids)
        if not plans:
            return []
        try:
            return self.commit(plans, self.compute(plans))
        finally:
            if self.cached is not None:
                self.cached.cache.end([p.stream_id for p in plans])

    def plan(self, stream_ids: list[str]) -> list[_Plan]:
        with self._lock:
            plans: list[_Plan] = []
            for sid in dict.fromkeys(stream_ids):
                s = self._streams.get(sid)
                plan = self._plan(s) if s is not None else None
                if s is None or plan is None:
                    continue
                plans.append(self._planned(sid, s, *plan))
            if self.cached is not None:
                self.cached.cache.begin([p.stream_id for p in plans])
            return plans

    def _planned(self, sid: str, s: _Stream, end: int, is_final: bool) -> _Plan:
        """The flow row of a stream's next chunk: the chunk over the cache, or prompt + kept
        history + the chunk, recomputed."""
        if self.cached is not None and s.trim is not None:
            if end == s.offset:  # an empty answer: nothing to compute
                return _Plan(sid, s, end, is_final, s.offset, s.offset, None)
            num_present = min(len(s.tokens), end + self.lookahead)
            chunk, first = self.cached.row(sid, s.trim, s.tokens, s.offset, end, num_present)
            return _Plan(sid, s, end, is_final, s.offset, s.offset, chunk, first)
        start = self.history_start(s.offset)
        la = 0 if is_final else self.lookahead
        p = s.prompt.tokens.shape[0]
        tokens = torch.tensor([*s.prompt_tokens, *s.tokens[start:end + la]], dtype=torch.long)
        noise_index = torch.cat([torch.arange(2 * p),
                                 2 * (p + start) + torch.arange(2 * (end - start))])
        row = FlowRow(tokens, s.prompt.mel, s.prompt.embedding, la, noise_index)
        return _Plan(sid, s, end, is_final, start, s.offset, row)

    def compute(self, plans: list[_Plan]) -> list[torch.Tensor]:
        """The audio of each planned chunk (the models run here; no lock held)."""
        new_mels = (self._cached_mels(plans) if self.cached is not None
                    else self._recomputed_mels(plans))
        for plan, mel in zip(plans, new_mels, strict=True):
            plan.mel = mel
        voc_mels = [m if p.stream.stretcher is None else p.stream.stretcher.push(m, p.is_final)
                    for p, m in zip(plans, new_mels, strict=True)]
        step = self.vocoder_graphs.step if self.vocoder_graphs is not None else None
        return vocode_batch(self.hift, [p.stream.vocoder for p in plans], voc_mels,
                            [p.is_final for p in plans], self.config.hift_context_frames, step)

    def _recomputed_mels(self, plans: list[_Plan]) -> list[torch.Tensor]:
        rows = [p.row for p in plans if isinstance(p.row, FlowRow)]
        mels = self.flow.infer(rows, streaming=self.config.streaming_attention)
        return [mel[:, 2 * (p.stream.prompt.tokens.shape[0] + p.offset - p.start):]
                for p, mel in zip(plans, mels, strict=True)]

    def _cached_mels(self, plans: list[_Plan]) -> list[torch.Tensor]:
        """One solve over every planned chunk (empty answers need none)."""
        assert self.cached is not None
        rows = [p.row for p in plans if isinstance(p.row, ChunkRow)]
        chunks = iter(self.cached.solver.solve(rows)) if rows else iter(())
        dev = self.flow.noise.device
        out = []
        for p in plans:
            if isinstance(p.row, ChunkRow):
                out.append(next(chunks)[:, p.first_frame:p.row.num_frames])
            else:
                out.append(torch.zeros(80, 0, device=dev))
        return out

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
                    if self.cached is not None:
                        self.cached.cache.release_stream(p.stream_id)
                    continue
                p.stream.offset = p.end
                if p.stream.trim is None:
                    p.stream.next_end = grid_end(p.stream.prompt.tokens.shape[0], p.end, self.hop,
                                                 p.stream.min_hop)
                    continue
                # its chunk is whole: history now
                if p.end % self.hop == 0 and self.cached is not None:
                    self.cached.cache.complete_chunk(p.stream_id)
                p.stream.next_end = (p.end // self.hop + 1) * self.hop
            return out
