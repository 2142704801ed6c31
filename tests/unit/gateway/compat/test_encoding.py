"""Every vendor format is encoded once per engine chunk, straight from the engine's PCM.

The vendor sessions are driven sans-I/O (frames in, actions out) with the
engine's chunks made here; the encoder factory's counters say how many
encoders were opened and how many times each kind encoded. Before, a vendor
format the native socket does not speak was made as PCM16 at 48 kHz and
transcoded after: two encodes a chunk. MP3 and Ogg Opus stay one stream
across the vendor context's flushes, which a decoder reads whole.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import av
import numpy as np
import pytest

from engine.types import AudioChunk
from gateway.compat.cartesia import CartesiaSession
from gateway.compat.core import VendorSession
from gateway.compat.deepgram import DeepgramSession
from gateway.compat.elevenlabs import ElevenLabsMultiSession, parse_output_format
from gateway.compat.formats import OutputFormat, cartesia_format, decode_raw, deepgram_format
from gateway.stream.actions import Action, SendFrame, Submit
from gateway.stream.options import Limits, SessionOptions
from gateway.voices.catalog import VoiceCatalog

RATE = 22050
CHUNK_S = 0.1
CHUNKS_PER_SEGMENT = 3
SENTENCES = ["The first sentence is here.", "A second one follows it.", "And a third."]


def _make(kind: type[VendorSession[Any, Any]], output: OutputFormat) -> Any:
    session = kind("s1", catalog=VoiceCatalog({"joe"}), sample_rate=RATE,
                   options=SessionOptions(voice="joe"), limits=Limits(), output=output,
                   admit=lambda key: None, release=lambda key: None)
    session.start(0.0)
    return session


def _speak(session: Any, actions: list[Action]) -> list[Action]:
    """Every submitted request answered with its chunks (more requests may follow them)."""
    out: list[Action] = []
    pending = [a for a in actions if isinstance(a, Submit)]
    pcm = (np.sin(np.arange(int(RATE * CHUNK_S)) / 5.0) * 0.3).astype(np.float32)
    while pending:
        submit = pending.pop(0)
        for n in range(CHUNKS_PER_SEGMENT):
            chunk = AudioChunk(submit.request.request_id, pcm, RATE,
                               is_last=n == CHUNKS_PER_SEGMENT - 1)
            answer = session.receive_audio(chunk, 0.1)
            pending += [a for a in answer if isinstance(a, Submit)]
            out += answer
    return out


def _elevenlabs_turn(session: Any) -> list[Action]:
    """One context, flushed after its first sentence (two native contexts, one stream)."""
    frames = [{"text": " ", "context_id": "c"},
              {"text": SENTENCES[0] + " ", "context_id": "c", "flush": True},
              {"text": " ".join(SENTENCES[1:]) + " ", "context_id": "c"},
              {"context_id": "c", "flush": True}, {"context_id": "c", "close_context": True}]
    actions: list[Action] = []
    for frame in frames:
        actions += session.receive_frame(json.dumps(frame), 0.0)
    return actions + _speak(session, actions)


def _audio(actions: list[Action]) -> bytes:
    messages = [json.loads(a.frame) for a in actions
                if isinstance(a, SendFrame) and isinstance(a.frame, str)]
    return b"".join(base64.b64decode(m["audio"]) for m in messages if m.get("audio"))


NUM_CHUNKS = len(SENTENCES) * CHUNKS_PER_SEGMENT
AUDIO_S = NUM_CHUNKS * CHUNK_S


@pytest.mark.parametrize("name", ["pcm_8000", "pcm_22050", "pcm_44100", "pcm_48000", "ulaw_8000",
                                  "alaw_8000", "mp3_22050_32", "mp3_44100_128", "opus_48000_64"])
def test_each_elevenlabs_format_is_encoded_once_per_chunk(name: str) -> None:
    fmt = parse_output_format(name)
    session = _make(ElevenLabsMultiSession, fmt)
    audio = _audio(_elevenlabs_turn(session))
    kind = fmt.audio.kind
    assert session.encoders.num_encodes == {kind: NUM_CHUNKS}  # nothing else, no PCM16 first
    # a stream for the context, or a frame encoder for each of its two native contexts
    assert session.encoders.num_opened == {kind: 1 if fmt.is_stream else 2}
    if fmt.is_stream:
        container = "mp3" if fmt.kind == "mp3" else "ogg"
        with av.open(io.BytesIO(audio), format=container) as stream:  # one stream, read whole
            decoded = sum(frame.samples for frame in stream.decode(audio=0))
        assert AUDIO_S - 0.01 <= decoded / fmt.sample_rate <= AUDIO_S + 0.1
    else:  # two native contexts, each padded to whole 20 ms frames
        assert AUDIO_S <= len(decode_raw(audio, fmt)) / fmt.sample_rate <= AUDIO_S + 0.04


@pytest.mark.parametrize(("encoding", "rate"), [("pcm_s16le", 24000), ("pcm_f32le", 44100),
                                                ("pcm_mulaw", 8000), ("pcm_alaw", 8000)])
def test_each_cartesia_format_is_encoded_once_per_chunk(encoding: str, rate: int) -> None:
    output_format = {"container": "raw", "encoding": encoding, "sample_rate": rate}
    fmt = cartesia_format(output_format)
    session = _make(CartesiaSession, OutputFormat("pcm_s16le", 24000))
    actions = session.receive_frame(json.dumps({
        "context_id": "c", "voice": {"mode": "id", "id": "joe"}, "output_format": output_format,
        "transcript": " ".join(SENTENCES), "continue": False}), 0.0)
    actions += _speak(session, actions)
    assert session.encoders.num_encodes == {fmt.audio.kind: NUM_CHUNKS}
    messages = [json.loads(a.frame) for a in actions if isinstance(a, SendFrame)]
    data = b"".join(base64.b64decode(m["data"]) for m in messages if m["type"] == "chunk")
    assert AUDIO_S <= len(decode_raw(data, fmt)) / rate <= AUDIO_S + 0.02


@pytest.mark.parametrize("query", [{"encoding": "linear16", "sample_rate": "16000"},
                                   {"encoding": "mulaw"}, {"encoding": "alaw"}])
def test_each_deepgram_format_is_encoded_once_per_chunk(query: dict[str, str]) -> None:
    fmt = deepgram_format(query)
    session = _make(DeepgramSession, fmt)
    actions = session.receive_frame(json.dumps({"type": "Speak", "text": " ".join(SENTENCES)}), 0.0)
    actions += session.receive_frame(json.dumps({"type": "Flush"}), 0.0)
    actions += _speak(session, actions)
    assert session.encoders.num_encodes == {fmt.audio.kind: NUM_CHUNKS}
    data = b"".join(a.frame for a in actions
                    if isinstance(a, SendFrame) and isinstance(a.frame, bytes))
    assert AUDIO_S <= len(decode_raw(data, fmt)) / fmt.sample_rate <= AUDIO_S + 0.02
