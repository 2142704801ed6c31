"""Clients that never finish hold nothing for long (issue 44), on real servers on loopback.

- A vendor socket that may send its key in its first message (ElevenLabs)
  has AUTH_TIMEOUT_S to do so; then it is closed (1008 with the vendor's error
  frame), and until then its frames are rate-limited like native ones. While
  they wait they hold a place in a pool of their own (64, 8 per address), not
  in `--max-sessions`: eight of them from one address on a `--max-sessions 6`
  server keep no keyed client out, and a ninth is refused.
- A key that comes in the first message takes the socket's place in that
  key's socket count, and in the session cap.
- `POST /v1/voices` takes an upload place only once its body is complete, and
  a body has a total deadline (`VOXGATE_VOICE_UPLOAD_TIMEOUT_S`); a speech body
  has one too (`VOXGATE_LIMIT_SLOW_CONSUMER_TIMEOUT_S`), however slowly either
  trickles in.
- On a one-tenant (loopback) server, a turn past the engine's capacity is `busy`.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.e2e.test_voices import make_wav
from tests.support.server import ServerProcess, start_server
from tests.support.wsclient import Client

KEY_A = "sk-bounds-a-0123456789"
KEY_B = "sk-bounds-b-0123456789"
KEY_C = "sk-bounds-c-0123456789"
AUTH_TIMEOUT_S = 5.0  # the server's default: how long a socket may wait to send its key
BODY_TIMEOUT_S = 3.0  # the bodies' deadlines set for these servers


def run(coro: Any, timeout: float = 180) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def six_sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("six-sessions"), "--max-sessions", "6",
                        env={"VOXGATE_API_KEYS": f"{KEY_A},{KEY_B}"})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def bodies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("bodies"),
                        env={"VOXGATE_API_KEYS": f"{KEY_A},{KEY_B},{KEY_C}",
                             "VOXGATE_MAX_SOCKETS_PER_KEY": "2",
                             "VOXGATE_VOICE_UPLOAD_TIMEOUT_S": str(BODY_TIMEOUT_S),
                             "VOXGATE_LIMIT_SLOW_CONSUMER_TIMEOUT_S": str(BODY_TIMEOUT_S)})
    yield proc
    proc.stop()


def elevenlabs(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/text-to-speech/joe/stream-input?output_format=pcm_16000"


async def until_closed(ws: Any,
                       timeout: float = 30.0) -> tuple[list[dict[str, Any]], int | None, float]:
    """Read until the server closes: (its JSON frames, the close code, when it closed)."""
    frames = []
    try:
        while True:
            frame = await asyncio.wait_for(ws.recv(), timeout)
            if isinstance(frame, str):
                frames.append(json.loads(frame))
    except websockets.ConnectionClosed as closed:
        return frames, (closed.rcvd.code if closed.rcvd else None), time.monotonic()


# -- keyless sockets ----------------------------------------------------------------------------

def test_keyless_sockets_wait_in_a_pool_of_their_own_and_are_closed_at_the_authentication_deadline(
        six_sessions: ServerProcess) -> None:
    async def scenario() -> None:
        opened_at = time.monotonic()
        keyless = [await websockets.connect(elevenlabs(six_sessions)) for _ in range(8)]
        async with websockets.connect(elevenlabs(six_sessions)) as ws:  # past this address's share
            frames, code, _ = await until_closed(ws)
        assert code == 1013 and frames[0]["error"] == "rate_limited", frames
        # the server's six sessions are all free for keyed clients while eight sockets wait
        keyed = [await websockets.connect(elevenlabs(six_sessions),
                                          additional_headers={"xi-api-key": KEY_A})
                 for _ in range(6)]
        async with websockets.connect(elevenlabs(six_sessions),
                                      additional_headers={"xi-api-key": KEY_B}) as ws:
            frames, code, _ = await until_closed(ws)
        assert code == 1013 and frames[0]["error"] == "busy"  # the seventh keyed one: full now
        await keyed[0].send(json.dumps({"text": " "}))
        await keyed[0].send(json.dumps({"text": "Keyed clients speak while others wait. "}))
        await keyed[0].send(json.dumps({"text": ""}))
        frames, code, _ = await until_closed(keyed[0], timeout=60)
        assert code == 1000 and any(f.get("audio") for f in frames)
        assert frames[-1]["isFinal"] is True
        closes = await asyncio.gather(*(until_closed(ws) for ws in keyless))
        for frames, code, closed_at in closes:
            assert code == 1008
            assert frames[-1]["error"] == "unauthorized" and frames[-1]["code"] == 1008
            assert "within 5 s" in frames[-1]["message"]
            assert AUTH_TIMEOUT_S - 0.5 <= closed_at - opened_at <= AUTH_TIMEOUT_S + 10
        for ws in keyed[1:]:
            await ws.close()

    run(scenario())


def test_a_key_in_the_first_message_on_a_full_server_is_busy(six_sessions: ServerProcess) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], int | None]:
        keyed = [await websockets.connect(elevenlabs(six_sessions),
                                          additional_headers={"xi-api-key": KEY_A})
                 for _ in range(6)]
        try:
            async with websockets.connect(elevenlabs(six_sessions)) as ws:  # admitted: it waits
                await ws.send(json.dumps({"text": " ", "xi_api_key": KEY_B}))
                frames, code, _ = await until_closed(ws)
        finally:
            for ws in keyed:
                await ws.close()
        return frames, code

    frames, code = run(scenario())
    assert code == 1013 and frames[0]["error"] == "busy" and "6 sessions" in frames[0]["message"]


def test_a_keyless_socket_sending_junk_is_rate_limited_and_still_closed_at_the_deadline(
        six_sessions: ServerProcess) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], int | None, float, float]:
        async with websockets.connect(elevenlabs(six_sessions)) as ws:
            opened_at = time.monotonic()
            for _ in range(2500):  # over the 400/s x 5 s burst, as fast as the client can
                await ws.send("not json")
            sending_s = time.monotonic() - opened_at
            frames, code, closed_at = await until_closed(ws)
            return frames, code, closed_at - opened_at, sending_s

    frames, code, lasted, sending_s = run(scenario())
    codes = [f["error"] for f in frames]
    assert "rate_limited" in codes and set(codes) <= {"bad_message", "rate_limited", "unauthorized"}
    # answered: the burst, and what the bucket refilled while the frames came (400/s)
    assert codes.count("bad_message") <= 2000 + 400 * (sending_s + 1.0)
    assert code == 1008 and codes[-1] == "unauthorized"
    assert lasted <= AUTH_TIMEOUT_S + 10


def test_a_key_in_the_first_message_takes_a_place_in_that_keys_socket_count(
        bodies: ServerProcess) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], int | None]:
        held = [await websockets.connect(elevenlabs(bodies),
                                         additional_headers={"xi-api-key": KEY_B})
                for _ in range(2)]  # key B's two sockets, its cap here
        try:
            async with websockets.connect(elevenlabs(bodies)) as ws:
                await ws.send(json.dumps({"text": " ", "xi_api_key": KEY_B}))
                frames, code, _ = await until_closed(ws)
        finally:
            for ws in held:
                await ws.close()
        return frames, code

    frames, code = run(scenario())
    assert code == 1013 and frames[0]["error"] == "rate_limited"
    assert "2 sockets" in frames[0]["message"]


# -- bodies ---------------------------------------------------------------------------------------

def multipart_head(port: int, key: str, boundary: str, length: int) -> bytes:
    return (f"POST /v1/voices HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def stalled_upload(port: int, key: str) -> socket.socket:
    """An upload that sends its head and the start of its audio part, then nothing."""
    boundary = uuid.uuid4().hex
    start = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"audio\"; "
             "filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF").encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(multipart_head(port, key, boundary, 200_000) + start)
    return sock


def answer(sock: socket.socket, timeout: float = 30.0) -> tuple[int, dict[str, Any], float]:
    """(status, JSON body, when it came) of the server's answer on a raw connection."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    came = time.monotonic()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), came


