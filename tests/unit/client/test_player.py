"""The playback clock a Player keeps, the Speakers sink and Enter as a barge-in key.

No sound device exists here (and CI installs no PortAudio): the Speakers tests
put a stand-in `sounddevice` module in its place, which records the stream it
is asked for and lets the test pull audio the way PortAudio's callback does.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import io
import sys
import types
from typing import Any

import numpy as np
import pytest

from voxgate_client import AudioChunk, MissingExtra, PlaybackClock, Speakers, key_press


def test_the_clock_plays_in_real_time_from_the_first_audio_and_counts_underruns() -> None:
    clock = PlaybackClock()
    clock.on_frame(10.0, 100.0)  # plays 10.0-10.1
    clock.on_frame(10.05, 100.0)  # on time: plays 10.1-10.2
    assert clock.played_ms(10.15) == pytest.approx(150.0)
    assert clock.on_frame(10.3, 100.0) == pytest.approx(100.0)  # 100 ms late: one gap
    assert (clock.num_gaps, clock.gaps_at) == (1, [200.0])
    assert clock.played_ms(10.35) == pytest.approx(250.0)  # stalled through the gap
    assert clock.time_at_played(300.0) == pytest.approx(10.4)


class _Stream:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.is_started = self.is_closed = False

    def start(self) -> None:
        self.is_started = True

    def stop(self) -> None:
        pass

    def close(self) -> None:
        self.is_closed = True


def _chunk(pcm: np.ndarray, rate: int = 24000) -> AudioChunk:
    return AudioChunk("t", 0.0, len(pcm) * 1000 / rate, rate, "opus", pcm=pcm)


def test_speakers_play_pcm16_through_a_portaudio_callback_and_clear_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    streams: list[_Stream] = []
    fake = types.ModuleType("sounddevice")
    fake.RawOutputStream = (  # type: ignore[attr-defined]
        lambda **kw: streams.append(_Stream(**kw)) or streams[-1])
    monkeypatch.setitem(sys.modules, "sounddevice", fake)
    speakers = Speakers()
    speakers.write(_chunk(np.array([1, 2, 3], dtype=np.int16)))
    speakers.write(_chunk(np.array([0.5, -1.5], dtype=np.float32)))  # clipped to int16
    (stream,) = streams
    assert stream.is_started and stream.kwargs["samplerate"] == 24000
    assert (stream.kwargs["channels"], stream.kwargs["dtype"]) == (1, "int16")
    out = bytearray(8 * 2)
    stream.kwargs["callback"](out, 8, None, None)
    assert np.frombuffer(bytes(out), "<i2").tolist() == [1, 2, 3, 16384, -32767, 0, 0, 0]
    speakers.write(_chunk(np.ones(100, dtype=np.int16)))
    speakers.clear()
    stream.kwargs["callback"](out, 8, None, None)
    assert not any(out)  # silence after a clear
    with pytest.raises(ValueError, match="expected audio at 24000 Hz, got 48000 Hz"):
        speakers.write(_chunk(np.ones(4, dtype=np.int16), rate=48000))
    with pytest.raises(ValueError, match="expected decoded PCM or raw pcm16"):
        speakers.write(AudioChunk("t", 0.0, 20.0, 24000, "opus", packets=[b"x"]))
    speakers.close()
    assert stream.is_closed


class _Refusing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """sounddevice as it is where PortAudio is missing: importing it raises OSError."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "sounddevice":
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise OSError("PortAudio library not found")


def test_speakers_say_what_to_install_without_sounddevice_or_portaudio(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # not installed
    with pytest.raises(MissingExtra, match=r"voxgate-client\[sounddevice\]"):
        Speakers().write(_chunk(np.zeros(4, dtype=np.int16)))
    monkeypatch.delitem(sys.modules, "sounddevice")
    monkeypatch.setattr(sys, "meta_path", [_Refusing(), *sys.meta_path])
    with pytest.raises(MissingExtra, match="apt-get install libportaudio2"):
        Speakers().write(_chunk(np.zeros(4, dtype=np.int16)))


def test_key_press_completes_with_the_next_line_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("stop\n"))

    async def main() -> str:
        return await asyncio.wait_for(key_press(), 5)

    assert asyncio.run(main()) == "stop\n"
