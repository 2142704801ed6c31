"""The engine channel's framing: what it accepts, and what it refuses before reading a body."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack
import pytest

from gateway.workers.channel import (
    MAX_FRAME_BYTES,
    FrameError,
    pack,
    read_frame,
    recv_frame,
    unpack,
)


def _reader(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def _read(data: bytes, **kwargs: int) -> list[dict[str, object]] | None:
    async def go() -> list[dict[str, object]] | None:
        return await read_frame(_reader(data), **kwargs)

    return asyncio.run(go())


def test_a_frame_carries_its_messages_and_bytes_stay_bytes() -> None:
    messages: list[dict[str, Any]] = [{"op": "audio", "pcm": b"\x00\x01", "id": "r1"},
                                      {"op": "end", "id": "r2"}]
    assert _read(pack(messages)) == messages


def test_two_frames_read_one_after_the_other_then_a_clean_end() -> None:
    async def go() -> list[object]:
        reader = _reader(pack([{"op": "a"}]) + pack([{"op": "b"}]))
        return [await read_frame(reader), await read_frame(reader), await read_frame(reader)]

    assert asyncio.run(go()) == [[{"op": "a"}], [{"op": "b"}], None]


def test_a_frame_past_the_limit_is_refused_from_its_header_alone() -> None:
    async def go() -> None:
        reader = _reader(struct.pack(">I", 1000), eof=False)  # no body comes: never read
        await asyncio.wait_for(read_frame(reader, max_bytes=999), 5)

    with pytest.raises(FrameError, match="1000 bytes is past the channel's limit of 999"):
        asyncio.run(go())


def test_packing_past_the_limit_is_refused() -> None:
    with pytest.raises(FrameError, match="past the channel's limit"):
        pack([{"op": "audio", "pcm": b"\x00" * (MAX_FRAME_BYTES + 1)}])


@pytest.mark.parametrize(("data", "message"), [
    (b"\x00\x00", "inside a frame's header"),
    (struct.pack(">I", 10) + b"\x91", "inside a frame of 10 bytes"),
])
def test_a_stream_that_ends_inside_a_frame_is_an_error(data: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        _read(data)


@pytest.mark.parametrize(("body", "message"), [
    (b"\xc1", "undecodable bytes"),  # 0xc1 is never used in msgpack
    (msgpack.packb({"op": "x"}), "expected a msgpack array of messages, got dict"),
    (msgpack.packb([1]), "expected a message map with a str 'op', got '1'"),
    (msgpack.packb([{"kind": "x"}]), "with a str 'op'"),
    (msgpack.packb([{"op": 3}]), "with a str 'op'"),
    (msgpack.packb({1: 2}), "undecodable bytes"),  # map keys must be str
])
def test_a_body_that_is_not_an_array_of_messages_is_refused(body: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        unpack(body)
    with pytest.raises(FrameError, match=message):
        _read(struct.pack(">I", len(body)) + body)


def test_a_blocking_socket_reads_the_same_frames_and_fails_when_it_closes() -> None:
    left, right = socket.socketpair()
    with left, right:
        right.settimeout(5)
        left.sendall(pack([{"op": "reply", "id": 1, "result": True}]))
        assert recv_frame(right) == [{"op": "reply", "id": 1, "result": True}]
        left.sendall(struct.pack(">I", 50))
        with pytest.raises(FrameError, match="past the channel's limit of 40"):
            recv_frame(right, max_bytes=40)
        left.close()
        with pytest.raises(FrameError, match="the channel closed"):
            recv_frame(right)
