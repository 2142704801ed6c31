"""Vendor audio formats: what each compatible socket may ask for, and the one transcoder.

The native session (gateway/stream/session.py) encodes PCM16 at 48/24/16/8 kHz or
G.711 mu-law. A vendor format that is one of those passes through untouched
(`native_format`); any other (PCM at 22050/44100 Hz, 32-bit float PCM, A-law,
MP3, Ogg Opus) is made from native PCM16 at 48 kHz by one `Transcoder` per
vendor context, so that a compressed stream stays one stream across the
context's sentences: LiveKit's decoder reads a context's MP3 or Ogg bytes as
one file.

| kind | FFmpeg | rates |
|---|---|---|
| pcm_s16le | swresample to s16 | 8000-48000 |
| pcm_f32le | swresample to flt | 8000-48000 |
| mulaw, alaw | pcm_mulaw / pcm_alaw | 8000 |
| mp3 | libmp3lame in the mp3 muxer, constant bitrate | 22050, 44100 |
| ogg_opus | libopus in the ogg muxer, 20 ms pages | 48000 |
"""

from __future__ import annotations

from dataclasses import dataclass

import av
import numpy as np

from gateway.audio.codecs import decode_pcm16, to_frame
from gateway.audio.containers import MuxSink
from gateway.audio.formats import SAMPLE_RATES

KINDS = ("pcm_s16le", "pcm_f32le", "mulaw", "alaw", "mp3", "ogg_opus")
PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
MP3_RATES = (22050, 44100)
MP3_BITRATES = (32, 64, 96, 128, 192)
OPUS_BITRATES = (32, 64, 96, 128, 192)
TRANSCODE_FROM_RATE = 48000  # the native PCM16 rate non-native formats are made from
OGG_PAGE_DURATION_US = 20_000  # a page per Opus packet: a decoder hears each 20 ms at once


@dataclass(slots=True, frozen=True)
class OutputFormat:
    """One vendor output format; `bitrate` in bit/s for mp3 and ogg_opus."""

    kind: str
    sample_rate: int
    bitrate: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"expected an audio kind in {KINDS}, got {self.kind!r}")
        if self.kind in ("mulaw", "alaw") and self.sample_rate != 8000:
            raise ValueError(f"{self.kind} is defined at 8000 Hz only, got {self.sample_rate}")
        if self.kind == "mp3" and self.sample_rate not in MP3_RATES:
            raise ValueError(f"mp3 is offered at {MP3_RATES} Hz, got {self.sample_rate}")
        if self.kind == "ogg_opus" and self.sample_rate != 48000:
            raise ValueError(f"Ogg Opus runs at 48000 Hz, got {self.sample_rate}")
        if self.kind.startswith("pcm") and self.sample_rate not in PCM_RATES:
            raise ValueError(f"PCM is offered at {PCM_RATES} Hz, got {self.sample_rate}")

    @property
    def bytes_per_second(self) -> float | None:
        """For raw formats (duration = bytes / this); None for compressed ones."""
        width = {"pcm_s16le": 2, "pcm_f32le": 4, "mulaw": 1, "alaw": 1}.get(self.kind)
        return None if width is None else float(width * self.sample_rate)


def native_format(fmt: OutputFormat) -> tuple[str, int, bool]:
    """(native codec, native sample rate, needs a Transcoder) for a vendor format."""
    if fmt.kind == "pcm_s16le" and fmt.sample_rate in SAMPLE_RATES:
        return "pcm16", fmt.sample_rate, False
    if fmt.kind == "mulaw":
        return "mulaw", 8000, False
    return "pcm16", TRANSCODE_FROM_RATE, True


class Transcoder:
    """Native PCM16 at `TRANSCODE_FROM_RATE` in, one vendor format's bytes out (streaming)."""

    def __init__(self, fmt: OutputFormat) -> None:
        self.format = fmt
        self._is_finished = False
        self._sink = MuxSink()
        self._container: av.container.OutputContainer | None = None
        self._stream: av.AudioStream | None = None
        self._codec: av.AudioCodecContext | None = None
        self._resampler: av.AudioResampler | None = None
        if fmt.kind in ("mp3", "ogg_opus"):
            muxer, codec = ("mp3", "libmp3lame") if fmt.kind == "mp3" else ("ogg", "libopus")
            options = {"fflags": "+bitexact"}
            if muxer == "ogg":
                options["page_duration"] = str(OGG_PAGE_DURATION_US)
            self._container = av.open(self._sink, "w", format=muxer, container_options=options)
            stream = self._container.add_stream(codec, rate=fmt.sample_rate, layout="mono")
            assert isinstance(stream, av.AudioStream)
            stream.codec_context.bit_rate = fmt.bitrate or 32000
            self._stream = stream
            return
        sample_format = "flt" if fmt.kind == "pcm_f32le" else "s16"
        self._resampler = av.AudioResampler(format=sample_format, layout="mono", rate=fmt.sample_rate)
        if fmt.kind in ("mulaw", "alaw"):
            codec_context = av.CodecContext.create("pcm_" + fmt.kind, "w")
            assert isinstance(codec_context, av.AudioCodecContext)
            codec_context.sample_rate = 8000
            codec_context.layout = "mono"
            codec_context.format = "s16"
            codec_context.open()
            self._codec = codec_context

    def encode(self, pcm16: bytes) -> bytes:
        """Native PCM16 LE bytes at `TRANSCODE_FROM_RATE`; the output bytes ready now."""
        if self._is_finished:
            raise RuntimeError("expected encode() before finish(), got encode() after finish()")
        if not pcm16:
            return b""
        return self._write(to_frame(decode_pcm16(pcm16), TRANSCODE_FROM_RATE))

    def finish(self) -> bytes:
        """Drain resampler, codec and muxer: the last bytes of the stream."""
        if self._is_finished:
            return b""
        self._is_finished = True
        body = self._write(None)
        if self._container is not None:
            self._container.start_encoding()  # a stream with no audio still gets its header
            self._container.close()
            body += self._sink.drain()
        return body

    def _write(self, frame: av.AudioFrame | None) -> bytes:
        if self._container is not None:
            assert self._stream is not None
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
            return self._sink.drain()
        assert self._resampler is not None
        out: list[bytes] = []
        for piece in self._resampler.resample(frame):
            width = 4 if self.format.kind == "pcm_f32le" else 2
            if self._codec is None:
                out.append(bytes(piece.planes[0])[: width * piece.samples])
            else:
                out.extend(bytes(packet) for packet in self._codec.encode(piece))
        return b"".join(out)


def decode_raw(data: bytes, fmt: OutputFormat) -> np.ndarray:
    """Raw vendor bytes back to float32 PCM at `fmt.sample_rate` (tests and benchmarks)."""
    if fmt.kind == "pcm_s16le":
        return decode_pcm16(data)
    if fmt.kind == "pcm_f32le":
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if fmt.kind not in ("mulaw", "alaw"):
        raise ValueError(f"expected a raw format, got {fmt.kind!r}")
    context = av.CodecContext.create("pcm_" + fmt.kind, "r")
    assert isinstance(context, av.AudioCodecContext)
    context.sample_rate = 8000
    context.layout = "mono"
    frames = context.decode(av.Packet(data))
    return np.concatenate([f.to_ndarray()[0].astype(np.float32) / 32768.0 for f in frames]) \
        if frames else np.zeros(0, np.float32)
