"""Per-context audio encoding for the WebSocket: resample, cut frames, encode.

One `StreamEncoder` per context (DESIGN.md, Audio). It takes the engine's mono
float32 PCM at the voice's rate, resamples it with swresample (PyAV's
`AudioResampler`), cuts it into whole `frame_ms` frames and encodes each one as
an Opus packet (libopus, bundled in PyAV's wheels), PCM16 little-endian bytes,
or G.711 mu-law bytes at 8 kHz. `encode` returns only whole frames and keeps
the remainder; `flush` pads the last partial frame with silence.

Opus lookahead. libopus delays its output by a fixed lookahead (6.5 ms in the
default application: 312 samples at 48 kHz, the OpusHead "pre-skip"). We do
not shift the input; instead the stream behaves like an Ogg Opus stream:
a decoder drops the first `pre_skip` samples (at the output rate) and the
decoded audio then lines up sample for sample with the input. So that the tail
of the input is not cut off, `flush` emits as many frames as needed to cover
`input + pre_skip` samples: the frame count is `ceil((n + pre_skip) / F)`,
which is `ceil(n / F)` unless the last frame's silence padding is shorter than
the lookahead, in which case one more (silent-tailed) frame follows.
`opus_head` gives the 19-byte OpusHead (WebCodecs `description`) carrying that
pre-skip. PCM16 and mu-law have no delay: `ceil(n / F)` frames exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import av
import numpy as np

CODECS = ("opus", "pcm16", "mulaw")
SAMPLE_RATES = (48000, 24000, 16000, 8000)
FRAME_MS = (20, 40, 60)
MULAW_SAMPLE_RATE = 8000  # G.711 is defined at 8 kHz only
MIN_OPUS_BITRATE, MAX_OPUS_BITRATE = 6000, 510000
DEFAULT_OPUS_BITRATE = {48000: 32000, 24000: 24000, 16000: 20000, 8000: 12000}
DEFAULT_OPUS_COMPLEXITY = 5  # libopus 0-10; 5 halves the CPU of 10 for speech at a small cost


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
    """Validate mono PCM ([num_samples], int16 or float) and return it as float32."""
    if not isinstance(pcm, np.ndarray):
        raise TypeError(f"expected a numpy array of PCM, got {type(pcm).__name__}")
    if pcm.ndim != 1:
        raise ValueError(f"expected mono PCM of shape [num_samples], got shape {pcm.shape}")
    return np.ascontiguousarray(pcm_to_float(pcm))


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
        self._resampler = (
            av.AudioResampler(format="flt", layout="mono", rate=sample_rate_out)
            if sample_rate_in != sample_rate_out
            else None
        )
        self._pending = np.zeros(0, dtype=np.float32)  # [num_samples] at the output rate
        self._num_samples_out = 0  # resampled input samples seen, before padding
        self._num_frames = 0
        self._is_flushed = False
        self._context: av.AudioCodecContext | None = None
        if codec == "opus":
            self.bitrate = bitrate if bitrate is not None else DEFAULT_OPUS_BITRATE[sample_rate_out]
            self._context = _open_opus(sample_rate_out, frame_ms, self.bitrate, complexity)
            self.opus_head = bytes(self._context.extradata or b"")
            # OpusHead bytes 10-11: pre-skip in 48 kHz samples (RFC 7845, 5.1).
            pre_skip_48k = int.from_bytes(self.opus_head[10:12], "little")
            self.pre_skip = pre_skip_48k * sample_rate_out // 48000
        elif codec == "mulaw":
            self._context = _open_pcm_encoder("pcm_mulaw", sample_rate_out)

    @property
    def num_frames(self) -> int:
        """Frames returned so far."""
        return self._num_frames

    def encode(self, pcm: np.ndarray) -> list[EncodedFrame]:
        """Take mono PCM at `sample_rate_in`; return the whole frames now complete."""
        if self._is_flushed:
            raise RuntimeError("expected encode() before flush(), got encode() after flush()")
        samples = self._resample(as_mono_float32(pcm))
        self._num_samples_out += len(samples)
        if len(self._pending):
            samples = np.concatenate((self._pending, samples))
        num_whole = len(samples) // self.frame_samples
        cut = num_whole * self.frame_samples
        self._pending = samples[cut:].copy()
        if num_whole == 0:
            return []
        return self._encode_frames(samples[:cut].reshape(num_whole, self.frame_samples))

    def flush(self) -> list[EncodedFrame]:
        """Drain the resampler, pad the last frame with silence, return the rest."""
        if self._is_flushed:
            return []
        self._is_flushed = True
        if self._resampler is not None:
            tail = frames_to_array(self._resampler.resample(None))
            self._num_samples_out += len(tail)
            self._pending = np.concatenate((self._pending, tail))
        if self._num_samples_out == 0:
            return []
        needed = self._num_samples_out + self.pre_skip  # see module doc, "Opus lookahead"
        num_total = -(-needed // self.frame_samples)
        num_left = num_total - self._num_frames
        block = np.zeros(num_left * self.frame_samples, dtype=np.float32)
        block[: len(self._pending)] = self._pending
        self._pending = np.zeros(0, dtype=np.float32)
        return self._encode_frames(block.reshape(num_left, self.frame_samples))

    def _resample(self, pcm: np.ndarray) -> np.ndarray:
        if self._resampler is None or len(pcm) == 0:
            return pcm
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="flt", layout="mono")
        frame.sample_rate = self.sample_rate_in
        return frames_to_array(self._resampler.resample(frame))

    def _encode_frames(self, block: np.ndarray) -> list[EncodedFrame]:
        # block: [num_frames, frame_samples] float32 at the output rate
        num_frames = block.shape[0]
        self._num_frames += num_frames
        duration = float(self.frame_ms)
        size = self.frame_samples
        if self.codec == "pcm16":
            data = float_to_pcm16(block).tobytes()
            step = 2 * size
            return [EncodedFrame(data[i : i + step], duration) for i in range(0, len(data), step)]
        assert self._context is not None
        if self.codec == "mulaw":
            data = _encode_all(self._context, block.reshape(-1), self.sample_rate, "s16")
            return [EncodedFrame(data[i : i + size], duration) for i in range(0, len(data), size)]
        out: list[EncodedFrame] = []
        for row in block:
            frame = av.AudioFrame.from_ndarray(row[None, :], format="flt", layout="mono")
            frame.sample_rate = self.sample_rate
            # libopus emits exactly one packet per full frame (no internal queue).
            out.extend(
                EncodedFrame(bytes(packet), duration) for packet in self._context.encode(frame)
            )
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


def _encode_all(context: av.AudioCodecContext, pcm: np.ndarray, rate: int, fmt: str) -> bytes:
    """Encode a whole block in one call with a variable-frame-size codec."""
    samples = float_to_pcm16(pcm) if fmt == "s16" else pcm
    frame = av.AudioFrame.from_ndarray(samples[None, :], format=fmt, layout="mono")
    frame.sample_rate = rate
    return b"".join(bytes(packet) for packet in context.encode(frame))


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