def trickled_answer(sock: socket.socket, data: bytes, until: float = math.inf
                    ) -> tuple[int, dict[str, Any], float]:
    """Send `data` one byte every 0.5 s until it runs out, the server answers or closes, or the
    monotonic clock passes `until`; then `answer`. The trickle is the subject: no read waits long,
    but the whole body is too slow."""
    sock.setblocking(False)
    for byte in data:
        if time.monotonic() >= until:
            break
        try:
            sock.send(bytes([byte]))
            if sock.recv(1, socket.MSG_PEEK):
                break
        except BlockingIOError:
            pass
        except OSError:
            break  # the server answered and closed
        time.sleep(0.5)
    sock.setblocking(True)
    return answer(sock)


def register(server: ServerProcess, key: str, voice_id: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/voices", headers={"Authorization": f"Bearer {key}"},
                      timeout=60, data={"id": voice_id, "text": "Hello, this is me."},
                      files={"audio": ("ref.wav", make_wav(1.5), "audio/wav")})


def test_stalled_uploads_hold_no_upload_place_and_are_cut_off_at_the_body_deadline(
        bodies: ServerProcess) -> None:
    started = time.monotonic()
    stalled = [stalled_upload(bodies.port, key) for key in (KEY_A, KEY_B)]  # the 2 upload places
    try:
        made = register(bodies, KEY_C, "third-tenant")  # at once, while both still stall
        assert made.status_code == 201, made.text
        for sock in stalled:
            status, body, came = answer(sock)
            assert (status, body["code"]) == (408, "upload_timeout")
            assert BODY_TIMEOUT_S - 0.5 <= came - started <= BODY_TIMEOUT_S + 10
        again = register(bodies, KEY_C, "third-tenant-2")  # after the deadline too
        assert again.status_code == 201, again.text
    finally:
        for sock in stalled:
            sock.close()


