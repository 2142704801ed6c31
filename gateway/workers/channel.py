"""The local channel between the engine process and its gateway workers: framed msgpack.

A frame is a 4-byte big-endian length, then that many bytes of one msgpack
array of messages, each a map with a str `op`. Each side gathers what it has
to say in one turn of its event loop and sends it as one frame: the engine
process sends all the audio a step made for one worker in one frame, and a
worker its submits, cancels and acknowledgements the same way (host.py,
client.py). The control calls (control.py) send one message a frame.

Bounds: a frame longer than `max_bytes` is refused from its header, before its
body is read; a body that is not msgpack, not an array of maps with a str `op`,
or past `MAX_MESSAGES` messages is refused whole. Either way the reader raises
`FrameError` and the connection is closed: a bad frame ends the channel it came
on, never another worker's.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack

__all__ = ["MAX_FRAME_BYTES", "MAX_MESSAGES", "FrameError", "pack", "read_frame", "recv_frame",
           "unpack"]

#: the longest frame either side accepts: a step's audio for one worker at 256 streams of
#: 0.5 s of 24 kHz float32 PCM is 12 MB
MAX_FRAME_BYTES = 64 << 20
#: the most messages one frame may carry
MAX_MESSAGES = 65536
_HEADER = struct.Struct(">I")

Message = dict[str, Any]


class FrameError(Exception):
    """A frame the channel's format refuses (the module doc); the connection is closed."""


def pack(messages: list[Message]) -> bytes:
    """One frame holding `messages`."""
    body: bytes = msgpack.packb(messages, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {len(body)} bytes is past the channel's limit of "
                         f"{MAX_FRAME_BYTES} bytes")
    return _HEADER.pack(len(body)) + body


def unpack(body: bytes) -> list[Message]:
    """A frame's body as its messages; raises FrameError for anything but an array of maps
    with a str `op`."""
    try:
        messages = msgpack.unpackb(body, raw=False, strict_map_key=True,
                                   max_array_len=MAX_MESSAGES)
    except (ValueError, msgpack.UnpackException) as exc:
        raise FrameError(f"expected a msgpack array of messages, got undecodable bytes ({exc})")\
            from None
    if not isinstance(messages, list):
        raise FrameError(f"expected a msgpack array of messages, got {type(messages).__name__}")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise FrameError(f"expected a message map with a str 'op', got {str(message)[:80]!r}")
    return messages


def _length(header: bytes, max_bytes: int) -> int:
    (length,) = _HEADER.unpack(header)
    if length > max_bytes:
        raise FrameError(f"a frame of {length} bytes is past the channel's limit of "
                         f"{max_bytes} bytes")
    return int(length)


async def read_frame(reader: asyncio.StreamReader,
                     max_bytes: int = MAX_FRAME_BYTES) -> list[Message] | None:
    """The next frame's messages; None at a clean end of stream (between frames)."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("the stream ended inside a frame's header") from None
    length = _length(header, max_bytes)
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise FrameError(f"the stream ended inside a frame of {length} bytes") from None
    return unpack(body)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> list[Message]:
    """The next frame's messages from a blocking socket (its timeout applies to each read);
    raises FrameError at the end of stream."""
    length = _length(_recv_exactly(sock, _HEADER.size), max_bytes)
    return unpack(_recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise FrameError("the channel closed")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
