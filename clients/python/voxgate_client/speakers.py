"""The default output device as a `Player` sink, and Enter on the console as a barge-in.

`Speakers` plays through sounddevice (PortAudio; `pip install
'voxgate-client[sounddevice]'`). Its wheels for macOS and Windows carry
PortAudio; on Linux it loads the system's (Debian: `apt-get install
libportaudio2`), and without it importing sounddevice fails: so it is imported
only when a `Speakers` first plays, and the error says what to install. A
PortAudio callback pulls from a small buffer that `write` fills (the `Player`
keeps it at about its `lead_ms`); an empty buffer plays silence.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

from voxgate_client.audio import AudioChunk, MissingExtra


def _sounddevice() -> Any:
    try:
        import sounddevice  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise MissingExtra("Speakers needs sounddevice: pip install "
                           "'voxgate-client[sounddevice]'") from exc
    except OSError as exc:  # the module is there, the PortAudio library is not
        raise MissingExtra(f"Speakers needs the PortAudio library ({exc}): on Debian or "
                           "Ubuntu, apt-get install libportaudio2") from exc
    return sounddevice


class Speakers:
    """The default output device (or `device`), mono PCM16 at the audio's own rate.

    Takes decoded chunks (`audio="int16"` or `"float32"`) or raw PCM16 (`codec
    "pcm16"` with `audio="raw"`); raw Opus cannot be played without decoding.
    """

    def __init__(self, *, device: int | str | None = None, max_buffer_s: float = 10.0) -> None:
        self.device = device
        self.max_buffer_s = max_buffer_s
        self._stream: Any = None
        self._rate = 0
        self._buffer = bytearray()
        self._lock = threading.Lock()

    def write(self, chunk: AudioChunk) -> None:
        data = _pcm16_bytes(chunk)
        if self._stream is None:
            self._open(chunk.sample_rate)
        elif chunk.sample_rate != self._rate:
            raise ValueError(f"expected audio at {self._rate} Hz, got {chunk.sample_rate} Hz")
        with self._lock:
            room = int(self.max_buffer_s * self._rate) * 2 - len(self._buffer)
            # bounded: past it audio is dropped (a Player never comes near it)
            self._buffer += data[:max(0, room)]

    def clear(self) -> None:
        with self._lock:
            self._buffer.clear()

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.stop()
            stream.close()

    def _open(self, rate: int) -> None:
        sd = _sounddevice()
        self._rate = rate
        self._stream = sd.RawOutputStream(samplerate=rate, channels=1, dtype="int16",
                                          device=self.device, callback=self._pull)
        self._stream.start()

    def _pull(self, outdata: Any, frames: int, time: Any, status: Any) -> None:
        """PortAudio's callback, on its own thread: the next `frames` samples, or silence."""
        wanted = frames * 2
        with self._lock:
            data = bytes(self._buffer[:wanted])
            del self._buffer[:wanted]
        outdata[:len(data)] = data
        if len(data) < wanted:
            outdata[len(data):wanted] = b"\x00" * (wanted - len(data))


def _pcm16_bytes(chunk: AudioChunk) -> bytes:
    pcm = chunk.pcm
    if pcm is not None:
        if pcm.dtype.kind == "f":
            pcm = (pcm.clip(-1.0, 1.0) * 32767.0).round().astype("<i2")
        return bytes(pcm.astype("<i2", copy=False).tobytes())
    if chunk.codec == "pcm16" and chunk.data is not None:
        return chunk.data
    raise ValueError(f"expected decoded PCM or raw pcm16, got raw {chunk.codec}: "
                     "ask for audio='int16' (Opus needs the av extra) or codec 'pcm16'")


# -- Enter on the console -----------------------------------------------------------------

_waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[str]]] = []
_waiting_lock = threading.Lock()
_reader: threading.Thread | None = None


def key_press() -> asyncio.Future[str]:
    """A future that completes with the next line typed on stdin (Enter): a barge-in key.

    One daemon thread reads stdin for every caller, so a line goes to whoever is waiting
    now, never to an earlier caller that stopped waiting. At end of input it never
    completes (a script run with no console plays its turns out).
    """
    global _reader
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()
    with _waiting_lock:
        _waiting.append((loop, future))
        if _reader is None:
            _reader = threading.Thread(target=_read_lines, name="voxgate-keys", daemon=True)
            _reader.start()
    return future


def _read_lines() -> None:
    global _reader
    try:
        for line in sys.stdin:
            with _waiting_lock:
                waiting = [(loop, f) for loop, f in _waiting if not f.done()]
                _waiting.clear()
            for loop, future in waiting:
                try:
                    loop.call_soon_threadsafe(_resolve, future, line)
                except RuntimeError:  # that loop is closed: nobody waits any more
                    pass
    except (OSError, ValueError):  # stdin closed, or not readable (a test runner's)
        pass
    with _waiting_lock:
        _reader = None  # end of input: a later caller looks again (and finds it ended)


def _resolve(future: asyncio.Future[str], line: str) -> None:
    if not future.done():
        future.set_result(line)
