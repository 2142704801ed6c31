"""The playout, driven synchronously: PCM in, paced `audio` messages out, time passed in."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gateway.audio.codecs import decode_opus_packets, decode_pcm16, make_encoder
from gateway.stream.playout import FRAMES_PER_MESSAGE, REALTIME_LEAD_MS, Playout

RATE = 16000


def tone(seconds: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)


def pcm16_playout(*, is_realtime: bool = False, frame_ms: int = 20) -> Playout:
    return Playout("c", make_encoder("pcm16", 16000, frame_ms, None, RATE), is_realtime=is_realtime)


def test_pushed_audio_waits_in_the_outbox_until_released() -> None:
    playout = pcm16_playout()
    playout.push(tone(0.2))
    assert not playout.is_empty and playout.audio_ms_sent == 0.0
    messages = playout.release(now=1.0, playback_end=0.0)
    assert sum(m.duration_ms for m in messages) == pytest.approx(200.0)
    assert playout.is_empty and playout.audio_ms_sent == pytest.approx(200.0)


def test_messages_have_gapless_seq_contiguous_pts_and_at_most_five_frames() -> None:
    playout = pcm16_playout()
    for _ in range(7):
        playout.push(tone(0.13))
    playout.finish()
    messages = playout.release(now=0.0, playback_end=0.0)
    assert [m.seq for m in messages] == list(range(len(messages)))
    for before, after in itertools.pairwise(messages):
        assert after.pts_ms == pytest.approx(before.pts_ms + before.duration_ms)
    assert max(len(m.data) for m in messages) == FRAMES_PER_MESSAGE * 640  # 20 ms of PCM16
    assert all(m.type == "audio" and m.context_id == "c" and m.codec == "pcm16"
               for m in messages)
    # whole frames out, sample-exact PCM in: 0.91 s becomes 46 frames of 20 ms
    assert playout.pcm_ms_framed == pytest.approx(910.0)
    assert playout.audio_ms_queued == pytest.approx(920.0)


def test_the_pcm16_bytes_released_are_the_pcm_pushed() -> None:
    playout = pcm16_playout()
    pcm = tone(0.3)
    playout.push(pcm[:1000])
    playout.push(pcm[1000:])
    playout.finish()
    data = b"".join(m.data for m in playout.release(0.0, 0.0))
    np.testing.assert_allclose(decode_pcm16(data)[: len(pcm)], pcm, atol=1 / 32767)


def test_opus_messages_carry_a_list_of_packets_that_decode_back() -> None:
    encoder = make_encoder("opus", 48000, 20, None, RATE)
    playout = Playout("c", encoder, is_realtime=False)
    playout.push(tone(0.5))
    playout.finish()
    messages = playout.release(0.0, 0.0)
    packets = [p for m in messages for p in m.payloads]
    assert all(isinstance(p, bytes) for p in packets)
    assert messages[0].to_wire().keys() >= {"packets"} and "data" not in messages[0].to_wire()
    decoded = decode_opus_packets(packets, 48000, pre_skip=encoder.pre_skip)
    assert len(decoded) >= 0.5 * 48000


def test_packed_opus_messages_carry_up_to_frames_per_message_packets_that_decode_back() -> None:
    pcm = tone(1.0)
    decoded = {}
    for size in (FRAMES_PER_MESSAGE, 25):
        encoder = make_encoder("opus", 48000, 20, None, RATE)
        playout = Playout("c", encoder, is_realtime=False, frames_per_message=size)
        playout.push(pcm[:8000])
        playout.push(pcm[8000:])  # 0.5 s a chunk: 25 frames, one message of 25
        playout.finish()
        messages = playout.release(0.0, 0.0)
        assert max(len(m.payloads) for m in messages) == size
        assert [m.seq for m in messages] == list(range(len(messages)))
        for before, after in itertools.pairwise(messages):
            assert after.pts_ms == pytest.approx(before.pts_ms + before.duration_ms)
        if size == 25:
            assert len(messages) == 3  # 25 + 25 + the tail's padding frame
        packets = [p for m in messages for p in m.payloads]
        decoded[size] = decode_opus_packets(packets, 48000, pre_skip=encoder.pre_skip)[:48000]
    # the same encoder state packed two ways: the same audio
    np.testing.assert_allclose(decoded[25], decoded[FRAMES_PER_MESSAGE], atol=1e-6)
    assert float(np.sqrt(np.mean(decoded[25] ** 2))) > 0.1  # the tone, not silence


def test_finish_flushes_the_padded_tail_once() -> None:
    playout = pcm16_playout()
    playout.push(tone(0.01))  # half a frame: nothing whole yet
    assert playout.is_empty
    playout.finish()
    playout.finish()
    (message,) = playout.release(0.0, 0.0)
    assert message.duration_ms == 20.0 and playout.is_finished


def test_clear_drops_what_waits_and_nothing_of_it_is_sent() -> None:
    playout = pcm16_playout()
    playout.push(tone(0.4))
    playout.clear()
    assert playout.release(5.0, 0.0) == [] and playout.audio_ms_sent == 0.0


def test_realtime_pacing_keeps_the_client_at_most_the_lead_ahead() -> None:
    playout = pcm16_playout(is_realtime=True)
    playout.push(tone(5.0))
    first = playout.release(now=10.0, playback_end=0.0)
    assert playout.play_started_at == 10.0
    lead_ms = sum(m.duration_ms for m in first)
    assert REALTIME_LEAD_MS <= lead_ms <= REALTIME_LEAD_MS + 100  # one message of slack
    due = playout.next_release()
    assert due is not None and 10.0 < due <= 10.1
    assert playout.release(now=due - 0.01, playback_end=0.0) == []
    later = playout.release(now=11.0, playback_end=0.0)
    assert lead_ms + sum(m.duration_ms for m in later) == pytest.approx(
        REALTIME_LEAD_MS + 1000, abs=100)


def test_a_context_starts_playing_when_the_one_before_it_ends() -> None:
    playout = pcm16_playout(is_realtime=True)
    playout.push(tone(3.0))
    playout.release(now=10.0, playback_end=12.5)
    assert playout.play_started_at == 12.5


def test_asap_pacing_never_asks_to_be_woken() -> None:
    playout = pcm16_playout()
    playout.push(tone(2.0))
    assert playout.next_release() is None
    realtime = pcm16_playout(is_realtime=True)
    assert realtime.next_release() is None  # nothing waits
    realtime.push(tone(0.1))
    assert realtime.next_release() == 0.0  # the first message leaves at once
