"""The engine process's host and a worker's client over the real channel (a Unix socket).

The host runs with a real `Engine` (on the scripted backend: no model) on an event loop
of its own thread, as it runs in the engine process; the workers' links are the real
`WorkerEngine` and `ControlLink`, whose synchronous calls need that other loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

from engine.engine import Engine, EngineConfig
from engine.errors import EngineBusyError
from engine.scheduler import SchedulerConfig
from engine.types import RequestId, SynthesisRequest
from gateway.access.fair_share import FairShareConfig
from gateway.errors import ShareExceededError
from gateway.workers import client as client_module
from gateway.workers.channel import read_frame
from gateway.workers.client import WorkerEngine
from gateway.workers.control import (
    ControlLink,
    SharedFairShare,
    SharedKeyCounter,
    SharedSessionTokens,
)
from gateway.workers.host import WINDOW, EngineHost
from tests.support.scripted_backend import ScriptedBackend
from tests.support.wait import wait_until

T = TypeVar("T")


class HostThread:
    """An `EngineHost` over a scripted engine, on its own thread's event loop."""

    def __init__(self, path: Path, backend: ScriptedBackend) -> None:
        self.path = path
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = EngineConfig(warmup_text="", scheduler=SchedulerConfig(max_contexts=4))
        self.engine = Engine(backend, config)
        self.host = EngineHost(self.engine, path, share=FairShareConfig(0.5))
        self.run(self.engine.start())
        self.run(self.host.start())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(10)

    def stop(self) -> None:
        self.run(self.host.stop())
        self.run(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[HostThread]:
    running = HostThread(tmp_path / "engine.sock", ScriptedBackend(chunks_per_request=2))
    yield running
    running.stop()


@pytest.fixture
def links(host: HostThread) -> Iterator[list[ControlLink]]:
    """Two workers' control links, closed at the end."""
    made = [ControlLink(host.path, 0), ControlLink(host.path, 1)]
    yield made
    for link in made:
        link.close()


def test_a_keys_share_is_one_across_workers(links: list[ControlLink]) -> None:
    first, second = links
    share_a, share_b = SharedFairShare(first), SharedFairShare(second)
    share_a.admit("owner", "k1")
    share_b.admit("owner", "k2")  # the engine holds 4: the owner's share is 2, over both workers
    for share in (share_a, share_b):
        with pytest.raises(ShareExceededError, match="holds 2 of the engine's 4"):
            share.admit("owner", "k3")
    assert share_a.num_refused == share_b.num_refused == 1
    share_b.admit("other", "k3")
    share_a.release("k1")
    first.call("num_sockets")  # the release went before this answer, on the same link
    share_b.admit("owner", "k4")
    share_b.admit("other", "k5")
    with pytest.raises(EngineBusyError, match="at capacity"):  # the engine is full
        share_a.admit("third", "k6")


def test_socket_counts_are_one_across_workers(links: list[ControlLink]) -> None:
    counter_a, counter_b = (SharedKeyCounter(link) for link in links)
    assert counter_a.acquire("key", 2) and counter_b.acquire("key", 2)
    assert not counter_a.acquire("key", 2)
    assert counter_a.num_open == counter_b.num_open == 2
    counter_b.release("key")
    assert counter_a.acquire("key", 2)


def test_a_session_token_issued_through_one_worker_is_redeemed_once_through_another(
        links: list[ControlLink]) -> None:
    issuer, redeemer = SharedSessionTokens(links[0]), SharedSessionTokens(links[1])
    issued = issuer.issue("the-key", 1000.0)
    assert issued is not None and issued[1] == 1060.0
    assert redeemer.num_outstanding("the-key") == 1
    assert redeemer.redeem(issued[0], 1001.0) == "the-key"
    assert issuer.redeem(issued[0], 1001.0) is None  # spent, on every worker
    assert redeemer.redeem("vxt_made_up", 1001.0) is None


def test_a_worker_that_goes_away_gives_back_its_contexts_and_sockets(
        host: HostThread, links: list[ControlLink]) -> None:
    link = links[0]
    SharedFairShare(link).admit("owner", "k1")
    SharedKeyCounter(link).acquire("owner", 5)
    assert host.engine.scheduler.num_contexts == 1 and host.host.key_counter.num_open == 1
    link.close()
    wait_until(lambda: host.engine.scheduler.num_contexts == 0, timeout=5)
    wait_until(lambda: host.host.key_counter.num_open == 0, timeout=5)


def _request(name: str) -> SynthesisRequest:
    return SynthesisRequest(RequestId(name), "hello there", "v")


def test_requests_stream_back_with_one_frame_per_step_for_a_worker(
        host: HostThread, monkeypatch: pytest.MonkeyPatch) -> None:
    audio_frames: list[int] = []

    async def counting(reader: asyncio.StreamReader) -> Any:
        messages = await read_frame(reader)
        num_audio = sum(m["op"] == "audio" for m in messages or [])
        if num_audio:
            audio_frames.append(num_audio)
        return messages

    monkeypatch.setattr(client_module, "read_frame", counting)

    async def scenario() -> dict[str, int]:
        engine = WorkerEngine(host.path)
        await engine.start()
        assert engine.is_ready and engine.sample_rate == 16000 and engine.voices[0].voice_id == "v"

        async def drain(name: str) -> int:
            return len([chunk async for chunk in engine.submit(_request(name))])

        counts = await asyncio.gather(*(drain(f"r{i}") for i in range(4)))
        await engine.stop()
        return dict(zip([f"r{i}" for i in range(4)], counts, strict=True))

    assert asyncio.run(scenario()) == {"r0": 2, "r1": 2, "r2": 2, "r3": 2}
    assert sum(audio_frames) == 8
    assert len(audio_frames) <= len(host.backend.batches)  # never more than a frame a step


def test_a_request_nobody_takes_holds_a_window_of_chunks_in_the_worker(tmp_path: Path) -> None:
    running = HostThread(tmp_path / "engine.sock", ScriptedBackend(chunks_per_request=30))

    async def scenario() -> tuple[int, int, int]:
        engine = WorkerEngine(running.path)
        await engine.start()
        chunks = engine.submit(_request("slow"))
        first = await anext(chunks)  # noqa: F841 -- one taken, then none for a while
        await asyncio.sleep(0.5)
        queued = engine._queues[RequestId("slow")].qsize()
        num_steps = len(running.backend.batches)
        rest = [chunk async for chunk in chunks]
        await engine.stop()
        return queued, num_steps, 1 + len(rest)

    try:
        queued, num_steps, total = asyncio.run(scenario())
    finally:
        running.stop()
    assert queued == WINDOW
    assert num_steps < 30  # the engine stopped making audio nobody took
    assert total == 30


def test_a_bad_frame_closes_its_link_and_no_other(host: HostThread,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "voxgate.engine")

    async def scenario() -> int:
        engine = WorkerEngine(host.path)
        await engine.start()
        bad = socket.socket(socket.AF_UNIX)
        bad.connect(str(host.path))
        bad.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
        bad.settimeout(5)
        while bad.recv(4096):  # the host's `fatal`, then the end
            pass
        bad.close()
        count = len([chunk async for chunk in engine.submit(_request("after"))])
        await engine.stop()
        return count

    assert asyncio.run(scenario()) == 2
    assert "sent a bad frame on the engine channel: expected a msgpack array" in caplog.text


def test_an_unknown_op_is_a_bad_frame(links: list[ControlLink],
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "voxgate.engine")
    link = links[0]
    with pytest.raises(EngineBusyError, match="did not answer"):
        link.call("format_disk")
    assert "expected a known op, got 'format_disk'" in caplog.text
