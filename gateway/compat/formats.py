"""Vendor audio formats: what each compatible socket may ask for, and what the encoder makes.

Each vendor names its formats its own way (ElevenLabs `output_format=mp3_44100_128`,
Cartesia an `output_format` object, Deepgram `encoding` and `sample_rate` in the
query); each parser here reads one of them into an `OutputFormat`, and
`OutputFormat.audio` is the `AudioFormat` the encoder factory opens
(gateway/audio/encoders.py). Every format is made once, from the engine's PCM,
in one pass: the raw kinds cut in 20 ms frames like the native socket's PCM16
(a vendor message carries five of them), MP3 and Ogg Opus as one stream per
vendor context, so that a compressed stream stays one stream across the
context's sentences: LiveKit's decoder reads a context's MP3 or Ogg bytes as
one file.

| kind | encoder kind | rates |
|---|---|---|
| pcm_s16le | pcm16 | 8000-48000 |
| pcm_f32le | pcm_f32 | 8000-48000 |
| mulaw, alaw | mulaw, alaw | 8000 |
| mp3 | mp3, constant bitrate | 22050, 44100 |
| ogg_opus | ogg_opus, a page per 20 ms packet | 48000 |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from gateway.audio.codecs import decode_pcm16
from gateway.audio.formats import AudioFormat
from gateway.errors import ProtocolError

KINDS = ("pcm_s16le", "pcm_f32le", "mulaw", "alaw", "mp3", "ogg_opus")
PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
MP3_RATES = (22050, 44100)
MP3_BITRATES = (32, 64, 96, 128, 192)
OPUS_BITRATES = (32, 64, 96, 128, 192)
#: the raw kinds' frame; for Ogg Opus, a page per packet: a decoder hears each 20 ms at once
FRAME_MS = 20
#: the vendor's kinds as the encoder factory names them
_AUDIO_KINDS = {"pcm_s16le": "pcm16", "pcm_f32le": "pcm_f32", "mulaw": "mulaw", "alaw": "alaw",
                "mp3": "mp3", "ogg_opus": "ogg_opus"}


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
    def audio(self) -> AudioFormat:
        """What the encoder factory opens for it."""
        # 20 ms: the raw kinds' frame, as the native socket's; Ogg's longest page
        return AudioFormat(_AUDIO_KINDS[self.kind], self.sample_rate, FRAME_MS, self.bitrate)

    @property
    def is_stream(self) -> bool:
        """Compressed: one encoder for the whole vendor context, not one per sentence group."""
        return self.kind in ("mp3", "ogg_opus")

    @property
    def bytes_per_second(self) -> float | None:
        """For raw formats (duration = bytes / this); None for compressed ones."""
        width = {"pcm_s16le": 2, "pcm_f32le": 4, "mulaw": 1, "alaw": 1}.get(self.kind)
        return None if width is None else float(width * self.sample_rate)


def elevenlabs_format(name: str) -> OutputFormat:
    """ElevenLabs' `output_format`: `pcm_N`, `ulaw_8000`, `alaw_8000`, `mp3_R_B`, `opus_48000_B`."""
    parts = name.split("_")
    try:
        if parts[0] == "pcm" and len(parts) == 2 and int(parts[1]) in PCM_RATES:
            return OutputFormat("pcm_s16le", int(parts[1]))
        if name in ("ulaw_8000", "alaw_8000"):
            return OutputFormat("mulaw" if parts[0] == "ulaw" else "alaw", 8000)
        if parts[0] == "mp3" and len(parts) == 3 and int(parts[2]) in MP3_BITRATES \
                and (name == "mp3_22050_32" or parts[1] == "44100"):
            return OutputFormat("mp3", int(parts[1]), 1000 * int(parts[2]))
        if parts[0] == "opus" and len(parts) == 3 and parts[1] == "48000" \
                and int(parts[2]) in OPUS_BITRATES:
            return OutputFormat("ogg_opus", 48000, 1000 * int(parts[2]))
    except ValueError:
        pass
    raise ProtocolError("unsupported_option", f"output_format {name[:40]!r} is not offered; "
                        "expected pcm_8000|16000|22050|24000|44100|48000, ulaw_8000, alaw_8000, "
                        "mp3_22050_32, mp3_44100_32..192, opus_48000_32..192", fatal=True)


CARTESIA_ENCODINGS = {"pcm_s16le": "pcm_s16le", "pcm_f32le": "pcm_f32le", "pcm_mulaw": "mulaw",
                      "pcm_alaw": "alaw"}


def cartesia_format(value: Mapping[str, Any]) -> OutputFormat:
    """Cartesia's `output_format`: `{container: "raw", encoding, sample_rate}`."""
    if value.get("container", "raw") != "raw":
        raise ProtocolError("unsupported_option", f"output_format.container "
                            f"{str(value.get('container'))[:40]!r} is not offered; expected raw")
    encoding, rate = value.get("encoding"), value.get("sample_rate")
    if encoding not in CARTESIA_ENCODINGS or isinstance(rate, bool) or not isinstance(rate, int):
        raise ProtocolError("unsupported_option", "output_format needs encoding in "
                            f"{', '.join(CARTESIA_ENCODINGS)} and an integer sample_rate")
    try:
        return OutputFormat(CARTESIA_ENCODINGS[encoding], rate)
    except ValueError as exc:
        raise ProtocolError("unsupported_option", f"output_format: {exc}") from None


DEEPGRAM_ENCODINGS = {"linear16": "pcm_s16le", "mulaw": "mulaw", "alaw": "alaw"}
DEEPGRAM_SAMPLE_RATE = 24000


def deepgram_format(query: Mapping[str, str]) -> OutputFormat:
    """Deepgram's query: `encoding` (linear16, mulaw, alaw) and `sample_rate`."""
    encoding = query.get("encoding", "linear16")
    if encoding not in DEEPGRAM_ENCODINGS:
        raise ProtocolError("unsupported_option", f"encoding {encoding[:40]!r} is not offered; "
                            "expected linear16, mulaw or alaw", fatal=True)
    default = 8000 if encoding != "linear16" else DEEPGRAM_SAMPLE_RATE
    try:
        rate = int(query.get("sample_rate", default))
        return OutputFormat(DEEPGRAM_ENCODINGS[encoding], rate)
    except ValueError as exc:
        raise ProtocolError("unsupported_option", f"sample_rate: {exc}", fatal=True) from None


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
