"""Streaming audio containers for the OpenAI-compatible `POST /v1/audio/speech`.

`ContainerStreamEncoder(fmt, sample_rate_in)` turns PCM into the bytes of one
response body as the audio is made: `encode(pcm)` returns the bytes ready to
send now, `finish()` the rest. The muxer (PyAV's `av.open` in write mode)
writes into a non-seekable in-memory sink that is drained after every write,
so nothing is held back beyond what the codec and muxer need.

Formats follow OpenAI's `response_format` names; a format is offered only if
this PyAV build has its encoder and muxer (`available_formats()`):

| format | body | rate |
|---|---|---|
| opus | Ogg Opus (pages of at most 100 ms, so it streams) | 48 kHz |
| wav  | RIFF WAVE, PCM16 mono | 24 kHz |
| pcm  | raw PCM16 little-endian mono, no header (as OpenAI) | 24 kHz |
| mp3  | MPEG audio (LAME) | 24 kHz |
| flac | FLAC | 24 kHz |
| aac  | AAC in ADTS | 24 kHz |

Streamed WAV: the length is unknown when the header goes out, so the RIFF and
`data` sizes are 0xFFFFFFFF, as OpenAI's streamed WAV does; FFmpeg and browsers
read to the end of the body. The header is the plain 44-byte one (the muxer
runs with `bitexact`, which leaves out the LIST/INFO encoder tag).

The PCM is wrapped in one `av.AudioFrame` at the engine's rate and handed
straight to the stream's encoder, whose codec context resamples it, converts
the sample format and cuts codec-sized frames in one pass (the raw `pcm` body,
having no codec, takes the same pass through one `AudioResampler` to s16).
"""

from __future__ import annotations

from dataclasses import dataclass

import av
import numpy as np

from gateway.audio.codecs import as_mono_float32, to_frame


@dataclass(slots=True, frozen=True)
class ContainerSpec:
    muxer: str  # FFmpeg muxer name; "" for a raw body
    codec: str  # FFmpeg encoder name
    sample_rate: int
    content_type: str
    bitrate: int | None = None


SPECS: dict[str, ContainerSpec] = {
    "opus": ContainerSpec("ogg", "libopus", 48000, "audio/ogg", 32000),
    "wav": ContainerSpec("wav", "pcm_s16le", 24000, "audio/wav"),
    "pcm": ContainerSpec("", "pcm_s16le", 24000, "audio/pcm"),
    "mp3": ContainerSpec("mp3", "libmp3lame", 24000, "audio/mpeg", 64000),
    "flac": ContainerSpec("flac", "flac", 24000, "audio/flac"),
    "aac": ContainerSpec("adts", "aac", 24000, "audio/aac", 64000),
}
OGG_PAGE_DURATION_US = 100_000  # flush an Ogg page at least every 100 ms of audio


def _has_encoder(name: str) -> bool:
    try:
        av.Codec(name, "w")
    except ValueError:  # UnknownCodecError: absent, or present as a decoder only
        return False
    return True


def _detect_formats() -> tuple[str, ...]:
    return tuple(
        name
        for name, spec in SPECS.items()
        if (spec.muxer == "" or spec.muxer in av.formats_available) and _has_encoder(spec.codec)
    )


_AVAILABLE = _detect_formats()


def available_formats() -> tuple[str, ...]:
    """The `response_format` values this build can produce, in OpenAI's order."""
    return _AVAILABLE


class MuxSink:
    """A write-only, non-seekable file for the muxer; `drain` takes what it wrote.

    Shared by the HTTP bodies here and the vendor sockets' transcoder (gateway/compat/formats.py).
    """

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
    """Encodes one response body in `fmt` from mono PCM at `sample_rate_in`."""

    def __init__(self, fmt: str, sample_rate_in: int) -> None:
        if fmt not in _AVAILABLE:
            raise ValueError(f"expected response_format in {_AVAILABLE}, got {fmt!r}")
        if not isinstance(sample_rate_in, int) or not 8000 <= sample_rate_in <= 192000:
            raise ValueError(
                f"expected sample_rate_in within 8000-192000 Hz, got {sample_rate_in!r}"
            )
        spec = SPECS[fmt]
        self.format = fmt
        self.content_type = spec.content_type
        self.sample_rate = spec.sample_rate
        self.sample_rate_in = sample_rate_in
        self._is_finished = False
        self._sink = MuxSink()
        self._container: av.container.OutputContainer | None = None
        self._stream: av.AudioStream | None = None
        if spec.muxer:
            options = {"fflags": "+bitexact"}
            if spec.muxer == "ogg":
                options["page_duration"] = str(OGG_PAGE_DURATION_US)
            container = av.open(self._sink, "w", format=spec.muxer, container_options=options)
            stream = container.add_stream(spec.codec, rate=spec.sample_rate, layout="mono")
            assert isinstance(stream, av.AudioStream)
            if spec.bitrate is not None:
                stream.codec_context.bit_rate = spec.bitrate
            self._container, self._stream = container, stream
        # a raw body has no codec to convert for it
        self._resampler = (None if spec.muxer else
                           av.AudioResampler(format="s16", layout="mono", rate=spec.sample_rate))

    def encode(self, pcm: np.ndarray) -> bytes:
        """Take mono PCM at `sample_rate_in`; return the body bytes ready now."""
        if self._is_finished:
            raise RuntimeError("expected encode() before finish(), got encode() after finish()")
        samples = as_mono_float32(pcm)
        if len(samples) == 0:
            return b""
        return self._write(to_frame(samples, self.sample_rate_in))

    def finish(self) -> bytes:
        """Drain the resampler, codec and muxer; return the last bytes of the body."""
        if self._is_finished:
            return b""
        self._is_finished = True
        body = self._write(None)
        if self._container is None:
            return body
        # With no audio at all the header is not written yet; a header-only body
        # is still a valid (empty) file.
        self._container.start_encoding()
        self._container.close()
        return body + self._sink.drain()

    def _write(self, frame: av.AudioFrame | None) -> bytes:
        """Encode one frame at `sample_rate_in` (None: drain); the bytes the body has now."""
        if self._resampler is not None:
            # each piece: s16 mono at self.sample_rate
            return b"".join(bytes(piece.planes[0])[: 2 * piece.samples]
                            for piece in self._resampler.resample(frame))
        assert self._container is not None and self._stream is not None
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.drain()
