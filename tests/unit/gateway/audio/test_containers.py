"""Streaming muxed audio (HTTP bodies, the vendors' MP3 and Ogg Opus), decoded back with FFmpeg."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from gateway.audio.containers import ContainerStreamEncoder
from gateway.audio.formats import AudioFormat

PIPER_RATE = 22050


def tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def body(frames: list) -> bytes:
    return b"".join(frame.data for frame in frames)


def test_a_bad_input_rate_is_refused_with_the_range() -> None:
    with pytest.raises(ValueError, match="expected sample_rate_in within 8000-192000 Hz, got 4000"):
        ContainerStreamEncoder(AudioFormat("wav", 24000), 4000)


def test_int16_input_gives_the_same_body_as_float_input() -> None:
    pcm = tone(0.3, 24000)
    as_int16 = np.round(pcm * 32768).astype(np.int16)
    from_float = ContainerStreamEncoder(AudioFormat("wav", 24000), 24000)
    from_int = ContainerStreamEncoder(AudioFormat("wav", 24000), 24000)
    a = body(from_float.encode(as_int16.astype(np.float32) / 32768) + from_float.flush())
    b = body(from_int.encode(as_int16) + from_int.flush())
    assert a == b and len(a) == 44 + 2 * len(pcm)


def test_empty_input_writes_nothing_and_a_second_flush_adds_nothing() -> None:
    encoder = ContainerStreamEncoder(AudioFormat("wav", 24000), 24000)
    assert encoder.encode(np.zeros(0, np.float32)) == []
    # WAV at the input's rate holds nothing back: the header and every sample come at once
    assert len(body(encoder.encode(tone(0.1, 24000)))) == 44 + 2 * 2400
    assert encoder.flush() == [] and encoder.flush() == []


@pytest.mark.parametrize(("page_ms", "max_pages"), [(100, 25), (20, 110)])
def test_ogg_opus_streams_pages_of_at_most_its_page_duration(page_ms: int, max_pages: int) -> None:
    encoder = ContainerStreamEncoder(AudioFormat("ogg_opus", 48000, page_ms), PIPER_RATE)
    pcm = tone(2.0, PIPER_RATE)
    step = PIPER_RATE // 10  # 100 ms pieces, as the engine delivers them
    pieces = [body(encoder.encode(pcm[i : i + step])) for i in range(0, len(pcm), step)]
    assert sum(1 for piece in pieces if piece) >= len(pieces) // 2
    stream = b"".join(pieces) + body(encoder.flush())
    assert stream[:4] == b"OggS"
    num_pages = stream.count(b"OggS")
    assert 2000 / page_ms <= num_pages <= max_pages  # the pages follow the asked duration
    with av.open(io.BytesIO(stream), format="ogg") as container:
        frames = list(container.decode(audio=0))
    assert sum(f.samples for f in frames) / 48000 == pytest.approx(2.0, abs=0.05)


@pytest.mark.parametrize(("rate", "bitrate"), [(44100, 128000), (22050, 32000)])
def test_mp3_is_one_stream_at_the_rate_and_bitrate_asked(rate: int, bitrate: int) -> None:
    encoder = ContainerStreamEncoder(AudioFormat("mp3", rate, bitrate=bitrate), PIPER_RATE)
    pcm = tone(2.0, PIPER_RATE)
    stream = b"".join(body(encoder.encode(pcm[i : i + 2205])) for i in range(0, len(pcm), 2205))
    stream += body(encoder.flush())
    with av.open(io.BytesIO(stream), format="mp3") as container:
        audio = container.streams.audio[0]
        num_samples = sum(frame.samples for frame in container.decode(audio))
        assert audio.rate == rate and audio.bit_rate == bitrate
    assert 1.95 <= num_samples / rate <= 2.2  # plus the encoder's own delay
