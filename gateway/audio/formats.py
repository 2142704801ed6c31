"""The audio formats a client may ask for: one table, imported by every module that checks them.

`session.update` (gateway/stream/options.py) validates a client's choice against
these; `gateway/audio/codecs.py` builds encoders from them; the HTTP speech endpoint
maps OpenAI's speed range onto the engine's. The speaking-rate range belongs to
the engine (`SamplingParams` checks it, and the engine never imports the
gateway), so it lives in engine/types.py and is re-exported here to keep the
table whole.

| what | values |
|---|---|
| codecs | opus, pcm16 (LE), mulaw (G.711, 8 kHz only) |
| sample rates | 48000, 24000, 16000, 8000 Hz |
| frame lengths | 20, 40, 60 ms |
| Opus bitrate | 6000-510000 bit/s; by default 32/24/20/12 kbit/s at 48/24/16/8 kHz |
| speed | 0.5-2.0 (OpenAI's 0.25-4.0 is clamped onto it) |
"""

from __future__ import annotations

from engine.types import MAX_SPEED, MIN_SPEED

CODECS = ("opus", "pcm16", "mulaw")
SAMPLE_RATES = (48000, 24000, 16000, 8000)
FRAME_MS = (20, 40, 60)
MULAW_SAMPLE_RATE = 8000  # G.711 is defined at 8 kHz only
MIN_OPUS_BITRATE, MAX_OPUS_BITRATE = 6000, 510000
DEFAULT_OPUS_BITRATE = {48000: 32000, 24000: 24000, 16000: 20000, 8000: 12000}
DEFAULT_OPUS_COMPLEXITY = 5  # libopus 0-10; 5 halves the CPU of 10 for speech at a small cost
#: the range OpenAI's speech API accepts; voxgate clamps it onto MIN_SPEED-MAX_SPEED
OPENAI_MIN_SPEED, OPENAI_MAX_SPEED = 0.25, 4.0

__all__ = [
    "CODECS", "DEFAULT_OPUS_BITRATE", "DEFAULT_OPUS_COMPLEXITY", "FRAME_MS", "MAX_OPUS_BITRATE",
    "MAX_SPEED", "MIN_OPUS_BITRATE", "MIN_SPEED", "MULAW_SAMPLE_RATE", "OPENAI_MAX_SPEED",
    "OPENAI_MIN_SPEED", "SAMPLE_RATES",
]
