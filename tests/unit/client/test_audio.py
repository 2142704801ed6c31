"""The client's decoders against the server's encoder and FFmpeg's: sample for sample."""

from __future__ import annotations

import itertools

import av
import numpy as np
import pytest

from gateway.audio.codecs import make_encoder
from voxgate_client.audio import Decoder, _mulaw_table
from voxgate_client.wire import Audio


def _tone(rate: int, seconds: float) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.4 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)


def _messages(codec: str, rate: int, pcm: np.ndarray, per_message: int = 3) -> list[Audio]:
    """The server's framing of one turn: whole frames, a few per message."""
    encoder = make_encoder(codec, rate, 20, None, 22050)
    frames = encoder.encode(pcm) + encoder.flush()
    out = []
    for seq, start in enumerate(range(0, len(frames), per_message)):
        group = frames[start:start + per_message]
        payloads = [f.data for f in group]
        out.append(Audio("t", seq, 20.0 * start, 20.0 * len(group), codec,
                         payloads if codec == "opus" else None,
                         None if codec == "opus" else b"".join(payloads), 0.0))
    return out


@pytest.mark.parametrize("rate", [48000, 24000, 16000])
def test_opus_decodes_lined_up_with_the_speech_at_the_sessions_rate(rate: int) -> None:
    speech = _tone(22050, 1.0)
    decoder = Decoder("float32", rate)
    chunks = [decoder.decode(m) for m in _messages("opus", rate, speech)]
    tail = decoder.flush("t", 0.0)
    pcm = np.concatenate([c.pcm for c in chunks + ([tail] if tail else []) if c.pcm is not None])
    expected = av_resampled(speech, rate)
    # the pre-skip is gone: the decoded audio starts with the speech, not 6.5 ms of lookahead
    n = min(len(pcm), len(expected)) - rate // 50
    correlation = float(np.corrcoef(pcm[:n], expected[:n])[0, 1])
    assert correlation > 0.9, correlation
    assert abs(len(pcm) - len(expected)) <= rate // 50  # within the last frame's padding
    for before, after in itertools.pairwise(chunks):
        assert after.pts_ms == pytest.approx(before.pts_ms + before.duration_ms)


def av_resampled(pcm: np.ndarray, rate: int) -> np.ndarray:
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    frame = av.AudioFrame.from_ndarray(pcm[None, :], format="flt", layout="mono")
    frame.sample_rate = 22050
    out = [f.to_ndarray()[0] for f in resampler.resample(frame) + resampler.resample(None)]
    return np.concatenate(out)


def test_pcm16_decodes_to_int16_and_float32_without_pyav() -> None:
    samples = np.array([0, 1, -1, 32767, -32768], dtype="<i2")
    message = Audio("t", 0, 0.0, 0.1, "pcm16", None, samples.tobytes(), 0.0)
    as_int = Decoder("int16", 24000).decode(message).pcm
    assert as_int is not None and as_int.dtype == np.int16 and as_int.tolist() == samples.tolist()
    as_float = Decoder("float32", 24000).decode(message).pcm
    assert as_float is not None and as_float.dtype == np.float32
    assert as_float.tolist() == pytest.approx((samples / 32768.0).tolist())


def test_mulaw_decodes_as_ffmpegs_g711_decoder_does() -> None:
    codes = bytes(range(256))
    context = av.CodecContext.create("pcm_mulaw", "r")
    context.sample_rate = 8000
    context.layout = "mono"
    expected = np.concatenate([f.to_ndarray()[0] for f in context.decode(av.Packet(codes))])
    assert _mulaw_table(np)[np.frombuffer(codes, np.uint8)].tolist() == expected.tolist()
    assert _mulaw_table(np)[0xFF] == 0


def test_raw_audio_is_passed_through_undecoded() -> None:
    message = Audio("t", 4, 80.0, 20.0, "opus", [b"\x01"], None, 3.0)
    chunk = Decoder("raw", 48000).decode(message)
    assert (chunk.packets, chunk.pcm) == ([b"\x01"], None)
    assert (chunk.pts_ms, chunk.received_at) == (80.0, 3.0)


def test_an_unknown_audio_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="expected audio one of int16, float32, raw"):
        Decoder("int8", 48000)
