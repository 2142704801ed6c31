"""Hostile tests against real servers on loopback: auth, limits, slow clients, faults, shutdown."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
import websockets

from tests.conftest import REPO, ServerProcess, free_port, start_server
from tests.wsclient import Client, speak

KEY = "test-key-0123456789"


def run(coro, timeout: float = 180):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def close_code(url: str, **kwargs) -> tuple[int | None, list[dict]]:  # type: ignore[no-untyped-def]
    """Connect, read until the server closes; (close code, events received)."""
    events = []
    async with websockets.connect(url, **kwargs) as ws:
        try:
            while True:
                frame = await asyncio.wait_for(ws.recv(), 10)
                if isinstance(frame, str):
                    events.append(json.loads(frame))
        except websockets.ConnectionClosed as closed:
            return (closed.rcvd.code if closed.rcvd else None), events
    return None, events


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    proc = start_server(tmp_path_factory.mktemp("secured"),
                        "--allowed-origins", "https://good.example",
                        env={"VOXGATE_API_KEYS": KEY})
    yield proc
    proc.stop()


def test_a_socket_without_a_valid_key_is_closed_with_4401(secured: ServerProcess) -> None:
    for url, headers in [(secured.ws_url, {}), (secured.ws_url + "?api_key=wrong-key-123", {}),
                         (secured.ws_url, {"Authorization": "Bearer nope-nope-nope"})]:
        code, events = run(close_code(url, additional_headers=headers))
        assert code == 4401
        assert [e["code"] for e in events] == ["unauthorized"]
        assert not any(e["type"] == "session.ready" for e in events)


def test_a_valid_key_works_as_bearer_header_or_query_parameter(secured: ServerProcess) -> None:
    async def scenario() -> None:
        for kwargs, url in [({"additional_headers": {"Authorization": f"Bearer {KEY}"}}, secured.ws_url),
                            ({}, secured.ws_url + f"?api_key={KEY}")]:
            client = await Client.connect(url, **kwargs)
            await speak(client, "c", "Authorized.")
            await client.close()

    run(scenario())


def test_http_api_needs_the_key_but_health_does_not(secured: ServerProcess) -> None:
    assert httpx.get(secured.url + "/v1/voices").status_code == 401
    assert httpx.get(secured.url + "/v1/voices", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(secured.url + "/healthz").status_code == 200


def test_origins_outside_the_allow_list_are_refused(secured: ServerProcess) -> None:
    url = secured.ws_url + f"?api_key={KEY}"
    code, _ = run(close_code(url, origin="https://evil.example"))
    assert code == 4403

    async def allowed() -> None:
        client = await Client.connect(url, origin="https://good.example")
        await client.close()

    run(allowed())


def test_server_refuses_a_public_address_without_keys() -> None:
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--host", "0.0.0.0",
                             "--port", str(free_port())], cwd=REPO, capture_output=True, text=True,
                            timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, check=False)
    assert result.returncode == 2
    assert "VOXGATE_API_KEYS" in result.stderr


def test_a_flood_of_messages_is_rate_limited_and_the_session_survives(server: ServerProcess) -> None:
    async def scenario() -> tuple[list[str], Client]:
        client = await Client.connect(server.ws_url)
        for _ in range(2200):  # over the 400/s x 5 s burst
            await client.send({"type": "playback", "context_id": "x", "played_ms": 1})
        codes = []
        while len(codes) < 1:
            event = await client.next_event()
            codes.append(event.get("code"))
        await asyncio.sleep(1.0)  # the bucket refills
        await speak(client, "after", "Still serving.")
        await client.close()
        return codes, client

    codes, client = run(scenario())
    assert codes == ["rate_limited"]
    assert client.received.of("context.done", "after")


def test_a_client_that_never_reads_is_cut_off_and_server_memory_stays_flat(tmp_path) -> None:
    proc = start_server(tmp_path, env={"VOXGATE_LIMIT_MAX_SEND_BUFFER_BYTES": "1000000",
                                       "VOXGATE_LIMIT_SLOW_CONSUMER_TIMEOUT_S": "3"})
    sentence = "This sentence is long enough to make plenty of audio for a listener. "
    try:
        async def warm_up() -> None:  # the same synthesis, read normally: allocator pools settle
            client = await Client.connect(proc.ws_url + "?codec=pcm16&sample_rate=48000")
            for n in range(3):
                await speak(client, f"w{n}", sentence * 4, words=False)
            await client.close()

        async def scenario() -> tuple[float, float, bool, float]:
            await warm_up()
            baseline = proc.rss_mb()
            audio_before = proc.metric("voxgate_engine_audio_seconds_total")
            ws = await websockets.connect(proc.ws_url + "?codec=pcm16&sample_rate=48000", max_queue=1,
                                          max_size=None)
            for n in range(16):  # about 860 s of speech asked for
                await ws.send(json.dumps({"type": "text", "context_id": f"c{n}", "text": sentence * 12,
                                          "flush": True}))
            peak, closed = baseline, False
            for _ in range(240):  # never read; watch the server
                await asyncio.sleep(0.5)
                peak = max(peak, proc.rss_mb())
                if proc.metric("voxgate_sessions") == 0:
                    closed = True
                    break
            made = proc.metric("voxgate_engine_audio_seconds_total") - audio_before
            await ws.close()
            return baseline, peak, closed, made

        baseline, peak, closed, made = run(scenario(), timeout=300)
        assert closed, "the server kept a client that never reads"
        assert "slow consumer" in proc.log()
        # Backpressure stopped synthesis: far less than the 860 s asked for was made
        # (what was made is what the kernel's socket buffers and the look-ahead hold).
        assert made < 400, f"the server synthesized {made:.0f} s for a client that reads nothing"
        # Peak includes the transient buffers of a few parallel synthesis calls.
        assert peak - baseline < 100, f"server RSS grew from {baseline:.0f} to {peak:.0f} MB"

        async def next_client() -> None:
            client = await Client.connect(proc.ws_url)
            await speak(client, "ok", "The next client is served.")
            await client.close()

        run(next_client())
    finally:
        proc.stop()


def test_a_thousand_interrupted_turns_leak_no_context(tmp_path) -> None:
    proc = start_server(tmp_path)
    try:
        async def scenario() -> None:
            client = await Client.connect(proc.ws_url)
            for turn in range(1000):
                await client.send({"type": "text", "context_id": f"t{turn}", "text": "Hello there, friend. And"})
                await client.send({"type": "cancel", "context_id": f"t{turn}", "played_ms": 0})
                await client.until("cancelled", f"t{turn}")
                client.received.audio.clear()
                client.received.events.clear()
            await speak(client, "last", "The socket still works.")
            await client.close()

        run(scenario(), timeout=400)
        time.sleep(0.5)
        assert proc.metric("voxgate_contexts") == 0
        assert proc.metric("voxgate_engine_active_contexts") == 0
        assert proc.metric("voxgate_engine_queue_depth") == 0
    finally:
        proc.stop()


def test_many_sessions_with_barge_ins_leave_memory_near_where_it_started(tmp_path) -> None:
    proc = start_server(tmp_path, "--max-contexts", "500")
    try:
        async def session(n: int) -> None:
            client = await Client.connect(proc.ws_url)
            await client.send({"type": "text", "context_id": "a", "text": f"Session {n} says hello. Then more."})
            while not client.received.audio_of("a"):
                await client.recv()
            await client.send({"type": "cancel", "context_id": "a", "played_ms": 100})
            await client.until("cancelled", "a")
            await client.close()

        async def wave(start: int) -> None:
            await asyncio.gather(*(session(start + i) for i in range(20)))

        async def scenario(waves: range) -> None:
            for w in waves:
                await wave(w * 20)

        run(scenario(range(2)), timeout=300)       # warm-up: allocator pools, caches
        time.sleep(1.0)
        baseline = proc.rss_mb()
        run(scenario(range(2, 12)), timeout=600)   # 200 sessions
        time.sleep(1.0)
        after = proc.rss_mb()
        assert after - baseline < 40, f"RSS {baseline:.0f} -> {after:.0f} MB after 200 sessions"
        assert proc.metric("voxgate_sessions") == 0
        assert proc.metric("voxgate_engine_active_contexts") == 0
    finally:
        proc.stop()


def test_an_injected_backend_fault_hits_only_its_own_context(tmp_path) -> None:
    proc = start_server(tmp_path, app_factory="tests.apps.faulty:create_app")
    try:
        async def victim() -> Client:
            client = await Client.connect(proc.ws_url)
            await client.send({"type": "text", "context_id": "bad", "text": "This FAULT breaks the model.",
                               "flush": True})
            await client.until("error")
            await speak(client, "good", "The same socket goes on.")
            await client.close()
            return client

        async def bystander() -> Client:
            client = await Client.connect(proc.ws_url)
            for n in range(3):
                await speak(client, f"b{n}", "A bystander keeps talking. Nothing breaks here.")
            await client.close()
            return client

        async def scenario() -> tuple[Client, Client]:
            return tuple(await asyncio.gather(victim(), bystander()))  # type: ignore[return-value]

        bad, good = run(scenario())
        errors = bad.received.of("error")
        assert errors[0]["code"] == "internal" and errors[0]["context_id"] == "bad"
        assert "FAULT" not in errors[0]["message"] and "Traceback" not in errors[0]["message"]
        assert bad.received.of("context.done", "good")
        assert good.received.of("error") == []
        assert len(good.received.of("context.done")) == 3
        assert httpx.get(proc.url + "/readyz").status_code == 200
    finally:
        proc.stop()


def test_sigterm_during_speech_drains_then_exits_zero(tmp_path) -> None:
    proc = start_server(tmp_path, "--shutdown-grace", "20")
    try:
        async def scenario() -> tuple[Client, int | None, int | None]:
            client = await Client.connect(proc.ws_url + "?pacing=realtime")
            await client.send({"type": "text", "context_id": "c", "flush": True,
                               "text": "We are speaking when the signal comes. The turn still ends. Then bye."})
            while not client.received.audio_of("c"):
                await client.recv()
            proc.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused, _ = await close_code(proc.ws_url)
            code = None
            try:
                while True:
                    await client.recv(timeout=30)
            except websockets.ConnectionClosed as closed:
                code = closed.rcvd.code if closed.rcvd else None
            return client, code, refused

        client, code, refused = run(scenario())
        assert client.received.of("context.done", "c"), "the open context did not finish"
        assert code == 1001
        assert refused == 1001
        assert proc.process.wait(30) == 0
    finally:
        proc.stop()
