"""Per-context audio encoding for the WebSocket: resample, cut frames, encode.

One `StreamEncoder` per context (docs/architecture.md, "Audio"). It takes the engine's mono
float32 PCM at the voice's rate and returns whole `frame_ms` frames: Opus
packets (libopus, bundled in PyAV's wheels), PCM16 little-endian bytes, or
G.711 mu-law bytes at 8 kHz. `encode` returns only whole frames and keeps the
remainder; `flush` pads the last partial frame with silence.

The audio path, once. The PCM is checked and cast where it enters
(`as_mono_float32`, a no-op for the engine's float32) and wrapped in one
`av.AudioFrame`; from there FFmpeg does the rest in one pass and nothing comes
back to numpy. For Opus the codec context itself resamples (swresample) and
cuts codec-sized frames: PyAV runs every frame it encodes through a filter graph
set to the codec's rate and frame size, so a separate resampler before it
would only convert twice. For PCM16 and mu-law one `AudioResampler` converts
rate and sample format (float to s16, with swresample's rounding and clipping);
PCM16 is the bytes of its output, mu-law FFmpeg's G.711 encoder run on that
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
PCM16 and mu-law have no delay: `ceil(n / F)` frames exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import av
import numpy as np

from gateway.audio.formats import (
    CODECS,
    DEFAULT_OPUS_BITRATE,
    DEFAULT_OPUS_COMPLEXITY,
    FRAME_MS,
    MAX_OPUS_BITRATE,
    MIN_OPUS_BITRATE,
    MULAW_SAMPLE_RATE,
    SAMPLE_RATES,
)

#: what a partial last frame is padded with: digital silence in each codec's bytes
_SILENCE = {"pcm16": b"\x00\x00", "mulaw": b"\xff"}  # G.711 mu-law codes zero as 0xFF


@dataclass(slots=True, frozen=True)
class EncodedFrame:
    """One codec frame: an Opus packet, or PCM16 LE bytes, or mu-law bytes."""

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


class StreamEncoder:
    """Encodes one context's PCM into whole frames of one codec (see module doc).

    Build it with `make_encoder`. Attributes: `codec`, `sample_rate` (output),
    `sample_rate_in`, `frame_ms`, `frame_samples` (per frame at the output
    rate), `bitrate` (Opus only, else None), `pre_skip` (output samples a
    decoder drops; 0 for PCM), `opus_head` (OpusHead bytes or None).
    """

    def __init__(
        self,
        codec: str,
        sample_rate_out: int,
        frame_ms: int,
        bitrate: int | None,
        sample_rate_in: int,
        complexity: int = DEFAULT_OPUS_COMPLEXITY,
    ) -> None:
        _validate(codec, sample_rate_out, frame_ms, bitrate, sample_rate_in, complexity)
        if codec == "mulaw":
            sample_rate_out = MULAW_SAMPLE_RATE
        self.codec = codec
        self.sample_rate = sample_rate_out
        self.sample_rate_in = int(sample_rate_in)
        self.frame_ms = frame_ms
        self.frame_samples = sample_rate_out * frame_ms // 1000
        self.bitrate: int | None = None
        self.pre_skip = 0
        self.opus_head: bytes | None = None
        self._num_frames = 0
        self._is_flushed = False
        self._context: av.AudioCodecContext | None = None
        self._resampler: av.AudioResampler | None = None
        self._pending = b""  # PCM16 or mu-law bytes short of a whole frame
        if codec == "opus":
            self.bitrate = bitrate if bitrate is not None else DEFAULT_OPUS_BITRATE[sample_rate_out]
            self._context = _open_opus(sample_rate_out, frame_ms, self.bitrate, complexity)
            self.opus_head = bytes(self._context.extradata or b"")
            # OpusHead bytes 10-11: pre-skip in 48 kHz samples (RFC 7845, 5.1).
            pre_skip_48k = int.from_bytes(self.opus_head[10:12], "little")
            self.pre_skip = pre_skip_48k * sample_rate_out // 48000
        else:
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=sample_rate_out)
            if codec == "mulaw":
                self._context = _open_pcm_encoder("pcm_mulaw", sample_rate_out)

    @property
    def num_frames(self) -> int:
        """Frames returned so far."""
        return self._num_frames

    def encode(self, pcm: np.ndarray) -> list[EncodedFrame]:
        """Take mono PCM at `sample_rate_in`; return the whole frames now complete."""
        if self._is_flushed:
            raise RuntimeError("expected encode() before flush(), got encode() after flush()")
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
        for piece in self._resampler.resample(frame):  # s16 mono at the output rate
            if self._context is None:
                data += bytes(piece.planes[0])[: 2 * piece.samples]
            else:
                data += b"".join(bytes(packet) for packet in self._context.encode(piece))
        silence = _SILENCE[self.codec]  # one sample of it
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
    """A new encoder for one context. mulaw always runs at 8 kHz (G.711)."""
    return StreamEncoder(codec, sample_rate_out, frame_ms, bitrate, sample_rate_in, complexity)


def _validate(
    codec: str, rate_out: int, frame_ms: int, bitrate: int | None, rate_in: int, complexity: int
) -> None:
    if codec not in CODECS:
        raise ValueError(f"expected codec in {CODECS}, got {codec!r}")
    if codec != "mulaw" and rate_out not in SAMPLE_RATES:
        raise ValueError(f"expected sample_rate in {SAMPLE_RATES}, got {rate_out!r}")
    if frame_ms not in FRAME_MS:
        raise ValueError(f"expected frame_ms in {FRAME_MS}, got {frame_ms!r}")
    if not isinstance(rate_in, (int, np.integer)) or not 8000 <= rate_in <= 192000:
        raise ValueError(f"expected sample_rate_in within 8000-192000 Hz, got {rate_in!r}")
    if (
        codec == "opus"
        and bitrate is not None
        and not MIN_OPUS_BITRATE <= bitrate <= MAX_OPUS_BITRATE
    ):
        raise ValueError(
            f"expected bitrate within {MIN_OPUS_BITRATE}-{MAX_OPUS_BITRATE} bit/s, got {bitrate!r}"
        )
    if not 0 <= complexity <= 10:
        raise ValueError(f"expected complexity within 0-10, got {complexity!r}")


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
