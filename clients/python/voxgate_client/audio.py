"""Audio as a turn yields it: `AudioChunk`, and the decoders behind `audio=`.

- `raw`: what the server sent, undecoded (Opus `packets`, PCM16 or mu-law `data`);
  no numpy, no PyAV. The load tool runs this way.
- `int16` / `float32`: mono PCM as a numpy array (`pcm`). PCM16 and mu-law need
  numpy only; Opus needs PyAV too (`pip install voxgate-client[av]`).

Opus decodes the way an Ogg Opus player does (RFC 7845, 4.2): the first
`pre-skip` samples of a turn (libopus' lookahead, 312 at 48 kHz; the server
encodes every turn from scratch, docs/protocol.md, "A turn") are dropped, so
that sample 0 of the decoded audio is sample 0 of the speech and `pts_ms`,
segments and word timings line up with it exactly. libopus decodes at 48 kHz
whatever the encoder's rate; PyAV's resampler brings it to the session's
`sample_rate`, and its last few samples come at the turn's end (`flush`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from voxgate_client.wire import Audio, Segment, TextSkipped, Word

if TYPE_CHECKING:
    import numpy as np

AUDIO_MODES = ("int16", "float32", "raw")
OPUS_RATE = 48000
OPUS_PRE_SKIP_48K = 312  # libopus' lookahead at 48 kHz (the OpusHead pre-skip)


@dataclass(slots=True)
class AudioChunk:
    """A piece of a turn's audio, in order.

    `pts_ms` is where it starts in the turn's audio and `duration_ms` how long it
    lasts (for decoded Opus, exact to the sample after the pre-skip; raw, as the
    server framed it). `pcm` is set when decoding (`audio="int16"` or `"float32"`),
    `packets` (Opus) or `data` (PCM16 little-endian, mu-law) when raw. `segment` is
    the segment this audio belongs to; `words` the word timings that start within
    this chunk; `skipped` the `text.skipped` notices that came just before it.
    """

    context_id: str
    pts_ms: float
    duration_ms: float
    sample_rate: int
    codec: str
    pcm: np.ndarray[Any, Any] | None = None
    packets: list[bytes] | None = None
    data: bytes | None = None
    segment: Segment | None = None
    words: list[Word] = field(default_factory=list)
    skipped: list[TextSkipped] = field(default_factory=list)
    received_at: float = 0.0


class MissingExtra(ImportError):
    """An optional dependency this use needs is not installed; the message says which."""


def require(module: str, extra: str, why: str) -> Any:
    """Import an optional module, or say which extra installs it."""
    try:
        return __import__(module)
    except ImportError as exc:  # sounddevice raises OSError without PortAudio: not here
        raise MissingExtra(f"{why} needs {module}: pip install 'voxgate-client[{extra}]'"
                           ) from exc


class Decoder:
    """One turn's decoder: `decode` each audio message in order, `flush` at the turn's end."""

    def __init__(self, mode: str, sample_rate: int) -> None:
        if mode not in AUDIO_MODES:
            raise ValueError(f"expected audio one of {', '.join(AUDIO_MODES)}, got {mode!r}")
        self.mode = mode
        self.sample_rate = sample_rate
        self._np: Any = None if mode == "raw" else require("numpy", "numpy", f"audio={mode!r}")
        self._opus: _OpusStream | None = None
        self._emitted = 0  # decoded samples handed out so far (Opus)

    def decode(self, audio: Audio) -> AudioChunk:
        if self.mode == "raw":
            return AudioChunk(audio.context_id, audio.pts_ms, audio.duration_ms,
                              self.sample_rate, audio.codec, packets=audio.packets,
                              data=audio.data, received_at=audio.received_at)
        if audio.codec == "opus":
            if self._opus is None:
                self._opus = _OpusStream(self.mode, self.sample_rate)
            return self._chunk(audio, self._opus.decode(audio.packets or []))
        pcm = self._pcm(audio)
        return AudioChunk(audio.context_id, audio.pts_ms, audio.duration_ms, self.sample_rate,
                          audio.codec, pcm=pcm, received_at=audio.received_at)

    def flush(self, context_id: str, received_at: float) -> AudioChunk | None:
        """The decoder's last samples at the turn's end (Opus resampling), if any."""
        if self._opus is None:
            return None
        pcm = self._opus.flush()
        if not len(pcm):
            return None
        return self._chunk(Audio(context_id, -1, 0.0, 0.0, "opus", None, None, received_at), pcm)

    def _chunk(self, audio: Audio, pcm: np.ndarray[Any, Any]) -> AudioChunk:
        rate = self.sample_rate
        pts_ms = self._emitted * 1000.0 / rate
        self._emitted += len(pcm)
        return AudioChunk(audio.context_id, pts_ms, len(pcm) * 1000.0 / rate, rate, "opus",
                          pcm=pcm, received_at=audio.received_at)

    def _pcm(self, audio: Audio) -> np.ndarray[Any, Any]:
        np_ = self._np
        raw = audio.data or b""
        if audio.codec == "mulaw":
            samples = _mulaw_table(np_)[np_.frombuffer(raw, dtype=np_.uint8)]
        elif audio.codec == "pcm16":
            samples = np_.frombuffer(raw, dtype="<i2").astype(np_.int16, copy=False)
        else:
            raise ValueError(f"expected codec opus, pcm16 or mulaw, got {audio.codec!r}")
        if self.mode == "float32":
            return samples.astype(np_.float32) / 32768.0  # type: ignore[no-any-return]
        return samples  # type: ignore[no-any-return]


class _OpusStream:
    """libopus through PyAV: 48 kHz out, resampled to the session's rate, pre-skip dropped."""

    def __init__(self, mode: str, sample_rate: int) -> None:
        av = require("av", "av", "decoding Opus")
        self._av = av
        self._np: Any = require("numpy", "numpy", "decoding Opus")
        self._context = av.CodecContext.create("libopus", "r")
        self._context.sample_rate = OPUS_RATE
        self._context.layout = "mono"
        fmt = "s16" if mode == "int16" else "flt"
        self._resampler = av.AudioResampler(format=fmt, layout="mono", rate=sample_rate)
        self._dtype = self._np.int16 if mode == "int16" else self._np.float32
        self._skip = OPUS_PRE_SKIP_48K * sample_rate // OPUS_RATE  # at the output rate

    def decode(self, packets: list[bytes]) -> np.ndarray[Any, Any]:
        frames = []
        for data in packets:
            for frame in self._context.decode(self._av.Packet(data)):
                frames += self._resampler.resample(frame)
        return self._take(frames)

    def flush(self) -> np.ndarray[Any, Any]:
        return self._take(list(self._resampler.resample(None)))

    def _take(self, frames: list[Any]) -> np.ndarray[Any, Any]:
        np_ = self._np
        if not frames:
            return np_.zeros(0, dtype=self._dtype)  # type: ignore[no-any-return]
        # each frame: [1, num_samples] (packed mono)
        pcm = np_.concatenate([f.to_ndarray()[0] for f in frames]).astype(self._dtype, copy=False)
        if self._skip:
            cut = min(self._skip, len(pcm))
            self._skip -= cut
            pcm = pcm[cut:]
        return pcm  # type: ignore[no-any-return]


_MULAW: dict[int, Any] = {}


def _mulaw_table(np_: Any) -> Any:
    """G.711 mu-law code -> int16 sample (ITU-T G.711; 0xFF and 0x7F are zero)."""
    if not _MULAW:
        code = ~np_.arange(256, dtype=np_.int32) & 0xFF
        exponent = (code >> 4) & 0x07
        magnitude = ((((code & 0x0F) << 3) + 0x84) << exponent) - 0x84
        _MULAW[0] = np_.where(code & 0x80, -magnitude, magnitude).astype(np_.int16)
    return _MULAW[0]
