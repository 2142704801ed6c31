"""Streaming container bodies for the speech endpoint, decoded back with FFmpeg (PyAV)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from gateway.audio.codecs import decode_pcm16
from gateway.audio.containers import SPECS, ContainerStreamEncoder, available_formats

PIPER_RATE = 22050


def tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def level(pcm: np.ndarray, freq: float, rate: int) -> float:
    t = np.arange(len(pcm)) / rate
    return float(2 * np.abs(np.dot(pcm, np.exp(-2j * np.pi * freq * t))) / len(pcm))


def test_each_format_declares_its_rate_and_content_type() -> None:
    for fmt in available_formats():
        encoder = ContainerStreamEncoder(fmt, PIPER_RATE)
        assert encoder.sample_rate == SPECS[fmt].sample_rate
        assert encoder.content_type == SPECS[fmt].content_type


def test_a_bad_input_rate_is_refused_with_the_range() -> None:
    with pytest.raises(ValueError, match="expected sample_rate_in within 8000-192000 Hz, got 4000"):
        ContainerStreamEncoder("wav", 4000)


def test_raw_pcm_is_resampled_to_24_khz_keeping_duration_and_pitch() -> None:
    encoder = ContainerStreamEncoder("pcm", PIPER_RATE)
    pcm = tone(1.0, PIPER_RATE)
    body = b"".join(encoder.encode(pcm[i : i + 1000]) for i in range(0, len(pcm), 1000))
    body += encoder.finish()
    decoded = decode_pcm16(body)
    assert len(decoded) == round(len(pcm) * 24000 / PIPER_RATE)
    assert level(decoded[2400:-2400], 440, 24000) == pytest.approx(0.3, abs=0.01)


def test_int16_input_gives_the_same_body_as_float_input() -> None:
    pcm = tone(0.3, 24000)
    as_int16 = np.round(pcm * 32768).astype(np.int16)
    from_float = ContainerStreamEncoder("wav", 24000)
    from_int = ContainerStreamEncoder("wav", 24000)
    a = from_float.encode(as_int16.astype(np.float32) / 32768) + from_float.finish()
    b = from_int.encode(as_int16) + from_int.finish()
    assert a == b and len(a) == 44 + 2 * len(pcm)


def test_empty_input_writes_nothing_and_a_second_finish_adds_nothing() -> None:
    encoder = ContainerStreamEncoder("pcm", 24000)
    assert encoder.encode(np.zeros(0, np.float32)) == b""
    encoder.encode(tone(0.1, 24000))
    assert len(encoder.finish()) == 0  # raw PCM at the same rate: nothing held back
    assert encoder.finish() == b""


def test_ogg_opus_streams_pages_while_the_audio_comes_in() -> None:
    encoder = ContainerStreamEncoder("opus", PIPER_RATE)
    pcm = tone(2.0, PIPER_RATE)
    step = PIPER_RATE // 10  # 100 ms pieces, as the engine delivers them
    pieces = [encoder.encode(pcm[i : i + step]) for i in range(0, len(pcm), step)]
    assert sum(1 for piece in pieces if piece) >= len(pieces) // 2
    body = b"".join(pieces) + encoder.finish()
    assert body[:4] == b"OggS"
    with av.open(io.BytesIO(body), format="ogg") as container:
        frames = list(container.decode(audio=0))
    assert sum(f.samples for f in frames) / 48000 == pytest.approx(2.0, abs=0.05)
