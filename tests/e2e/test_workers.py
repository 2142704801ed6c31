"""`voxgate serve --workers 2` end to end: one engine process (piper), two gateway processes.

Real processes, real uvicorn on loopback, a real websockets client, real Opus decoded.
Which worker accepted a connection is read from outside (psutil: the worker process
holding the connection's far end), so each test can put sockets on both workers and
show that what it checks holds across them, not only within one.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import websockets

from tests.e2e.test_hardening import close_code
from tests.e2e.test_voices import make_wav
from tests.support.server import ServerProcess, start_server
from tests.support.wait import wait_until
from tests.support.wsclient import Client, speak

KEY = "sk-workers-key-0123456789"
LONG = " ".join(f"This is sentence number {n} of a long answer that goes on for a while."
                for n in range(1, 25))


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two workers over one piper engine of 4 contexts; one owner may hold half of them."""
    proc = start_server(tmp_path_factory.mktemp("workers"), "--workers", "2",
                        "--max-contexts", "4", env={"VOXGATE_MAX_ENGINE_SHARE": "0.5"})
    wait_until(lambda: len(_workers(proc)) == 2, timeout=30)
    yield proc
    assert proc.stop() == 0
    assert proc.log().count("Finished server process") == 2  # both workers drained and ended


def _workers(server: ServerProcess) -> list[psutil.Process]:
    children: list[psutil.Process] = psutil.Process(server.process.pid).children()
    return children


def worker_of(server: ServerProcess, local_port: int) -> int:
    """The pid of the worker that accepted the connection from `local_port`."""
    def holder() -> int | None:
        for worker in _workers(server):
            for conn in worker.net_connections(kind="tcp"):
                if conn.raddr and conn.raddr.port == local_port and conn.laddr.port == server.port:
                    return int(worker.pid)
        return None

    wait_until(lambda: holder() is not None, timeout=5)
    pid = holder()
    assert pid is not None
    return pid


async def sockets_on_each_worker(server: ServerProcess, per_worker: int,
                                 query: str = "") -> dict[int, list[Client]]:
    """Connect until each worker holds `per_worker` sockets; the extra ones are closed."""
    placed: dict[int, list[Client]] = {w.pid: [] for w in _workers(server)}
    for _ in range(60):
        if all(len(c) >= per_worker for c in placed.values()):
            return placed
        client = await Client.connect(server.ws_url + query)
        pid = worker_of(server, client.ws.local_address[1])
        if len(placed[pid]) < per_worker:
            placed[pid].append(client)
        else:
            await client.close()
    raise AssertionError(f"the kernel put no {per_worker} of 60 sockets on each worker")


def get_through_each_worker(server: ServerProcess, path: str) -> dict[int, str]:
    """GET `path` once through each worker: the response body by the worker's pid."""
    bodies: dict[int, str] = {}
    for _ in range(60):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.connect()
        pid = worker_of(server, conn.sock.getsockname()[1])
        if pid not in bodies:
            conn.request("GET", path)
            bodies[pid] = conn.getresponse().read().decode()
        conn.close()
        if len(bodies) == 2:
            return bodies
    raise AssertionError("the kernel put no request on one of the workers")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_each_worker_speaks_a_turn_as_opus_of_its_length(server: ServerProcess) -> None:
    async def scenario() -> list[Client]:
        placed = await sockets_on_each_worker(server, 1)
        clients = [c for group in placed.values() for c in group]
        for client in clients:
            await speak(client, "c", "Hello from one of two gateway processes.")
            await client.close()
        return clients

    for client in run(scenario()):
        done = client.received.of("context.done", "c")[0]
        audio = client.received.opus_of("c")
        assert abs(len(audio) / 48 - done["audio_ms"]) <= 40 and done["audio_ms"] > 1500
        assert float(np.sqrt(np.mean(audio**2))) > 1e-3  # speech, not silence


def test_cancel_on_each_worker_answers_with_the_heard_text(server: ServerProcess) -> None:
    async def cancel_mid_answer(client: Client) -> dict[str, Any]:
        await client.send({"type": "text", "context_id": "long", "text": LONG, "flush": True})
        while sum(f["duration_ms"] for f in client.received.audio_of("long")) < 1000:
            await client.recv()
        await client.send({"type": "cancel", "context_id": "long"})
        cancelled = await client.until("cancelled", "long")
        await client.close()
        return cancelled

    async def scenario() -> list[dict[str, Any]]:
        placed = await sockets_on_each_worker(server, 1)
        return [await cancel_mid_answer(c) for group in placed.values() for c in group]

    for cancelled in run(scenario()):
        assert cancelled["audio_ms_sent"] > 0 and cancelled["spoken_text"]
        heard = (cancelled["spoken_text"] + " " + cancelled["unspoken_text"]).split()
        assert heard == LONG.split()


