from __future__ import annotations

import av
import numpy as np
import pytest

from gateway.audio.codecs import (
    StreamEncoder,
    decode_mulaw,
    decode_opus_packets,
    decode_pcm16,
    float_to_pcm16,
    make_encoder,
    pcm_to_float,
)
from gateway.audio.containers import ContainerStreamEncoder, is_available
from gateway.audio.formats import MUXED_KINDS, AudioFormat

PIPER_RATE = 22050


def sine(freq: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def chirp(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * (200 * t + 300 * t * t))).astype(np.float32)


def encode_in_uneven_pieces(encoder: StreamEncoder, pcm: np.ndarray, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    frames = []
    start = 0
    while start < len(pcm):
        size = int(rng.integers(1, 3000))
        frames += encoder.encode(pcm[start : start + size])
        start += size
    frames += encoder.flush()
    assert {frame.duration_ms for frame in frames} == {float(encoder.frame_ms)}
    return [frame.data for frame in frames]


def resampled_reference(pcm: np.ndarray, rate_in: int, rate_out: int, num: int) -> np.ndarray:
    t_in = np.arange(len(pcm)) / rate_in
    return np.interp(np.arange(num) / rate_out, t_in, pcm, right=0.0)


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))


def tone_level(pcm: np.ndarray, freq: float, rate: int) -> float:
    """Amplitude of `freq` in `pcm` (a one-bin DFT), comparable to the sine's amplitude."""
    t = np.arange(len(pcm)) / rate
    return float(2 * np.abs(np.dot(pcm, np.exp(-2j * np.pi * freq * t))) / len(pcm))


