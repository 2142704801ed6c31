"""Unit tests of the vendor sockets' formats, transcoder and alignment (no server)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from engine.types import RequestId, WordTiming
from gateway.compat.alignment import Tracked, segment_chars, segment_words
from gateway.compat.cartesia import parse_output_format as cartesia_format
from gateway.compat.elevenlabs import parse_output_format
from gateway.compat.formats import OutputFormat, Transcoder, decode_raw, native_format
from gateway.errors import ProtocolError
from gateway.stream.context import Segment


def _tone(seconds: float, rate: int = 48000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * 220 * t) * 8000).astype("<i2").tobytes()


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


@pytest.mark.parametrize("name", ["pcm_11025", "mp3_22050_128", "opus_24000_32", "wav", "ulaw_16000"])
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


def test_native_rates_pass_through_and_others_are_transcoded() -> None:
    assert native_format(OutputFormat("pcm_s16le", 24000)) == ("pcm16", 24000, False)
    assert native_format(OutputFormat("mulaw", 8000)) == ("mulaw", 8000, False)
    assert native_format(OutputFormat("pcm_s16le", 44100)) == ("pcm16", 48000, True)
    assert native_format(OutputFormat("alaw", 8000))[2] is True


@pytest.mark.parametrize("fmt", [OutputFormat("pcm_s16le", 22050), OutputFormat("pcm_f32le", 16000),
                                 OutputFormat("alaw", 8000), OutputFormat("mulaw", 8000)])
def test_raw_transcoding_keeps_the_length_at_the_stated_rate(fmt: OutputFormat) -> None:
    transcoder = Transcoder(fmt)
    pcm = _tone(1.0)
    data = b"".join(transcoder.encode(pcm[i:i + 1920]) for i in range(0, len(pcm), 1920))
    data += transcoder.finish()
    decoded = decode_raw(data, fmt)
    assert abs(len(decoded) - fmt.sample_rate) <= fmt.sample_rate // 100
    assert 0.1 < float(np.abs(decoded).max()) < 0.4  # 8000 / 32768, through the codec


@pytest.mark.parametrize("fmt", [OutputFormat("mp3", 22050, 32000), OutputFormat("ogg_opus", 48000, 64000)])
def test_compressed_transcoding_is_one_stream_a_decoder_reads_whole(fmt: OutputFormat) -> None:
    transcoder = Transcoder(fmt)
    pcm = _tone(2.0)
    data = b"".join(transcoder.encode(pcm[i:i + 4800]) for i in range(0, len(pcm), 4800))
    data += transcoder.finish()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        num_samples = sum(frame.samples for frame in container.decode(audio=0))
        assert stream.rate == fmt.sample_rate
    assert 1.95 <= num_samples / fmt.sample_rate <= 2.2  # plus the encoder's own delay


def _segment(text: str, words: list[WordTiming] | None, audio_ms: float) -> Segment:
    segment = Segment(0, text, RequestId("r0"), 0.0)
    segment.words, segment.audio_ms, segment.is_sent = words, audio_ms, True
    return segment


def test_characters_spread_over_their_words_and_tile_the_segment() -> None:
    words = [WordTiming("Hello", 0.0, 400.0), WordTiming("world.", 450.0, 900.0)]
    timings = segment_chars(Tracked(_segment("Hello world.", words, 930.0), 0.0, is_first=True))
    assert "".join(timings.chars) == "Hello world."
    assert timings.start_ms[0] == 0.0 and timings.start_ms[5] == 400.0  # the space takes the gap
    assert timings.duration_ms[5] == 50.0
    assert timings.start_ms[-1] + timings.duration_ms[-1] == pytest.approx(930.0)
    later = segment_chars(Tracked(_segment("Again.", None, 500.0), 930.0, is_first=False))
    assert later.chars[0] == " " and "".join(later.chars) == " Again."
    assert later.start_ms[-1] + later.duration_ms[-1] == pytest.approx(500.0)


def test_cartesia_words_are_seconds_from_the_context_start() -> None:
    words = [WordTiming("Hi", 0.0, 300.0), WordTiming("there.", 300.0, 700.0)]
    names, starts, ends = segment_words(Tracked(_segment("Hi there.", words, 700.0), 1000.0, is_first=False))
    assert names == ["Hi", "there."] and starts == [1.0, 1.3] and ends == [1.3, 1.7]
