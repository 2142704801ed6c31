"""Streaming muxed audio: MP3, Ogg Opus, WAV, FLAC and AAC, written as the audio is made.

`ContainerStreamEncoder(fmt, sample_rate_in)` turns PCM into the bytes of one
stream for the muxed kinds of `AudioFormat` (gateway/audio/formats.py): the HTTP
speech route's bodies and the vendor sockets' MP3 and Ogg Opus. `encode(pcm)`
returns what the muxer wrote for it, `flush()` the rest, each as `EncodedFrame`s
(gateway/audio/codecs.py) whose durations are the input's, so that they add up
to the audio given, sample for sample. The muxer (PyAV's `av.open` in write mode)
writes into a non-seekable in-memory sink that is drained after every write, so
nothing is held back beyond what the codec and muxer need. A kind is offered only
where this PyAV build has its encoder and muxer (`is_available`).

| kind | muxer | encoder |
|---|---|---|
| mp3 | mp3 | libmp3lame (constant bitrate; 64 kbit/s by default) |
| ogg_opus | ogg, a page at least every `frame_ms` | libopus (32 kbit/s by default) |
| wav | wav (PCM16; streamed, lengths 0xFFFFFFFF) | pcm_s16le |
| flac | flac | flac |
| aac | adts | aac (64 kbit/s by default) |

Streamed WAV: the length is unknown when the header goes out, so the RIFF and
`data` sizes are 0xFFFFFFFF, as OpenAI's streamed WAV does; FFmpeg and browsers
read to the end of the body. The header is the plain 44-byte one (the muxer
runs with `bitexact`, which leaves out the LIST/INFO encoder tag).

The PCM is wrapped in one `av.AudioFrame` at the engine's rate and handed
straight to the stream's encoder, whose codec context resamples it, converts
the sample format and cuts codec-sized frames in one pass.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cache

import av
import numpy as np

from gateway.audio.codecs import EncodedFrame, as_mono_float32, check_rate_in, to_frame
from gateway.audio.formats import MUXED_KINDS, AudioFormat


@dataclass(slots=True, frozen=True)
class MuxSpec:
    muxer: str  # FFmpeg muxer name
    codec: str  # FFmpeg encoder name
    bitrate: int | None = None  # the default; `AudioFormat.bitrate` overrides it


SPECS: dict[str, MuxSpec] = {
    "mp3": MuxSpec("mp3", "libmp3lame", 64000),
    "ogg_opus": MuxSpec("ogg", "libopus", 32000),
    "wav": MuxSpec("wav", "pcm_s16le"),
    "flac": MuxSpec("flac", "flac"),
    "aac": MuxSpec("adts", "aac", 64000),
}


@cache
def is_available(kind: str) -> bool:
    """This PyAV build has the kind's muxer and encoder."""
    spec = SPECS.get(kind)
    if spec is None or spec.muxer not in av.formats_available:
        return False
    try:
        av.Codec(spec.codec, "w")
    except ValueError:  # UnknownCodecError: absent, or present as a decoder only
        return False
    return True


class MuxSink:
    """A write-only, non-seekable file for the muxer; `drain` takes what it wrote."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._chunks.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


class ContainerStreamEncoder:
    """Encodes one stream of a muxed kind from mono PCM at `sample_rate_in` (see the module doc).

    `tally`, when given, counts each `encode` call under the kind (the factory's counter).
    """

    def __init__(self, fmt: AudioFormat, sample_rate_in: int, *,
                 tally: Counter[str] | None = None) -> None:
        if fmt.kind not in MUXED_KINDS or not is_available(fmt.kind):
            offered = tuple(k for k in MUXED_KINDS if is_available(k))
            raise ValueError(f"expected a muxed kind in {offered}, got {fmt.kind!r}")
        check_rate_in(sample_rate_in)
        spec = SPECS[fmt.kind]
        self.format = fmt
        self.codec = fmt.kind
        self.sample_rate = fmt.sample_rate
        self.sample_rate_in = int(sample_rate_in)
        self._tally = tally
        self._is_finished = False
        self._sink = MuxSink()
        options = {"fflags": "+bitexact"}
        if spec.muxer == "ogg" and fmt.frame_ms:
            options["page_duration"] = str(1000 * fmt.frame_ms)  # in microseconds
        self._container = av.open(self._sink, "w", format=spec.muxer, container_options=options)
        stream = self._container.add_stream(spec.codec, rate=fmt.sample_rate, layout="mono")
        assert isinstance(stream, av.AudioStream)
        bitrate = fmt.bitrate or spec.bitrate
        if bitrate is not None:
            stream.codec_context.bit_rate = bitrate
        self._stream = stream

    def encode(self, pcm: np.ndarray) -> list[EncodedFrame]:
        """Take mono PCM at `sample_rate_in`; the bytes the stream has for it now."""
        if self._is_finished:
            raise RuntimeError("expected encode() before flush(), got encode() after flush()")
        if self._tally is not None:
            self._tally[self.codec] += 1
        samples = as_mono_float32(pcm)
        if len(samples) == 0:
            return []
        data = self._write(to_frame(samples, self.sample_rate_in))
        return [EncodedFrame(data, 1000.0 * len(samples) / self.sample_rate_in)]

    def flush(self) -> list[EncodedFrame]:
        """Drain the codec and muxer: the last bytes of the stream (its header alone when no
        audio came: a header-only stream is still a valid, empty, file)."""
        if self._is_finished:
            return []
        self._is_finished = True
        data = self._write(None)
        self._container.start_encoding()
        self._container.close()
        data += self._sink.drain()
        return [EncodedFrame(data, 0.0)] if data else []

    def _write(self, frame: av.AudioFrame | None) -> bytes:
        """Encode one frame at `sample_rate_in` (None: drain); the bytes the stream has now."""
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.drain()