@pytest.mark.parametrize("frame_ms", [20, 40, 60])
def test_opus_round_trip_keeps_a_440_hz_tone_and_its_duration(frame_ms: int) -> None:
    pcm = sine(440, 1.013, PIPER_RATE)
    encoder = make_encoder("opus", 48000, frame_ms, None, PIPER_RATE)
    packets = encode_in_uneven_pieces(encoder, pcm)
    decoded = decode_opus_packets(packets, 48000, pre_skip=encoder.pre_skip)
    expected = len(pcm) * 48000 / PIPER_RATE
    assert abs(len(decoded) - expected) <= encoder.frame_samples
    assert len(packets) * encoder.frame_samples >= expected + encoder.pre_skip
    middle = decoded[4800:-4800]
    assert tone_level(middle, 440, 48000) == pytest.approx(0.5, abs=0.05)
    assert np.sqrt(np.mean(middle**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)


@pytest.mark.parametrize("rate_out", [48000, 24000, 16000, 8000])
def test_opus_decoded_after_pre_skip_lines_up_with_the_input_sample_for_sample(
    rate_out: int,
) -> None:
    pcm = chirp(0.8, PIPER_RATE)
    encoder = make_encoder("opus", rate_out, 20, None, PIPER_RATE)
    decoded = decode_opus_packets(
        encode_in_uneven_pieces(encoder, pcm), rate_out, pre_skip=encoder.pre_skip
    )
    reference = resampled_reference(pcm, PIPER_RATE, rate_out, len(decoded))
    window = slice(rate_out // 20, len(reference) - rate_out // 5)

    def score(lag: int) -> float:
        shifted = decoded[window.start + lag : window.stop + lag]
        return correlation(shifted, reference[window])

    assert max(range(-4, 5), key=score) == 0
    assert score(0) > 0.95


def test_opus_pre_skip_is_the_lookahead_recorded_in_opus_head() -> None:
    encoder = make_encoder("opus", 24000, 20, 24000, 24000)
    assert encoder.opus_head is not None and encoder.opus_head[:8] == b"OpusHead"
    pre_skip_48k = int.from_bytes(encoder.opus_head[10:12], "little")
    assert pre_skip_48k > 0
    assert encoder.pre_skip == pre_skip_48k // 2


def test_opus_flush_adds_a_frame_only_when_the_padding_cannot_hold_the_lookahead() -> None:
    # 20 ms at 48 kHz = 960 samples; the lookahead is 312.
    roomy = make_encoder("opus", 48000, 20, None, 48000)
    assert len(roomy.encode(np.zeros(960 + 100, np.float32)) + roomy.flush()) == 2
    tight = make_encoder("opus", 48000, 20, None, 48000)
    assert len(tight.encode(np.zeros(960 + 900, np.float32)) + tight.flush()) == 3


def test_encode_returns_only_whole_frames_and_flush_returns_the_padded_rest() -> None:
    encoder = make_encoder("pcm16", 16000, 20, None, 16000)
    assert encoder.encode(np.zeros(319, np.float32)) == []
    frames = encoder.encode(np.zeros(2, np.float32))
    assert [len(frame.data) for frame in frames] == [640]
    rest = encoder.flush()
    assert [len(frame.data) for frame in rest] == [640]
    assert encoder.flush() == []


def test_flush_without_any_audio_returns_no_frames() -> None:
    assert make_encoder("opus", 48000, 20, None, PIPER_RATE).flush() == []


def test_pcm16_has_the_exact_length_and_the_same_samples_at_the_same_rate() -> None:
    pcm = chirp(0.5, 24000)
    encoder = make_encoder("pcm16", 24000, 40, None, 24000)
    data = b"".join(encode_in_uneven_pieces(encoder, pcm))
    decoded = decode_pcm16(data)
    assert len(data) == 2 * 960 * -(-len(pcm) // 960)
    np.testing.assert_allclose(decoded[: len(pcm)], pcm, atol=1 / 32767)
    assert not decoded[len(pcm) :].any()


def test_pcm16_resampled_from_22050_keeps_the_duration() -> None:
    pcm = chirp(0.7, PIPER_RATE)
    encoder = make_encoder("pcm16", 48000, 20, None, PIPER_RATE)
    decoded = decode_pcm16(b"".join(encode_in_uneven_pieces(encoder, pcm)))
    expected = round(len(pcm) * 48000 / PIPER_RATE)
    assert len(decoded) == 960 * -(-expected // 960)
    reference = resampled_reference(pcm, PIPER_RATE, 48000, expected)
    assert correlation(decoded[2000 : expected - 2000], reference[2000:-2000]) > 0.999


def test_mulaw_runs_at_8_khz_with_one_byte_per_sample_whatever_rate_is_asked() -> None:
    pcm = sine(440, 0.5, PIPER_RATE)
    encoder = make_encoder("mulaw", 48000, 20, None, PIPER_RATE)
    assert encoder.sample_rate == 8000
    packets = encode_in_uneven_pieces(encoder, pcm)
    assert {len(packet) for packet in packets} == {160}
    decoded = decode_mulaw(b"".join(packets))
    assert len(decoded) == 160 * len(packets)
    assert abs(len(decoded) - 4000) < 160
    assert tone_level(decoded[400:3600], 440, 8000) == pytest.approx(0.5, abs=0.03)


def test_mulaw_bytes_follow_g711() -> None:
    encoder = make_encoder("mulaw", 8000, 20, None, 8000)
    silence = encoder.encode(np.zeros(160, np.float32))[0].data
    full_scale = encoder.encode(np.full(160, 1.0, np.float32))[0].data
    assert silence == b"\xff" * 160  # G.711 mu-law codes zero as 0xFF
    assert full_scale == b"\x80" * 160  # and positive full scale as 0x80


def test_pcm_helpers_convert_both_ways_and_clip() -> None:
    assert float_to_pcm16(np.array([0.0, 1.0, -1.0, 2.0], np.float32)).tolist() == [
        0,
        32767,
        -32767,
        32767,
    ]
    assert pcm_to_float(np.array([-32768, 16384], np.int16)).tolist() == [-1.0, 0.5]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("flac", 48000, 20, None, 22050), "expected codec in"),
        (("mulaw", 8000, 25, None, 22050), "expected frame_ms in"),
        (("opus", 44100, 20, None, 22050), "expected sample_rate in"),
        (("opus", 48000, 25, None, 22050), "expected frame_ms in"),
        (("opus", 48000, 20, 1000, 22050), "expected bitrate within 6000-510000 bit/s, got 1000"),
        (("pcm16", 48000, 20, None, 100), "expected sample_rate_in within"),
    ],
)
def test_invalid_encoder_arguments_say_what_was_expected(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        make_encoder(*args)
    assert "got" in str(info.value)


def test_encoder_rejects_stereo_and_integer_pcm() -> None:
    encoder = make_encoder("pcm16", 48000, 20, None, 48000)
    with pytest.raises(
        ValueError, match=r"expected mono PCM of shape \[num_samples\], got shape \(2, 10\)"
    ):
        encoder.encode(np.zeros((2, 10), np.float32))
    with pytest.raises(ValueError, match="got dtype int32"):
        encoder.encode(np.zeros(10, np.int32))


def test_encode_after_flush_is_an_error() -> None:
    encoder = make_encoder("opus", 48000, 20, None, 48000)
    encoder.flush()
    with pytest.raises(RuntimeError, match="expected encode"):
        encoder.encode(np.zeros(10, np.float32))


def decode_container(body: bytes, kind: str) -> tuple[np.ndarray, int]:
    import io

    demux_format = {"aac": "aac", "ogg_opus": "ogg"}.get(kind, kind)
    with av.open(io.BytesIO(body), format=demux_format) as container:
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        parts = [
            f.to_ndarray()[0]
            for frame in container.decode(stream)
            for f in resampler.resample(frame)
        ]
    return np.concatenate(parts), rate


def body_of(frames: list) -> bytes:
    return b"".join(frame.data for frame in frames)


MUXED = [kind for kind in MUXED_KINDS if is_available(kind)]
RATE_OF = {"ogg_opus": 48000}


def test_this_build_muxes_at_least_ogg_opus_and_wav() -> None:
    assert {"ogg_opus", "wav"} <= set(MUXED)


@pytest.mark.parametrize("kind", MUXED)
def test_every_container_streams_and_decodes_back_to_the_right_duration(kind: str) -> None:
    pcm = sine(440, 1.5, PIPER_RATE, amplitude=0.3)
    encoder = ContainerStreamEncoder(AudioFormat(kind, RATE_OF.get(kind, 24000)), PIPER_RATE)
    pieces = [encoder.encode(pcm[i : i + 2205]) for i in range(0, len(pcm), 2205)]
    # one piece per call, as long as its input: the durations add up to the audio given
    assert all(len(piece) == 1 for piece in pieces)
    assert sum(piece[0].duration_ms for piece in pieces) == pytest.approx(1500.0)
    pieces.append(encoder.flush())
    assert sum(len(body_of(piece)) > 0 for piece in pieces[:-1]) >= len(pieces) // 2  # it streams
    decoded, rate = decode_container(b"".join(body_of(piece) for piece in pieces), kind)
    assert len(decoded) / rate == pytest.approx(1.5, abs=0.08)
    assert tone_level(decoded[rate // 4 : -rate // 4], 440, rate) == pytest.approx(0.3, abs=0.05)


def test_streamed_wav_header_has_maximal_lengths_and_pcm16_at_24_khz() -> None:
    encoder = ContainerStreamEncoder(AudioFormat("wav", 24000), 24000)
    body = body_of(encoder.encode(np.zeros(2400, np.float32)) + encoder.flush())
    assert body[:4] == b"RIFF" and body[4:8] == b"\xff\xff\xff\xff"
    assert body[36:44] == b"data\xff\xff\xff\xff"
    assert int.from_bytes(body[24:28], "little") == 24000
    assert len(body) == 44 + 2 * 2400


def test_unframed_pcm16_is_raw_pcm_as_it_comes_with_nothing_padded() -> None:
    encoder = make_encoder("pcm16", 24000, 0, None, 24000)
    pcm = chirp(0.25, 24000)
    frames = encoder.encode(pcm[:1001]) + encoder.encode(pcm[1001:]) + encoder.flush()
    assert [f.duration_ms for f in frames] == pytest.approx([1001 / 24, (len(pcm) - 1001) / 24])
    np.testing.assert_allclose(decode_pcm16(body_of(frames)), pcm, atol=1 / 32767)


def test_a_kind_that_is_not_muxed_says_what_was_expected() -> None:
    with pytest.raises(ValueError, match=r"expected a muxed kind in .*, got 'pcm16'"):
        ContainerStreamEncoder(AudioFormat("pcm16", 24000), 24000)


def test_a_wav_body_without_audio_is_the_bare_header() -> None:
    body = body_of(ContainerStreamEncoder(AudioFormat("wav", 24000), 22050).flush())
    assert len(body) == 44 and body[:4] == b"RIFF"


def test_container_encode_after_flush_is_an_error() -> None:
    encoder = ContainerStreamEncoder(AudioFormat("ogg_opus", 48000), 24000)
    encoder.flush()
    with pytest.raises(RuntimeError, match="expected encode"):
        encoder.encode(np.zeros(10, np.float32))
