"""The audio formats: one table, and `AudioFormat`, the key every encoder is opened by.

`session.update` (gateway/stream/options.py) validates a client's choice against
the native table; the vendor sockets (gateway/compat/formats.py) and the HTTP
speech route (gateway/http/speech.py) name their formats as `AudioFormat`s too,
and gateway/audio/encoders.py opens the one encoder each needs. The
speaking-rate range belongs to the engine (`SamplingParams` checks it, and the
engine never imports the gateway), so it lives in engine/types.py and is
re-exported here to keep the table whole.

| what | values |
|---|---|
| native codecs | opus, pcm16 (LE), mulaw (G.711, 8 kHz only) |
| native sample rates | 48000, 24000, 16000, 8000 Hz |
| frame lengths | 20, 40, 60 ms |
| Opus bitrate | 6000-510000 bit/s; by default 32/24/20/12 kbit/s at 48/24/16/8 kHz |
| speed | 0.5-2.0 (OpenAI's 0.25-4.0 is clamped onto it) |

Every output, by `AudioFormat.kind` (what the encoder factory makes):

| kind | what comes out | rates |
|---|---|---|
| opus | raw Opus packets, one per frame | 48000, 24000, 16000, 8000 |
| pcm16, pcm_f32 | PCM16 LE or float32 LE, cut in frames (`frame_ms` 0: as it comes) | `PCM_RATES` |
| mulaw, alaw | G.711, cut in frames | 8000 |
| mp3 | MPEG audio (LAME), constant bitrate | 22050, 24000, 44100 |
| ogg_opus | Opus in Ogg, a page at least every `frame_ms` | 48000 |
| wav | RIFF WAVE, PCM16, streamed (lengths 0xFFFFFFFF) | `PCM_RATES` |
| flac, aac | FLAC; AAC in ADTS | `PCM_RATES` |
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.types import MAX_SPEED, MIN_SPEED

CODECS = ("opus", "pcm16", "mulaw")
SAMPLE_RATES = (48000, 24000, 16000, 8000)
FRAME_MS = (20, 40, 60)
MULAW_SAMPLE_RATE = 8000  # G.711 is defined at 8 kHz only
MIN_OPUS_BITRATE, MAX_OPUS_BITRATE = 6000, 510000
DEFAULT_OPUS_BITRATE = {48000: 32000, 24000: 24000, 16000: 20000, 8000: 12000}
#: libopus 0-10. 5: a third of the CPU of 7-10, wideband PESQ 4.35 against their 4.54; 1-4 save
#: 10-25% more for 0.06-0.09 less (48 kHz from 24 kHz, `python -m bench.bench_opus_settings`
#: with `pesq` installed, 2026-12-07)
DEFAULT_OPUS_COMPLEXITY = 5
#: the range OpenAI's speech API accepts; voxgate clamps it onto MIN_SPEED-MAX_SPEED
OPENAI_MIN_SPEED, OPENAI_MAX_SPEED = 0.25, 4.0

#: kinds cut into whole frames of `frame_ms` (gateway/audio/codecs.py)
FRAMED_KINDS = ("opus", "pcm16", "pcm_f32", "mulaw", "alaw")
#: kinds written by a muxer as one stream (gateway/audio/containers.py)
MUXED_KINDS = ("mp3", "ogg_opus", "wav", "flac", "aac")
#: framed kinds that may also go unframed (`frame_ms` 0): raw PCM has no frame of its own
RAW_KINDS = ("pcm16", "pcm_f32")
PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
MP3_RATES = (22050, 24000, 44100)
_RATES: dict[str, tuple[int, ...]] = {
    "opus": SAMPLE_RATES, "pcm16": PCM_RATES, "pcm_f32": PCM_RATES, "mulaw": (MULAW_SAMPLE_RATE,),
    "alaw": (MULAW_SAMPLE_RATE,), "mp3": MP3_RATES, "ogg_opus": (48000,), "wav": PCM_RATES,
    "flac": PCM_RATES, "aac": PCM_RATES,
}


@dataclass(slots=True, frozen=True)
class AudioFormat:
    """How a context's audio leaves the gateway (see the module doc's second table).

    `frame_ms`: the frame of a framed kind (0: raw PCM as it comes, unframed), or the
    longest Ogg page of `ogg_opus`; the other muxed kinds take none. `bitrate` in
    bit/s for opus, mp3, ogg_opus and aac (None: the codec's default).
    """

    kind: str
    sample_rate: int
    frame_ms: int = 20
    bitrate: int | None = None

    def __post_init__(self) -> None:
        rates = _RATES.get(self.kind)
        if rates is None:
            raise ValueError(f"expected an audio kind in {FRAMED_KINDS + MUXED_KINDS}, "
                             f"got {self.kind!r}")
        if self.sample_rate not in rates:
            raise ValueError(f"expected sample_rate in {rates} for {self.kind}, "
                             f"got {self.sample_rate!r}")
        if self.kind in MUXED_KINDS:
            if not 0 <= self.frame_ms <= 1000:
                raise ValueError(f"expected frame_ms within 0-1000, got {self.frame_ms!r}")
        elif self.frame_ms not in FRAME_MS and not (self.frame_ms == 0 and self.kind in RAW_KINDS):
            raise ValueError(f"expected frame_ms in {FRAME_MS}, got {self.frame_ms!r}")
        if self.kind == "opus" and self.bitrate is not None \
                and not MIN_OPUS_BITRATE <= self.bitrate <= MAX_OPUS_BITRATE:
            raise ValueError(f"expected bitrate within {MIN_OPUS_BITRATE}-{MAX_OPUS_BITRATE} "
                             f"bit/s, got {self.bitrate!r}")

    @property
    def is_framed(self) -> bool:
        """Cut into whole codec frames (gateway/audio/codecs.py), not written by a muxer."""
        return self.kind in FRAMED_KINDS


__all__ = [
    "CODECS", "DEFAULT_OPUS_BITRATE", "DEFAULT_OPUS_COMPLEXITY", "FRAMED_KINDS", "FRAME_MS",
    "MAX_OPUS_BITRATE", "MAX_SPEED", "MIN_OPUS_BITRATE", "MIN_SPEED", "MP3_RATES",
    "MULAW_SAMPLE_RATE", "MUXED_KINDS", "OPENAI_MAX_SPEED", "OPENAI_MIN_SPEED", "PCM_RATES",
    "RAW_KINDS", "SAMPLE_RATES", "AudioFormat",
]