def test_a_clients_share_of_the_engine_holds_across_workers(server: ServerProcess) -> None:
    """4 contexts, half for one owner (every client here is 127.0.0.1): two talking contexts,
    one per worker, and the owner's third is refused on either worker."""
    async def start(client: Client, context_id: str) -> dict[str, Any]:
        await client.send({"type": "text", "context_id": context_id, "text": LONG,
                           "flush": True})
        while True:
            message = await client.recv()
            if message["type"] == "audio" or message["type"] == "error":
                return message

    async def scenario() -> list[dict[str, Any]]:
        placed = await sockets_on_each_worker(server, 2)
        (a1, a2), (b1, b2) = placed.values()
        answers = [await start(a1, "a1"), await start(b1, "b1"), await start(a2, "a2"),
                   await start(b2, "b2")]
        for client in (a1, b1, a2, b2):
            await client.close()
        return answers

    a1, b1, a2, b2 = run(scenario())
    assert a1["type"] == b1["type"] == "audio"
    for refused in (a2, b2):
        assert (refused["type"], refused["code"]) == ("error", "rate_limited"), refused
        assert "holds 2 of the engine's 4 talking contexts" in refused["message"]


def test_a_voice_registered_through_one_worker_speaks_through_the_other(
        server: ServerProcess) -> None:
    request = httpx.Request("POST", server.url + "/v1/voices",
                            data={"text": "Hello, this is me.", "id": "shared-voice"},
                            files={"audio": ("ref.wav", make_wav(2.0), "audio/wav")})
    body = request.read()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.connect()
    registrar = worker_of(server, conn.sock.getsockname()[1])
    conn.request("POST", "/v1/voices", body=body, headers=dict(request.headers))
    response = conn.getresponse()
    assert response.status == 201, response.read()
    conn.close()

    async def speak_on_the_other() -> tuple[dict[str, Any], Client]:
        deadline = time.monotonic() + 20  # the other worker picks the voice up from the store
        while True:
            try:
                client = await Client.connect(server.ws_url + "?voice=shared-voice")
            except AssertionError:  # not known there yet: session.ready did not come
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)
                continue
            if worker_of(server, client.ws.local_address[1]) == registrar:
                await client.close()
                continue
            done = await speak(client, "v", "The other process speaks with my voice.")
            await client.close()
            return done, client

    done, client = run(speak_on_the_other())
    assert done["audio_ms"] > 1000 and client.received.of("error") == []
    assert len(client.received.opus_of("v")) / 48 == pytest.approx(done["audio_ms"], abs=40)


def test_metrics_through_either_worker_report_every_workers_totals(server: ServerProcess) -> None:
    before = get_through_each_worker(server, "/metrics")
    admitted = 'voxgate_socket_admissions_total{protocol="native",result="admitted"}'

    async def scenario() -> float:
        placed = await sockets_on_each_worker(server, 1)
        audio_ms = 0.0
        for group in placed.values():
            for client in group:
                audio_ms += (await speak(client, "m", "Counting the audio twice."))["audio_ms"]
                await client.close()
        return audio_ms

    opened_before = min(metric(text, admitted) for text in before.values())
    audio_ms = run(scenario())
    time.sleep(1.0)  # the workers' open sessions, written twice a second
    after = get_through_each_worker(server, "/metrics")
    for text in after.values():  # both workers' scrapes report the same totals
        assert metric(text, admitted) >= opened_before + 2
        assert metric(text, "voxgate_sessions") == 0
        assert metric(text, "voxgate_engine_active_contexts") == 0
    totals = [(metric(t, admitted), metric(t, "voxgate_audio_sent_seconds_total"),
               metric(t, "voxgate_engine_requests_submitted_total")) for t in after.values()]
    assert totals[0] == totals[1]
    sent_before = max(metric(t, "voxgate_audio_sent_seconds_total") for t in before.values())
    assert totals[0][1] - sent_before == pytest.approx(audio_ms / 1000, abs=0.05)


