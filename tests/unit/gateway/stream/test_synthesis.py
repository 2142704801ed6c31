"""One synthesis path: the socket and `POST /v1/audio/speech` run the same scenarios alike.

Both routes drive the same sans-I/O session (gateway/stream/synthesis.py does
the segments' routing by language, skipped text, admission, look-ahead and
due times); each scenario here runs once over each route, against the real
app in-process (Starlette's test client, lifespan included) on the real
engine with a scripted backend, so a fix to the shared code shows on both.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine.backend import BackendRequest
from engine.engine import Engine, EngineConfig
from engine.types import SynthesisRequest, VoiceInfo
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.stream.synthesis import MAX_SEGMENTS_AHEAD
from tests.support.scripted_backend import ScriptedBackend

CHINESE = "今天天气很好。"


class EnglishBackend(ScriptedBackend):
    """An English-only voice `v` that records what it was asked, and how much at once."""

    def __init__(self) -> None:
        super().__init__(chunks_per_request=3, chunk_s=0.05, step_delay_s=0.002)
        self.requests: list[SynthesisRequest] = []
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def voices(self) -> list[VoiceInfo]:
        return [VoiceInfo("v", "scripted", "en", self.name, self.sample_rate, languages=("en",))]

    def prepare(self, request: SynthesisRequest) -> BackendRequest:
        with self._lock:
            self.requests.append(request)
            in_flight = len(self.requests) - len(self.released)
            self.max_in_flight = max(self.max_in_flight, in_flight)
        return super().prepare(request)


@pytest.fixture()
def app(tmp_path: Path) -> Iterator[tuple[TestClient, EnglishBackend]]:
    backend = EnglishBackend()
    engine = Engine(backend, EngineConfig(warmup_text=""))
    config = GatewayConfig(voice="v", data_dir=tmp_path, web_dir=tmp_path / "no-web")
    with TestClient(create_app(config, engine=engine), base_url="http://localhost") as client:
        yield client, backend


def over_http(client: TestClient, text: str) -> int:
    """The text as one speech request; the body's bytes (PCM16 at 24 kHz)."""
    response = client.post("/v1/audio/speech",
                           json={"input": text, "voice": "v", "response_format": "pcm"})
    assert response.status_code == 200, response.text
    return len(response.content)


def over_the_socket(client: TestClient, text: str) -> int:
    """The text as one flushed context; the audio's bytes (PCM16 at 24 kHz)."""
    num_bytes = 0
    with client.websocket_connect("ws://localhost/v1/stream?codec=pcm16&sample_rate=24000"
                                  "&encoding=json&audio_as=base64") as ws:
        assert ws.receive_json()["type"] == "session.ready"
        ws.send_json({"type": "text", "context_id": "c", "text": text, "flush": True})
        while (event := ws.receive_json())["type"] != "context.done":
            if event["type"] == "audio":
                num_bytes += len(event["data"]) * 3 // 4  # base64
    return num_bytes


ROUTES: dict[str, Callable[[TestClient, str], int]] = {"http": over_http,
                                                       "socket": over_the_socket}


def skipped_metric(client: TestClient, language: str) -> float:
    line = f'voxgate_text_skipped_characters_total{{language="{language}"}} '
    text = client.get("/metrics").text
    return next((float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line)), 0.0)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_text_no_voice_can_say_is_skipped_and_the_rest_is_spoken_in_order(
        app: Any, route: str) -> None:
    client, backend = app
    text = f"Hello there, my good friend. {CHINESE} See you tomorrow at the station."
    num_bytes = ROUTES[route](client, text)
    assert [(r.text, r.voice) for r in backend.requests] == [
        ("Hello there, my good friend.", "v"), ("See you tomorrow at the station.", "v")]
    assert skipped_metric(client, "zh") == len(CHINESE)
    # two segments of 3 x 50 ms each, PCM16 at 24 kHz (the socket pads to whole 20 ms frames)
    assert 2 * 0.15 * 24000 * 2 <= num_bytes <= 2 * 0.16 * 24000 * 2


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_no_more_than_the_look_ahead_window_is_with_the_engine_at_once(app: Any,
                                                                       route: str) -> None:
    client, backend = app
    text = " ".join(f"Sentence number {n} is a short one." for n in range(3 * MAX_SEGMENTS_AHEAD))
    ROUTES[route](client, text)
    assert len(backend.requests) == 3 * MAX_SEGMENTS_AHEAD
    assert 1 <= backend.max_in_flight <= MAX_SEGMENTS_AHEAD


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_segments_go_in_playback_order_as_one_context_with_no_time_from_the_gateway(
        app: Any, route: str) -> None:
    client, backend = app
    ROUTES[route](client, "One short sentence here. Then a second one. And a third one to end.")
    requests = backend.requests
    assert [r.text for r in requests] == [
        "One short sentence here.", "Then a second one.", "And a third one to end."]
    # one context, which nothing plays before: the engine times each from the one before it
    assert len({r.context_key for r in requests}) == 1 and requests[0].context_key
    assert [r.plays_after for r in requests] == ["", "", ""]
    assert not any(hasattr(r, "deadline") for r in requests)