def test_an_upload_trickled_in_is_cut_off_by_its_total_deadline(bodies: ServerProcess) -> None:
    boundary = uuid.uuid4().hex
    sock = socket.create_connection(("127.0.0.1", bodies.port))
    try:
        sock.sendall(multipart_head(bodies.port, KEY_A, boundary, 200_000))
        started = time.monotonic()
        part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"text\"\r\n\r\n").encode()
        sock.sendall(part)
        # ends when the server answers, within the deadline + 10 s
        status, body, came = trickled_answer(sock, b"x" * 200_000,
                                             until=started + BODY_TIMEOUT_S + 10)
    finally:
        sock.close()
    assert (status, body["code"]) == (408, "upload_timeout")
    assert came - started <= BODY_TIMEOUT_S + 5


def test_a_speech_body_trickled_in_is_cut_off_by_its_total_deadline(bodies: ServerProcess) -> None:
    body = json.dumps({"input": "Hello there.", "voice": "joe"}).encode()
    sock = socket.create_connection(("127.0.0.1", bodies.port))
    try:
        sock.sendall((f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1:{bodies.port}\r\n"
                      f"Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n").encode())
        started = time.monotonic()
        status, answer_body, came = trickled_answer(sock, body)  # answered after BODY_TIMEOUT_S
    finally:
        sock.close()
    assert (status, answer_body["code"]) == (408, "body_timeout")
    assert came - started <= BODY_TIMEOUT_S + 5



# -- one tenant ---------------------------------------------------------------------------------

def test_a_one_tenant_server_past_its_capacity_answers_busy_not_rate_limited(
        tmp_path: Path) -> None:
    """Loopback mode: every client is the operator's, the share is the whole engine, and a
    turn past it finds the engine full: `busy`, the code a client's back-off knows."""
    proc = start_server(tmp_path, "--max-contexts", "2")
    try:
        async def scenario() -> dict[str, Any]:
            client = await Client.connect(proc.ws_url)
            try:
                for n in range(3):  # each turn reaches the engine and stays open
                    await client.send({"type": "text", "context_id": f"c{n}",
                                       "text": "Hold this. And"})
                return await client.until("error", timeout=30)
            finally:
                await client.close()

        error = run(scenario())
    finally:
        proc.stop()
    assert (error["code"], error["context_id"]) == ("busy", "c2"), error
