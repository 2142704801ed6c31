"""Every socket passes one door: the admission checks run once, from one function, on every route.

A real `voxgate serve` on loopback with API keys, one socket per key. Each
socket route (`/v1/stream` and the four vendor routes) is asked the same
questions: no key, a foreign Origin, a second socket over its key's socket
cap, and a good key. Each answers in its own shape (the native `error` event,
or the vendor's frame) with the same close code. `admit`
(gateway/access/admission.py) is the only code that counts handshakes in
`voxgate_socket_admissions_total{protocol, result}`; the count rising by
exactly one per handshake, with the right result, on every route, shows
that each handshake went through it, once. A key's sockets are counted
across routes: a native socket and a vendor socket share the key's cap.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import websockets

from tests.support.server import ServerProcess, start_server

#: one key per route, so that the routes' socket caps are independent; SHARED for the cross-route
#: cap
KEYS = {"native": "sk-admit-native-0001", "elevenlabs": "sk-admit-eleven-0001",
        "elevenlabs-multi": "sk-admit-multi-00001", "cartesia": "sk-admit-cartesia-01",
        "deepgram": "sk-admit-deepgram-01"}
SHARED = "sk-admit-shared-00001"
FIRST_MESSAGE = "sk-admit-first-msg-01"
EVIL = "https://evil.example"


@dataclass(frozen=True)
class Route:
    name: str
    protocol: str   # the label admission counts it under
    path: str

    def headers(self, key: str | None) -> dict[str, str]:
        if key is None:
            return {}
        if self.protocol == "native":
            return {"Authorization": f"Bearer {key}"}
        if self.protocol == "elevenlabs":
            return {"xi-api-key": key}
        if self.protocol == "cartesia":
            return {"X-API-Key": key}
        return {"Authorization": f"Token {key}"}


ROUTES = [
    Route("native", "native", "/v1/stream"),
    Route("elevenlabs", "elevenlabs",
          "/v1/text-to-speech/joe/stream-input?output_format=pcm_16000"),
    Route("elevenlabs-multi", "elevenlabs",
          "/v1/text-to-speech/joe/multi-stream-input?output_format=pcm_16000"),
    Route("cartesia", "cartesia", "/tts/websocket?cartesia_version=2025-04-16"),
    Route("deepgram", "deepgram", "/v1/speak?model=joe&sample_rate=16000"),
]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("admission"),
                        env={"VOXGATE_API_KEYS": ",".join([*KEYS.values(), SHARED, FIRST_MESSAGE]),
                             "VOXGATE_MAX_SOCKETS_PER_KEY": "1"})
    yield proc
    proc.stop()


def admissions(server: ServerProcess) -> Counter[tuple[str, str]]:
    """voxgate_socket_admissions_total by (protocol, result)."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("voxgate_socket_admissions_total{"):
            labels, value = line[line.index("{") + 1:line.index("}")], line.rsplit(" ", 1)[1]
            fields = dict(item.split("=", 1) for item in labels.split(","))
            key = (fields["protocol"].strip('"'), fields["result"].strip('"'))
            counts[key] += int(float(value))
    return counts


async def refused(server: ServerProcess, route: Route,
                  headers: dict[str, str]) -> tuple[int | None, str]:
    """Connect; (close code, the one frame sent before it)."""
    async with websockets.connect(f"ws://127.0.0.1:{server.port}{route.path}",
                                  additional_headers=headers) as ws:
        frames = []
        try:
            while True:
                frames.append(await asyncio.wait_for(ws.recv(), 10))
        except websockets.ConnectionClosed as closed:
            assert len(frames) == 1, frames
            return (closed.rcvd.code if closed.rcvd else None), str(frames[0])


async def opened(server: ServerProcess, route: Route, key: str) -> Any:
    """A socket the server admitted (its first frame read where the route sends one)."""
    ws = await websockets.connect(f"ws://127.0.0.1:{server.port}{route.path}",
                                  additional_headers=route.headers(key))
    if route.protocol in ("native", "deepgram"):  # session.ready / Metadata
        await asyncio.wait_for(ws.recv(), 10)
    else:  # nothing is sent first: a keepalive proves the socket is served
        await ws.send(json.dumps({"text": " "} if route.protocol == "elevenlabs" else
                                 {"context_id": "k", "transcript": "", "continue": True,
                                  "voice": {"mode": "id", "id": "joe"},
                                  "output_format": {"container": "raw", "encoding": "pcm_s16le",
                                                    "sample_rate": 16000}}))
    return ws


def code_in(frame: str) -> str:
    message = json.loads(frame)
    for field in ("code", "err_code", "title", "error"):  # native, Deepgram, Cartesia, ElevenLabs
        if isinstance(message.get(field), str) and message[field] != "error":
            return str(message[field])
    raise AssertionError(f"no error code in {frame}")


def test_every_socket_route_runs_the_one_admission_once_per_handshake(keyed: ServerProcess) -> None:
    async def scenario() -> dict[str, dict[str, tuple[int | None, str]]]:
        out: dict[str, dict[str, tuple[int | None, str]]] = {}
        for route in ROUTES:
            key = KEYS[route.name]
            answers = {"foreign origin": await refused(keyed, route,
                                                       {**route.headers(key), "Origin": EVIL})}
            if route.protocol != "elevenlabs":  # ElevenLabs may send its key in the first message
                answers["no key"] = await refused(keyed, route, {})
            first = await opened(keyed, route, key)
            try:
                answers["over the key's cap"] = await refused(keyed, route, route.headers(key))
            finally:
                await first.close()
            out[route.name] = answers
        return out

    before = admissions(keyed)
    answers = asyncio.run(asyncio.wait_for(scenario(), 120))
    for name, by_case in answers.items():
        assert by_case["foreign origin"][0] == 4403, (name, by_case)
        assert code_in(by_case["foreign origin"][1]) == "unauthorized", (name, by_case)
        assert by_case["over the key's cap"][0] == 1013, (name, by_case)
        assert code_in(by_case["over the key's cap"][1]) == "rate_limited", (name, by_case)
        if "no key" in by_case:
            assert by_case["no key"][0] == 4401 and code_in(by_case["no key"][1]) == "unauthorized"
    delta = admissions(keyed) - before
    expected: Counter[tuple[str, str]] = Counter()
    for route in ROUTES:
        expected[(route.protocol, "forbidden_origin")] += 1
        expected[(route.protocol, "admitted")] += 1
        expected[(route.protocol, "rate_limited")] += 1
        if route.protocol != "elevenlabs":
            expected[(route.protocol, "unauthorized")] += 1
    assert delta == expected


def test_a_keys_socket_cap_is_shared_by_the_native_and_the_vendor_routes(
        keyed: ServerProcess) -> None:
    native, deepgram, cartesia = ROUTES[0], ROUTES[4], ROUTES[3]

    async def scenario() -> list[tuple[int | None, str]]:
        holder = await opened(keyed, native, SHARED)
        try:
            return [await refused(keyed, deepgram, deepgram.headers(SHARED)),
                    await refused(keyed, cartesia, cartesia.headers(SHARED))]
        finally:
            await holder.close()

    for code, frame in asyncio.run(asyncio.wait_for(scenario(), 60)):
        assert code == 1013 and code_in(frame) == "rate_limited"


def test_a_key_in_the_elevenlabs_first_message_moves_the_socket_onto_that_keys_cap(
        keyed: ServerProcess) -> None:
    eleven = ROUTES[1]

    async def scenario() -> tuple[str, tuple[int | None, str]]:
        # admitted on its address, then the key of its first message takes the key's one place
        url = f"ws://127.0.0.1:{keyed.port}{eleven.path}"
        async with websockets.connect(url) as keyless:
            await keyless.send(json.dumps({"text": "Hello there. ", "flush": True,
                                           "xi_api_key": FIRST_MESSAGE}))
            first = str(await asyncio.wait_for(keyless.recv(), 60))
            return first, await refused(keyed, ROUTES[0], ROUTES[0].headers(FIRST_MESSAGE))

    first, (code, frame) = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert "audio" in json.loads(first)  # it speaks
    assert code == 1013 and code_in(frame) == "rate_limited"
