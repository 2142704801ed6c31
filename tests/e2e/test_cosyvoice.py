"""End to end: `voxgate serve --engine cosyvoice` on a tiny random model speaks Opus over the
socket."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.backends.cosyvoice.backend import CosyVoiceBackend
from engine.types import RequestId, SynthesisRequest
from tests.support.cosyvoice_parity import one_torch_thread  # noqa: F401 (autouse)
from tests.support.cosyvoice_random_parts import write_reference_wav
from tests.support.cosyvoice_steps import run
from tests.support.cosyvoice_tiny import tiny_backend, tiny_options
from tests.support.server import ServerProcess, start_server
from tests.support.wsclient import Client, assert_lasts, one_turn, speak

TEXT = "Hello world."
MS_PER_TOKEN = 40.0  # 2 mel frames of 480 samples at 24 kHz


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    base = tmp_path_factory.getbasetemp()
    options = tiny_options(base)
    flags = [arg for key, value in options.items() if key not in ("tokenizer", "model_dir")
             for arg in ("--engine-option", f"{key}={value}")]
    env = {"VOXGATE_COSYVOICE_TOKENIZER": "bytes"}  # the environment maps onto the same options
    proc = start_server(tmp_path_factory.mktemp("cosyvoice-server"), "--engine", "cosyvoice",
                        "--model-dir", str(options["model_dir"]), "--voice", "default", *flags,
                        env=env, ready_timeout=180.0)
    yield proc
    proc.stop()


def expected_tokens(base: Path, text: str) -> int:
    """How many speech tokens the same model speaks for `text` (greedy decoding is
    deterministic)."""
    backend = tiny_backend(base)  # the server's options: greedy tokens are the same
    assert isinstance(backend, CosyVoiceBackend)
    item = backend.prepare(SynthesisRequest(RequestId("expected"), text, "default"))
    tokens, _ = run(backend, [item], max_steps=2000)["expected"]
    return len(tokens)


def test_a_turn_comes_back_as_opus_of_40_ms_per_speech_token(
        server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    client = asyncio.run(asyncio.wait_for(one_turn(server.ws_url, "turn-1", TEXT), 120))
    num_tokens = expected_tokens(tmp_path_factory.getbasetemp(), TEXT)
    assert_lasts(client.received, "turn-1", num_tokens * MS_PER_TOKEN)
    (segment,) = client.received.of("segment", "turn-1")
    assert segment["text"] == TEXT


def test_session_speed_speaks_the_same_tokens_faster(
        server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    async def scenario() -> Client:
        client = await Client.connect(server.ws_url)
        await client.send({"type": "session.update", "speed": 1.5})
        await client.until("session.updated")
        await speak(client, "fast", TEXT)
        await client.close()
        return client

    client = asyncio.run(asyncio.wait_for(scenario(), 120))
    want_ms = int(
        2 * expected_tokens(tmp_path_factory.getbasetemp(), TEXT) / 1.5) * MS_PER_TOKEN / 2
    assert not client.received.of("error")
    assert abs(client.received.of("context.done", "fast")[0]["audio_ms"] - want_ms) <= 40


def test_a_cancelled_turn_stops_and_the_next_one_speaks(server: ServerProcess) -> None:
    async def scenario() -> Client:
        client = await Client.connect(server.ws_url)
        await client.send({"type": "text", "context_id": "long", "text": "Hello world. " * 3,
                           "flush": True})
        await client.until("audio", "long")
        await client.send({"type": "cancel", "context_id": "long"})
        await client.until("cancelled", "long")
        frames_at_cancel.append(len(client.received.audio_of("long")))
        await speak(client, "next", TEXT)
        await client.close()
        return client

    frames_at_cancel: list[int] = []
    client = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert len(client.received.audio_of("long")) == frames_at_cancel[0]  # nothing after `cancelled`
    assert not client.received.of("context.done", "long")
    assert client.received.of("context.done", "next")[0]["audio_ms"] > 0


def test_a_registered_reference_voice_is_cloned_and_speaks(
        server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("voice")
    wav = write_reference_wav(base / "alice.wav", seconds=2.0, rate=22050)
    response = httpx.post(server.url + "/v1/voices",
                          data={"id": "alice", "text": "Testing one two."},
                          files={"audio": ("alice.wav", wav.read_bytes(), "audio/wav")}, timeout=60)
    assert response.status_code == 201, response.text
    listed = {v["id"]: v for v in httpx.get(server.url + "/v1/voices").json()["voices"]}
    assert "alice" in listed

    async def scenario() -> Client:
        client = await Client.connect(server.ws_url + "?voice=alice")
        await speak(client, "alice-1", TEXT)
        await client.close()
        return client

    client = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert client.received.of("context.done", "alice-1")[0]["audio_ms"] > 0


def test_a_turn_of_two_sentences_speaks_both_each_as_its_own_sequence(
        server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    async def scenario() -> Client:
        client = await Client.connect(server.ws_url)
        await speak(client, "turn", "Hello world. How are you?")
        await client.close()
        return client

    client = asyncio.run(asyncio.wait_for(scenario(), 120))
    texts = [segment["text"] for segment in client.received.of("segment", "turn")]
    assert texts == ["Hello world.", "How are you?"]
    # greedy decoding: each segment speaks what it speaks alone, whatever ran beside it
    base = tmp_path_factory.getbasetemp()
    tokens = sum(expected_tokens(base, text) for text in texts)
    done = client.received.of("context.done", "turn")[0]
    assert abs(done["audio_ms"] - tokens * MS_PER_TOKEN) <= 80, (done["audio_ms"], tokens)