def test_a_worker_that_dies_is_started_again_and_sigterm_drains_then_leaves_no_process(
        tmp_path: Path) -> None:
    proc = start_server(tmp_path, "--workers", "2")
    try:
        wait_until(lambda: len(_workers(proc)) == 2, timeout=30)
        pids = {w.pid for w in _workers(proc)}
        os.kill(min(pids), signal.SIGKILL)
        wait_until(lambda: len({w.pid for w in _workers(proc)} - pids) == 1, timeout=30)
        assert "exited with status -9; starting it again" in proc.log()
        wait_until(lambda: httpx.get(proc.url + "/readyz").status_code == 200, timeout=30)
        run(speak_once(proc))
        everyone = [psutil.Process(proc.process.pid), *_workers(proc)]
        done, code = run(speak_through_sigterm(proc))
    finally:
        proc.stop()
    assert done["type"] == "context.done" and done["audio_ms"] > 2000  # it finished speaking
    assert code == 1001 and proc.process.returncode == 0
    _, alive = psutil.wait_procs(everyone, timeout=10)
    assert alive == []


async def speak_through_sigterm(server: ServerProcess) -> tuple[dict[str, Any], int | None]:
    """A turn under way when the server gets SIGTERM: (its context.done, the close code)."""
    client = await Client.connect(server.ws_url)
    await client.send({"type": "text", "context_id": "d", "flush": True,
                       "text": "We drain before we stop. Every sentence is heard. Then we go."})
    while not client.received.audio_of("d"):
        await client.recv()
    server.process.send_signal(signal.SIGTERM)
    done = await client.until("context.done", "d")
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            await client.recv()
    return done, client.ws.close_code


def test_the_workers_stop_when_the_engine_process_is_killed(tmp_path: Path) -> None:
    proc = start_server(tmp_path, "--workers", "2")
    wait_until(lambda: len(_workers(proc)) == 2, timeout=30)
    workers = _workers(proc)
    channel = Path(workers[0].cmdline()[workers[0].cmdline().index("--worker-channel") + 1])
    proc.process.kill()
    proc.process.wait()
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert alive == []
    assert channel.parent.is_dir()  # what a killed process leaves: the next one removes it
    start_server(tmp_path, "--workers", "2").stop()
    assert not channel.parent.exists()


async def speak_once(server: ServerProcess) -> None:
    client = await Client.connect(server.ws_url)
    done = await speak(client, "c", "Still here.")
    await client.close()
    assert done["audio_ms"] > 300


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two workers, auth on, two sockets per key."""
    proc = start_server(tmp_path_factory.mktemp("keyed"), "--workers", "2",
                        env={"VOXGATE_API_KEYS": KEY, "VOXGATE_MAX_SOCKETS_PER_KEY": "2"})
    wait_until(lambda: len(_workers(proc)) == 2, timeout=30)
    yield proc
    proc.stop()


def test_a_session_token_from_one_worker_opens_a_socket_on_the_other(keyed: ServerProcess) -> None:
    async def scenario() -> int:
        for attempt in range(40):
            conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=10)
            conn.connect()
            minter = worker_of(keyed, conn.sock.getsockname()[1])
            conn.request("POST", "/v1/session-tokens", headers={"Authorization": f"Bearer {KEY}"})
            token = httpx.Response(200, content=conn.getresponse().read()).json()["token"]
            conn.close()
            client = await Client.connect(f"{keyed.ws_url}?token={token}")  # ready: redeemed
            opener = worker_of(keyed, client.ws.local_address[1])
            await client.close()
            if opener != minter:
                return attempt
        raise AssertionError("no socket of 40 reached the other worker")

    run(scenario())


def test_a_keys_socket_cap_counts_its_sockets_on_every_worker(keyed: ServerProcess) -> None:
    async def scenario() -> list[tuple[int | None, list[dict[str, Any]]]]:
        held: dict[int, Client] = {}
        for _ in range(40):  # one socket of the key on each worker: its cap of 2 is reached
            client = await Client.connect(f"{keyed.ws_url}?api_key={KEY}")
            pid = worker_of(keyed, client.ws.local_address[1])
            if pid in held:
                await client.close()
                await asyncio.sleep(0.2)  # its place goes back to the engine process
                continue
            held[pid] = client
            if len(held) == 2:
                break
        assert len(held) == 2
        refused = [await close_code(f"{keyed.ws_url}?api_key={KEY}") for _ in range(6)]
        for client in held.values():
            await client.close()
        return refused

    for code, events in run(scenario()):
        assert code == 1013 and [e["code"] for e in events] == ["rate_limited"], (code, events)
