"""Unit tests of the vendor sockets' formats and alignment (no server)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from engine.types import WordTiming
from gateway.audio.encoders import EncoderFactory
from gateway.audio.formats import AudioFormat
from gateway.compat.alignment import Tracked, segment_chars, segment_words
from gateway.compat.elevenlabs import parse_output_format
from gateway.compat.formats import OutputFormat, cartesia_format, decode_raw
from gateway.errors import ProtocolError


@pytest.mark.parametrize(("name", "expected"), [
    ("pcm_22050", OutputFormat("pcm_s16le", 22050)),
    ("ulaw_8000", OutputFormat("mulaw", 8000)),
    ("alaw_8000", OutputFormat("alaw", 8000)),
    ("mp3_22050_32", OutputFormat("mp3", 22050, 32000)),
    ("mp3_44100_192", OutputFormat("mp3", 44100, 192000)),
    ("opus_48000_64", OutputFormat("ogg_opus", 48000, 64000)),
])
def test_elevenlabs_output_formats_parse(name: str, expected: OutputFormat) -> None:
    assert parse_output_format(name) == expected


@pytest.mark.parametrize("name",
                         ["pcm_11025", "mp3_22050_128", "opus_24000_32", "wav", "ulaw_16000"])
def test_an_unoffered_elevenlabs_format_is_refused_with_the_list(name: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_output_format(name)
    assert caught.value.code == "unsupported_option" and "mp3_22050_32" in caught.value.message


def test_cartesia_formats_parse_and_refuse_containers() -> None:
    fmt = {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 44100}
    assert cartesia_format(fmt) == OutputFormat("pcm_f32le", 44100)
    with pytest.raises(ProtocolError):
        cartesia_format({**fmt, "container": "mp3"})
    with pytest.raises(ProtocolError):
        cartesia_format({**fmt, "sample_rate": 12345})


@pytest.mark.parametrize(("fmt", "audio"), [
    (OutputFormat("pcm_s16le", 44100), AudioFormat("pcm16", 44100)),
    (OutputFormat("pcm_f32le", 16000), AudioFormat("pcm_f32", 16000)),
    (OutputFormat("alaw", 8000), AudioFormat("alaw", 8000)),
    (OutputFormat("mp3", 22050, 32000), AudioFormat("mp3", 22050, bitrate=32000)),
    (OutputFormat("ogg_opus", 48000, 64000), AudioFormat("ogg_opus", 48000, 20, 64000)),
])
def test_each_vendor_format_is_one_encoder_format(fmt: OutputFormat, audio: AudioFormat) -> None:
    assert fmt.audio == audio
    assert fmt.is_stream == (not audio.is_framed)


def _engine_pcm(seconds: float, rate: int = 22050) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * 220 * t) * 0.25).astype(np.float32)


@pytest.mark.parametrize("fmt", [OutputFormat("pcm_s16le", 22050), OutputFormat("pcm_f32le", 16000),
                                 OutputFormat("alaw", 8000), OutputFormat("mulaw", 8000)])
def test_raw_formats_keep_the_length_at_the_stated_rate(fmt: OutputFormat) -> None:
    encoder = EncoderFactory().open(fmt.audio, 22050)
    pcm = _engine_pcm(1.0)
    frames = [f for i in range(0, len(pcm), 2205) for f in encoder.encode(pcm[i:i + 2205])]
    data = b"".join(f.data for f in frames + encoder.flush())
    decoded = decode_raw(data, fmt)
    assert abs(len(decoded) - fmt.sample_rate) <= fmt.sample_rate // 50
    assert 0.15 < float(np.abs(decoded).max()) < 0.35  # 0.25, through the codec


@pytest.mark.parametrize("fmt", [OutputFormat("mp3", 22050, 32000),
                                 OutputFormat("ogg_opus", 48000, 64000)])
def test_compressed_formats_are_one_stream_a_decoder_reads_whole(fmt: OutputFormat) -> None:
    encoder = EncoderFactory().open(fmt.audio, 22050)
    pcm = _engine_pcm(2.0)
    frames = [f for i in range(0, len(pcm), 2205) for f in encoder.encode(pcm[i:i + 2205])]
    data = b"".join(f.data for f in frames + encoder.flush())
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        num_samples = sum(frame.samples for frame in container.decode(audio=0))
        assert stream.rate == fmt.sample_rate
    assert 1.95 <= num_samples / fmt.sample_rate <= 2.2  # plus the encoder's own delay


def test_characters_spread_over_their_words_and_tile_the_segment() -> None:
    words = [WordTiming("Hello", 0.0, 400.0), WordTiming("world.", 450.0, 900.0)]
    timings = segment_chars(Tracked("Hello world.", words, 930.0, 0.0, is_first=True))
    assert "".join(timings.chars) == "Hello world."
    assert timings.start_ms[0] == 0.0 and timings.start_ms[5] == 400.0  # the space takes the gap
    assert timings.duration_ms[5] == 50.0
    assert timings.start_ms[-1] + timings.duration_ms[-1] == pytest.approx(930.0)
    later = segment_chars(Tracked("Again.", None, 500.0, 930.0, is_first=False))
    assert later.chars[0] == " " and "".join(later.chars) == " Again."
    assert later.start_ms[-1] + later.duration_ms[-1] == pytest.approx(500.0)


def test_cartesia_words_are_seconds_from_the_context_start() -> None:
    words = [WordTiming("Hi", 0.0, 300.0), WordTiming("there.", 300.0, 700.0)]
    names, starts, ends = segment_words(Tracked("Hi there.", words, 700.0, 1000.0, is_first=False))
    assert names == ["Hi", "there."] and starts == [1.0, 1.3] and ends == [1.3, 1.7]
