"""Hypothesis fuzzes the protocol over hundreds of real sockets while a good client keeps talking.

Each example opens a fresh socket to a real voxgate on loopback and sends a
burst of random and mutated frames (valid messages with fields swapped for
junk, random JSON, random msgpack, random bytes). Meanwhile a well-behaved
client in its own thread speaks turn after turn; every one of its turns must
come back whole (segments joined equal the text, audio present, no error).
"""

from __future__ import annotations

import asyncio
import json
import threading

import msgpack
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import ERROR_CODES
from tests.support.server import ServerProcess, start_server
from tests.support.wsclient import Client, speak

TYPES = ["text", "flush", "cancel", "playback", "session.update", "close", "sing", "", "TEXT"]
FIELDS = ["context_id", "text", "flush", "played_ms", "voice", "codec", "speed", "sample_rate",
          "frame_ms", "encoding", "pacing", "audio_as", "bitrate", "max_buffer_delay_ms", "type"]

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(
        allow_nan=True, allow_infinity=True)
    | st.text(max_size=40) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8)

valid = st.one_of(
    st.builds(lambda c, t, f: {"type": "text", "context_id": c, "text": t, "flush": f},
              st.sampled_from(["a", "b", "c1", "x" * 64]), st.text(max_size=60), st.booleans()),
    st.builds(lambda c: {"type": "flush", "context_id": c}, st.sampled_from(["a", "b", "zz"])),
    st.builds(lambda c, p: {"type": "cancel", "context_id": c, "played_ms": p},
              st.sampled_from(["a", "b", None]), st.integers(0, 10**6) | st.none()),
    st.just({"type": "session.update", "codec": "pcm16", "sample_rate": 16000}),
)


@st.composite
def mutated(draw: st.DrawFn) -> dict:
    message = dict(draw(valid))
    for _ in range(draw(st.integers(0, 3))):
        message[draw(st.sampled_from(FIELDS))] = draw(junk)
    if draw(st.booleans()):
        message["type"] = draw(st.sampled_from(TYPES))
    return message


def encode(message: object, as_msgpack: bool) -> str | bytes:
    if as_msgpack:
        return msgpack.packb(message, use_bin_type=True)
    return json.dumps(message, default=lambda o: o.hex() if isinstance(o, bytes) else str(o))


frames = st.lists(
    st.one_of(
        st.tuples(mutated(), st.booleans()).map(lambda mb: encode(*mb)),
        junk.map(lambda j: encode(j, False)),
        junk.map(lambda j: encode(j, True)),
        st.binary(max_size=64),
        st.text(max_size=64),
    ),
    min_size=1, max_size=12)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    proc = start_server(tmp_path_factory.mktemp("fuzz"), "--max-contexts", "1000",
                        env={"VOXGATE_LIMIT_MAX_OPEN_CONTEXTS": "4"})
    yield proc
    proc.stop()


class GoodClient(threading.Thread):
    """Talks turn after turn until stopped; records every turn's outcome."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.turns: list[tuple[bool, str]] = []

    def run(self) -> None:
        asyncio.run(self._talk())

    async def _talk(self) -> None:
        # No keepalive pings: websockets draws each ping's payload from the global `random`,
        # and a draw in this thread while hypothesis generates an example in the main one
        # trips hypothesis' "random inside strategies" check (a flaky HypothesisDeprecationWarning).
        client = await Client.connect(self.url, ping_interval=None)
        n = 0
        text = "The good client is still heard clearly. Every turn comes back whole."
        while not self.stop.is_set():
            n += 1
            client.received.events.clear()
            client.received.audio.clear()
            try:
                await asyncio.wait_for(speak(client, f"good{n}", text), 60)
                segments = " ".join(s["text"] for s in client.received.of("segment", f"good{n}"))
                ok = (segments == text and bool(client.received.audio_of(f"good{n}"))
                      and not client.received.of("error"))
                self.turns.append((ok, f"turn {n}: {client.received.events[-3:]}"))
            except Exception as exc:  # noqa: BLE001 - recorded as a failed turn
                self.turns.append((False, f"turn {n}: {exc!r}"))
                return
        await client.close()


def _not_json(name: str) -> None:
    raise AssertionError(f"the server sent {name}, which is not JSON")


async def fuzz_one(url: str, burst: list[str | bytes]) -> list[dict]:
    events = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()  # session.ready
        try:
            for frame in burst:  # a fuzzed `close` may end the socket mid-burst
                await ws.send(frame)
            while True:
                frame = await asyncio.wait_for(ws.recv(), 0.3)
                if isinstance(frame, str):  # strict JSON: a reply never contains NaN
                    events.append(json.loads(frame, parse_constant=_not_json))
        except (asyncio.TimeoutError, websockets.ConnectionClosed):
            pass
    return events


def test_fuzzed_sockets_never_disturb_a_well_behaved_client(fuzzed: ServerProcess) -> None:
    good = GoodClient(fuzzed.ws_url)
    good.start()
    seen_codes: set[str] = set()

    @settings(max_examples=200, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(burst=frames)
    def one_socket(burst: list[str | bytes]) -> None:
        events = asyncio.run(fuzz_one(fuzzed.ws_url, burst))
        for event in events:
            if event.get("type") == "error":
                assert event["code"] in ERROR_CODES, event
                assert "Traceback" not in event["message"]
                seen_codes.add(event["code"])

    try:
        one_socket()
    finally:
        good.stop.set()
        good.join(90)
    assert good.turns, "the good client never finished a turn"
    failures = [why for ok, why in good.turns if not ok]
    assert not failures, failures
    assert {"bad_message"} <= seen_codes
    assert fuzzed.process.poll() is None, "the server died"
    assert fuzzed.metric("voxgate_sessions") == 0 or fuzzed.metric("voxgate_sessions") == 1


ISSUE_21_FRAMES = [  # each killed the socket with 1006, no error event and no log
    "[" * 3000 + "]" * 3000,
    '{"type":"session.update","speed":' + "9" * 400 + "}",
    '{"type":"cancel","played_ms":' + "9" * 400 + "}",
    '{"type":"playback","context_id":"a","played_ms":' + "9" * 400 + "}",
    '{"type":"cancel","played_ms":NaN}',  # was accepted and echoed as invalid JSON
    '{"type":"cancel","played_ms":Infinity}',
    '{"type":"session.update","speed":-Infinity}',
    '{"type":"cancel","played_ms":1e400}',
]


@pytest.mark.parametrize("frame", ISSUE_21_FRAMES, ids=lambda f: f[:36])
def test_deep_nesting_huge_numbers_nan_and_infinity_get_bad_message_and_the_session_goes_on(
        fuzzed: ServerProcess, frame: str) -> None:
    async def scenario() -> tuple[list[dict], Client]:
        client = await Client.connect(fuzzed.ws_url)
        await client.send_raw(frame)
        error = await client.next_event(timeout=10)
        await speak(client, "after", "The same socket goes on.")
        await client.close()
        return [error], client

    (error,), client = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert error["type"] == "error" and error["code"] == "bad_message" and error["fatal"] is False
    assert client.received.of("context.done", "after")
    assert "Traceback" not in fuzzed.log()
