"""A vendor context: one client context and the native contexts that speak it (sans-I/O).

A vendor context maps onto native contexts one after another (gateway/compat/core.py
says why); the record keeps what the vendor's frames need across them: which
native contexts are live, where the audio of the one speaking starts in the
vendor context, the segments whose timings are final and not yet sent
(alignments), the text skipped, and the encoder. Raw formats get a new encoder
per native context, cut in frames like the native socket's; a compressed format
(MP3, Ogg Opus) is one stream for the whole vendor context, handed to each
native context's playout, whose end is not the stream's: the vendor context's
end drains it (`end_stream`). Each adapter keeps its own fields on a subclass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from gateway.audio.codecs import EncodedFrame
from gateway.audio.encoders import AudioEncoder, EncoderFactory
from gateway.audio.formats import AudioFormat
from gateway.compat.alignment import Tracked
from gateway.compat.formats import OutputFormat
from gateway.stream.actions import SegmentFramed
from gateway.stream.skipped import SkippedText


class SharedStream:
    """A vendor context's stream as one native context's playout sees it: encoded there, one
    call per chunk; drained by the vendor context, never by the playout (`flush` is a no-op)."""

    def __init__(self, encoder: AudioEncoder) -> None:
        self._encoder = encoder

    @property
    def format(self) -> AudioFormat:
        return self._encoder.format

    @property
    def codec(self) -> str:
        return self._encoder.codec

    @property
    def sample_rate_in(self) -> int:
        return self._encoder.sample_rate_in

    def encode(self, pcm: np.ndarray) -> list[EncodedFrame]:
        return self._encoder.encode(pcm)

    def flush(self) -> list[EncodedFrame]:
        return []


@dataclass(slots=True)
class VendorContext:
    """One client context (see the module doc)."""

    vendor_id: str
    output: OutputFormat
    current: str | None = None                     # the native context taking text
    live: list[str] = field(default_factory=list)  # native contexts not done, in order
    is_input_closed: bool = False                  # done once `live` is
    audio_ms: float = 0.0                          # audio passed on so far
    num_segments: int = 0                          # spoken segments aligned so far
    aligned: deque[Tracked] = field(default_factory=deque)  # timings final, not yet sent
    speaking: str | None = None                    # the native context of the audio passed on
    speaking_start_ms: float = 0.0                 # where its audio starts in this context
    step_ms: float = 0.0                           # the engine time behind that audio
    skipped: SkippedText = field(default_factory=SkippedText)
    stream: AudioEncoder | None = None             # a compressed format's one stream

    def open_encoder(self, encoders: EncoderFactory, sample_rate_in: int) -> AudioEncoder:
        """The encoder for a new native context of this vendor context."""
        if not self.output.is_stream:
            return encoders.open(self.output.audio, sample_rate_in)
        if self.stream is None:
            self.stream = encoders.open(self.output.audio, sample_rate_in)
        return SharedStream(self.stream)

    def end_stream(self, encoders: EncoderFactory, sample_rate_in: int) -> bytes:
        """A compressed stream's last bytes (a stream with no audio is its header alone,
        a file a decoder reads as empty); b"" for a raw format."""
        if not self.output.is_stream:
            return b""
        if self.stream is None:
            self.stream = encoders.open(self.output.audio, sample_rate_in)
        return b"".join(frame.data for frame in self.stream.flush())

    def started(self, native_id: str) -> None:
        """A segment of `native_id` starts: its audio follows all that was passed on before."""
        if self.speaking != native_id:
            self.speaking, self.speaking_start_ms = native_id, self.audio_ms

    def framed(self, note: SegmentFramed) -> None:
        """A segment of the native context speaking has its final timings: align it."""
        self.aligned.append(Tracked(note.text, note.words, note.audio_ms,
                                    self.speaking_start_ms + note.pts_ms,
                                    is_first=self.num_segments == 0))
        self.num_segments += 1

    def take_aligned(self) -> list[Tracked]:
        aligned = list(self.aligned)
        self.aligned.clear()
        return aligned
