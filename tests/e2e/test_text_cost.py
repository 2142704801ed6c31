"""The text cleaner's cost per delta on a real server (docs/segmenter.md, "Cost per delta").

A socket holds a long line of `_` (a rule the cleaner cannot judge before the line ends)
and sends one-character deltas. The server's own CPU time for 1,500 of them is compared
after 1,000 and after 18,000 held characters: before the holds were bounded and
remembered, every delta read the whole held line again (about ten times the work at
18,000), and a few such sockets slowed every session on the event loop. CPU time, not
wall time, and a ratio with a margin: other processes on the box do not count, and the
unit test (tests/unit/gateway/text/test_cleanup.py) counts the characters read exactly.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import ServerProcess, start_server
from tests.support.wsclient import Client

NUM_DELTAS = 1500  # within the socket's burst of messages (400/s for 5 s)
# 18,000 held and 1,500 deltas stay inside its burst of text (4,000 characters/s for 5 s),
# however fast they are sent


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("text-cost"))
    yield proc
    proc.stop()


def _cpu_s(pid: int) -> float:
    """The process's CPU time, every thread, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _deltas_on_a_held_line(server: ServerProcess,
                                 held: int) -> tuple[float, dict[str, object]]:
    client = await Client.connect(server.ws_url)
    try:
        await client.send({"type": "text", "context_id": "c", "text": "_" * held})
        await client.send({"type": "flush", "context_id": "warm"})  # an answer: the line is held
        await client.until("error", "warm")  # unknown context: everything before it was read
        started = _cpu_s(server.process.pid)
        for _ in range(NUM_DELTAS):
            await client.send({"type": "text", "context_id": "c", "text": "_"})
        await client.send({"type": "flush", "context_id": "c"})
        done = await client.until("context.done", "c", timeout=120)
        errors = client.received.of("error")
        assert [e["code"] for e in errors] == ["bad_context_id"], errors
        return _cpu_s(server.process.pid) - started, done
    finally:
        await client.close()


def test_a_held_line_costs_the_same_per_delta_long_or_short(server: ServerProcess) -> None:
    short_s, short_done = asyncio.run(_deltas_on_a_held_line(server, 1_000))
    long_s, long_done = asyncio.run(_deltas_on_a_held_line(server, 18_000))
    assert short_done["segments"] == long_done["segments"] == 0  # a rule: nothing to say
    assert long_s < 2 * short_s + 0.2, \
        f"{long_s:.2f} s of CPU after 18,000 held, {short_s:.2f} s after 1,000"
