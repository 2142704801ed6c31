"""Per-context audio encoding into whole frames: resample, cut frames, encode.

One `StreamEncoder` per context (docs/architecture.md, "Audio"), for the framed
kinds of `AudioFormat` (gateway/audio/formats.py). It takes the engine's mono
float32 PCM at the voice's rate and returns whole `frame_ms` frames: Opus
packets (libopus, bundled in PyAV's wheels), PCM16 or float32 little-endian
bytes at any PCM rate, or G.711 mu-law or A-law bytes at 8 kHz. `encode`
returns only whole frames and keeps the remainder; `flush` pads the last
partial frame with silence. Raw PCM may also go unframed (`frame_ms` 0: the
bytes as they come, nothing held, nothing padded). gateway/audio/encoders.py
opens it; the muxed kinds (MP3, Ogg, WAV...) are gateway/audio/containers.py's.

The audio path, once. The PCM is checked and cast where it enters
(`as_mono_float32`, a no-op for the engine's float32) and wrapped in one
`av.AudioFrame`; from there FFmpeg does the rest in one pass and nothing comes
back to numpy. For Opus the codec context itself resamples (swresample) and
cuts codec-sized frames: PyAV runs every frame it encodes through a filter graph
set to the codec's rate and frame size, so a separate resampler before it
would only convert twice. For the raw kinds one `AudioResampler` converts
rate and sample format (float to s16, with swresample's rounding and clipping,
or to flt); PCM is the bytes of its output, G.711 FFmpeg's encoder run on that
output, and whole frames are cut from those bytes.

Opus lookahead. libopus delays its output by a fixed lookahead (6.5 ms in the
default application: 312 samples at 48 kHz, the OpusHead "pre-skip"). We do
not shift the input; instead the stream behaves like an Ogg Opus stream:
a decoder drops the first `pre_skip` samples (at the output rate) and the
decoded audio then lines up sample for sample with the input. So that the tail
of the input is not cut off, `flush` emits as many frames as needed to cover
`input + pre_skip` samples: FFmpeg's libopus wrapper counts the lookahead as
samples still owed (its `initial_padding`) and drains with silent frames until
they are out, so the frame count is `ceil((n + pre_skip) / F)`: `ceil(n / F)`
unless the last frame's silence padding is shorter than the lookahead, in which
case one more (silent-tailed) frame follows. `opus_head` gives the 19-byte
OpusHead (WebCodecs `description`) carrying that pre-skip (RFC 7845, 5.1).
The raw kinds have no delay: `ceil(n / F)` frames exactly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import av
import numpy as np

from gateway.audio.formats import (
    DEFAULT_OPUS_BITRATE,
    DEFAULT_OPUS_COMPLEXITY,
    FRAMED_KINDS,
    MULAW_SAMPLE_RATE,
    AudioFormat,
)

#: each raw kind's sample: (FFmpeg sample format, G.711 encoder or "", bytes of silence)
_RAW = {
    "pcm16": ("s16", "", b"\x00\x00"),
    "pcm_f32": ("flt", "", b"\x00\x00\x00\x00"),
    "mulaw": ("s16", "pcm_mulaw", b"\xff"),  # G.711 mu-law codes zero as 0xFF
    "alaw": ("s16", "pcm_alaw", b"\xd5"),    # and A-law as 0xD5
}


@dataclass(slots=True, frozen=True)
class EncodedFrame:
    """One piece of encoded audio: an Opus packet, a frame of PCM or G.711 bytes, or the bytes
    a muxer wrote for `duration_ms` of input (gateway/audio/containers.py)."""

    data: bytes
    duration_ms: float


def pcm_to_float(pcm: np.ndarray) -> np.ndarray:
    """int16 or float PCM -> float32 in [-1, 1] (int16 is scaled by 1/32768)."""
    if pcm.dtype == np.int16:
        return pcm.astype(np.float32) * np.float32(1.0 / 32768.0)
    if not np.issubdtype(pcm.dtype, np.floating):
        raise ValueError(f"expected int16 or floating PCM, got dtype {pcm.dtype}")
    return pcm.astype(np.float32, copy=False)


def float_to_pcm16(pcm: np.ndarray) -> np.ndarray:
    """float PCM in [-1, 1] -> int16, clipped (values past full scale saturate)."""
    scaled = np.clip(pcm, -1.0, 1.0) * np.float32(32767.0)
    pcm16: np.ndarray = np.rint(scaled).astype(np.int16)
    return pcm16


def as_mono_float32(pcm: np.ndarray) -> np.ndarray:
    """Validate mono PCM ([num_samples], int16 or float) and return it as float32.

    The one cast on the gateway's audio path: the engine's float32 passes
    through without a copy.
    """
    if not isinstance(pcm, np.ndarray):
        raise TypeError(f"expected a numpy array of PCM, got {type(pcm).__name__}")
    if pcm.ndim != 1:
        raise ValueError(f"expected mono PCM of shape [num_samples], got shape {pcm.shape}")
    return np.ascontiguousarray(pcm_to_float(pcm))


def to_frame(samples: np.ndarray, sample_rate: int) -> av.AudioFrame:
    """PCM as `as_mono_float32` returns it ([num_samples] float32) in one "flt" AudioFrame."""
    frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
    frame.sample_rate = sample_rate
    return frame


def check_rate_in(sample_rate_in: int) -> None:
    if not isinstance(sample_rate_in, (int, np.integer)) or not 8000 <= sample_rate_in <= 192000:
        raise ValueError(f"expected sample_rate_in within 8000-192000 Hz, got {sample_rate_in!r}")


class StreamEncoder:
    """Encodes one context's PCM into whole frames of one framed kind (see module doc).

    Opened by gateway/audio/encoders.py (or `make_encoder`). Attributes: `format`,
    `codec` (its kind), `sample_rate` (output), `sample_rate_in`, `frame_ms`,
    `frame_samples` (per frame at the output rate; 0 unframed), `bitrate` (Opus only,
    else None), `pre_skip` (output samples a decoder drops; 0 for the raw kinds),
    `opus_head` (OpusHead bytes or None). `tally`, when given, counts each `encode`
    call under the kind (the factory's counter).
    """

    def __init__(self, fmt: AudioFormat, sample_rate_in: int, *,
                 complexity: int = DEFAULT_OPUS_COMPLEXITY,
                 tally: Counter[str] | None = None) -> None:
        if not fmt.is_framed:
            raise ValueError(f"expected a framed kind in {FRAMED_KINDS}, got {fmt.kind!r}")
        check_rate_in(sample_rate_in)
        if not 0 <= complexity <= 10:
            raise ValueError(f"expected complexity within 0-10, got {complexity!r}")
        self.format = fmt
        self.codec = fmt.kind
        self.sample_rate = fmt.sample_rate
        self.sample_rate_in = int(sample_rate_in)
        self.frame_ms = fmt.frame_ms
        self.frame_samples = fmt.sample_rate * fmt.frame_ms // 1000
        self.bitrate: int | None = None
        self.pre_skip = 0
        self.opus_head: bytes | None = None
        self._tally = tally
        self._num_frames = 0
        self._is_flushed = False
        self._context: av.AudioCodecContext | None = None
        self._resampler: av.AudioResampler | None = None
        self._pending = b""  # raw bytes short of a whole frame
        if fmt.kind == "opus":
            self.bitrate = fmt.bitrate or DEFAULT_OPUS_BITRATE[fmt.sample_rate]
            self._context = _open_opus(fmt.sample_rate, fmt.frame_ms, self.bitrate, complexity)
            self.opus_head = bytes(self._context.extradata or b"")
            # OpusHead bytes 10-11: pre-skip in 48 kHz samples (RFC 7845, 5.1).
            pre_skip_48k = int.from_bytes(self.opus_head[10:12], "little")
            self.pre_skip = pre_skip_48k * fmt.sample_rate // 48000
            return
        sample_format, g711, self._silence = _RAW[fmt.kind]
        self._resampler = av.AudioResampler(format=sample_format, layout="mono",
                                            rate=fmt.sample_rate)
        self._width = 4 if sample_format == "flt" else 2  # bytes per resampled sample
        if g711:
            self._context = _open_pcm_encoder(g711, fmt.sample_rate)

    @property
    def num_frames(self) -> int:
        """Frames returned so far."""
        return self._num_frames

    def encode(self, pcm: np.ndarray) -> list[EncodedFrame]:
        """Take mono PCM at `sample_rate_in`; return the whole frames now complete."""
        if self._is_flushed:
            raise RuntimeError("expected encode() before flush(), got encode() after flush()")
        if self._tally is not None:
            self._tally[self.codec] += 1
        samples = as_mono_float32(pcm)
        if len(samples) == 0:
            return []
        return self._encode(to_frame(samples, self.sample_rate_in))

    def flush(self) -> list[EncodedFrame]:
        """Drain the resampler and codec, pad the last frame with silence, return the rest."""
        if self._is_flushed:
            return []
        self._is_flushed = True
        return self._encode(None)

    def _encode(self, frame: av.AudioFrame | None) -> list[EncodedFrame]:
        duration = float(self.frame_ms)
        if self._resampler is None:  # Opus: resample, cut and encode in the codec context
            assert self._context is not None
            # libopus emits exactly one packet per full frame (no internal queue).
            out = [EncodedFrame(bytes(packet), duration) for packet in self._context.encode(frame)]
            self._num_frames += len(out)
            return out
        data = self._pending
        for piece in self._resampler.resample(frame):  # mono at the output rate
            if self._context is None:
                data += bytes(piece.planes[0])[: self._width * piece.samples]
            else:
                data += b"".join(bytes(packet) for packet in self._context.encode(piece))
        silence = self._silence  # one sample of it
        if not self.frame_samples:  # unframed: what came, as it came
            self._pending = b""
            seconds = len(data) / len(silence) / self.sample_rate
            return [EncodedFrame(data, 1000.0 * seconds)] if data else []
        size = len(silence) * self.frame_samples  # bytes per frame
        if frame is None and len(data) % size:  # flush: pad the last partial frame
            data += silence * ((size - len(data) % size) // len(silence))
        cut = len(data) - len(data) % size
        self._pending = data[cut:]
        out = [EncodedFrame(data[i : i + size], duration) for i in range(0, cut, size)]
        self._num_frames += len(out)
        return out


def make_encoder(
    codec: str,
    sample_rate_out: int,
    frame_ms: int,
    bitrate: int | None,
    sample_rate_in: int,
    *,
    complexity: int = DEFAULT_OPUS_COMPLEXITY,
) -> StreamEncoder:
    """A new encoder for one context from the native options' values (mulaw runs at 8 kHz)."""
    if codec not in FRAMED_KINDS:
        raise ValueError(f"expected codec in {FRAMED_KINDS}, got {codec!r}")
    if codec in ("mulaw", "alaw"):
        sample_rate_out = MULAW_SAMPLE_RATE
    return StreamEncoder(AudioFormat(codec, sample_rate_out, frame_ms, bitrate), sample_rate_in,
                         complexity=complexity)


def _open_opus(rate: int, frame_ms: int, bitrate: int, complexity: int) -> av.AudioCodecContext:
    context = av.CodecContext.create("libopus", "w")
    assert isinstance(context, av.AudioCodecContext)
    context.sample_rate = rate
    context.layout = "mono"
    context.format = "flt"
    context.bit_rate = bitrate
    # libopus takes the frame length as `frame_duration` (ms), not frame_size.
    context.options = {
        "frame_duration": str(frame_ms),
        "application": "audio",
        "compression_level": str(complexity),
    }
    context.open()
    return context


def _open_pcm_encoder(name: str, rate: int) -> av.AudioCodecContext:
    context = av.CodecContext.create(name, "w")
    assert isinstance(context, av.AudioCodecContext)
    context.sample_rate = rate
    context.layout = "mono"
    context.format = "s16"
    context.open()
    return context


def frames_to_array(frames: list[av.AudioFrame]) -> np.ndarray:
    """Concatenate mono "flt" frames (a resampler's output) into one float32 array."""
    if not frames:
        return np.zeros(0, dtype=np.float32)
    # each frame: [1, num_samples] float32 ("flt", mono)
    joined: np.ndarray = np.concatenate([frame.to_ndarray()[0] for frame in frames])
    return joined.astype(np.float32, copy=False)


def _decode_with(codec: str, packets: list[bytes], rate: int) -> np.ndarray:
    context = av.CodecContext.create(codec, "r")
    assert isinstance(context, av.AudioCodecContext)
    context.sample_rate = rate
    context.layout = "mono"
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    parts: list[np.ndarray] = []
    for data in packets:
        for frame in context.decode(av.Packet(data)):
            parts.append(frames_to_array(resampler.resample(frame)))
    parts.append(frames_to_array(resampler.resample(None)))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def decode_opus_packets(packets: list[bytes], sample_rate: int, *, pre_skip: int = 0) -> np.ndarray:
    """Raw Opus packets -> mono float32 at `sample_rate`, less `pre_skip` leading samples.

    Pass the encoder's `pre_skip` to line the result up with the encoded input.
    """
    pcm = _decode_with("libopus", packets, sample_rate)
    return pcm[pre_skip:]


def decode_pcm16(data: bytes) -> np.ndarray:
    """PCM16 little-endian bytes -> float32 in [-1, 1]."""
    return pcm_to_float(np.frombuffer(data, dtype="<i2").astype(np.int16))


def decode_mulaw(data: bytes) -> np.ndarray:
    """G.711 mu-law bytes (8 kHz) -> float32 at 8 kHz."""
    return _decode_with("pcm_mulaw", [data], MULAW_SAMPLE_RATE) if data else np.zeros(0, np.float32)
