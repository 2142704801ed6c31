"""The one audio output stage: an encoder per context, opened by its `AudioFormat`.

Every way audio leaves the gateway goes through `EncoderFactory.open`: the
native socket's Opus, PCM16 and mu-law frames, the vendor sockets' PCM, G.711,
MP3 and Ogg Opus, and the HTTP speech route's bodies. Each opens one encoder
for the format asked, fed the engine's PCM at the voice's rate, so each format
is encoded once, in one pass (resample and encode together where FFmpeg can):
never made as PCM16 first and transcoded after.

An encoder is a self-contained call: PCM in, `EncodedFrame`s out, with its
state (resampler, codec, muxer) its own. `Playout` (gateway/stream/playout.py)
calls it and packs and paces what comes out, so a caller could as well run the
`encode` somewhere else and hand the frames on.

The factory counts what it opened and each `encode` call, by kind
(`num_opened`, `num_encodes`): one encode per engine chunk is the promise, and
tests hold it to that.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import numpy as np

from gateway.audio.codecs import EncodedFrame, StreamEncoder
from gateway.audio.containers import ContainerStreamEncoder
from gateway.audio.formats import DEFAULT_OPUS_COMPLEXITY, AudioFormat


class AudioEncoder(Protocol):
    """One context's encoder (gateway/audio/codecs.py for framed kinds, containers.py for
    muxed ones): `encode` takes mono PCM at `sample_rate_in`, `flush` drains it (once)."""

    @property
    def format(self) -> AudioFormat: ...

    @property
    def codec(self) -> str: ...

    @property
    def sample_rate_in(self) -> int: ...

    def encode(self, pcm: np.ndarray) -> list[EncodedFrame]: ...

    def flush(self) -> list[EncodedFrame]: ...


class EncoderFactory:
    """Opens the encoder for an output format, and counts (see the module doc)."""

    def __init__(self, *, opus_complexity: int = DEFAULT_OPUS_COMPLEXITY) -> None:
        self.opus_complexity = opus_complexity
        self.num_opened: Counter[str] = Counter()
        self.num_encodes: Counter[str] = Counter()

    def open(self, fmt: AudioFormat, sample_rate_in: int) -> AudioEncoder:
        """A new encoder of `fmt` for PCM at `sample_rate_in` (raises ValueError for a kind this
        PyAV build cannot make)."""
        encoder: AudioEncoder
        if fmt.is_framed:
            encoder = StreamEncoder(fmt, sample_rate_in, complexity=self.opus_complexity,
                                    tally=self.num_encodes)
        else:
            encoder = ContainerStreamEncoder(fmt, sample_rate_in, tally=self.num_encodes)
        self.num_opened[fmt.kind] += 1
        return encoder
