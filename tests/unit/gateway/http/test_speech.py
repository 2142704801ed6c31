"""`POST /v1/audio/speech` against the app in-process, on the real engine with a scripted backend.

The endpoint's checks, its body shapes and its bookkeeping (admission, the
voice held while the body streams) are tested here without a socket:
Starlette's test client runs the real app (lifespan included) in-process, and
the scripted backend makes the audio length exact. The real server and the
real piper voice are tests/e2e/test_http_api.py's.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine.backend import BackendRequest
from engine.engine import Engine, EngineConfig
from engine.types import SynthesisRequest
from gateway.app import create_app
from gateway.audio.codecs import decode_pcm16
from gateway.config import GatewayConfig
from tests.support.scripted_backend import ScriptedBackend


class RecordingBackend(ScriptedBackend):
    """Remembers every request it prepared (to read the speed and voice it was given)."""

    def __init__(self) -> None:
        super().__init__(chunks_per_request=2, chunk_s=0.1)
        self.requests: list[SynthesisRequest] = []

    def prepare(self, request: SynthesisRequest) -> BackendRequest:
        self.requests.append(request)
        return super().prepare(request)


@pytest.fixture()
def app(tmp_path: Path) -> Iterator[tuple[TestClient, RecordingBackend, Any]]:
    backend = RecordingBackend()
    engine = Engine(backend, EngineConfig(warmup_text=""))
    config = GatewayConfig(voice="v", data_dir=tmp_path, web_dir=tmp_path / "no-web")
    application = create_app(config, engine=engine)
    with TestClient(application, base_url="http://localhost") as client:  # a loopback Host
        yield client, backend, application.state.voxgate


def speak(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/audio/speech", json={"input": "Hello there. This is a test.", **body})


def test_a_pcm_body_is_as_long_as_the_audio_of_every_segment(app: Any) -> None:
    client, backend, _ = app
    response = speak(client, response_format="pcm")
    assert response.status_code == 200 and response.headers["content-type"] == "audio/pcm"
    assert [r.text for r in backend.requests] == ["Hello there.", "This is a test."]
    # 2 segments x 2 chunks x 0.1 s at 16 kHz, resampled to 24 kHz
    decoded = decode_pcm16(response.content)
    assert len(decoded) == round(0.4 * 24000)
    assert abs(float(decoded[1000:-1000].mean()) - 0.25) < 0.01  # the scripted backend's level


def test_sse_sends_base64_deltas_of_the_same_body_then_done(app: Any) -> None:
    client, _, _ = app
    raw = speak(client, response_format="pcm").content
    response = speak(client, response_format="pcm", stream_format="sse")
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == {"type": "speech.audio.done", "usage": None}
    deltas = [e for e in events[:-1] if e["type"] == "speech.audio.delta"]
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == raw


def test_openai_voice_names_speak_with_the_default_voice(app: Any) -> None:
    client, backend, _ = app
    assert speak(client, voice="alloy", response_format="wav").status_code == 200
    assert speak(client, voice={"id": "nova"}, response_format="wav").status_code == 200
    assert {r.voice for r in backend.requests} == {"v"}


@pytest.mark.parametrize(("speed", "engine_speed"), [(4.0, 2.0), (0.25, 0.5), (1.25, 1.25)])
def test_openai_speeds_are_clamped_onto_the_engine_range(app: Any, speed: float,
                                                          engine_speed: float) -> None:
    client, backend, _ = app
    assert speak(client, speed=speed, response_format="pcm").status_code == 200
    assert {r.params.speed for r in backend.requests} == {engine_speed}


def test_the_voice_and_the_engine_capacity_are_let_go_when_the_body_ends(app: Any) -> None:
    client, _, state = app
    assert speak(client, response_format="wav").status_code == 200
    assert state.catalog.num_holders("v") == 0
    assert state.engine.scheduler.num_contexts == 0


@pytest.mark.parametrize(("body", "status", "code", "words"), [
    ({"input": ""}, 400, "bad_request", "non-empty string"),
    ({"input": "x" * 5000}, 400, "text_too_long", "the limit is 4096"),
    ({"voice": "zed"}, 400, "unknown_voice", "unknown voice 'zed'; GET /v1/voices lists"),
    ({"response_format": "ogg"}, 400, "unsupported_option", "response_format must be one of"),
    ({"speed": 5}, 400, "unsupported_option", "within 0.25-4.0, got 5"),
    ({"speed": True}, 400, "unsupported_option", "got True"),
    ({"stream_format": "ws"}, 400, "unsupported_option", "audio or sse"),
    ({"instructions": 3}, 400, "bad_request", "'instructions' must be a string"),
    ({"instructions": "Whisper."}, 400, "unsupported_option", "does not take instructions"),
    ({"input": "🙂🙂"}, 400, "bad_request", "nothing speakable"),
    # types before values (issue 21: {"voice": ["a"]} was a 500)
    ({"voice": ["a"]}, 400, "bad_request",
     "'voice' must be a string or {\"id\": string}, got an array"),
    ({"voice": {"id": ["a"]}}, 400, "bad_request", "got an array"),
    ({"input": ["Hello."]}, 400, "bad_request", "'input' must be a string, got an array"),
    ({"model": {"a": 1}}, 400, "bad_request", "'model' must be a string, got an object"),
    ({"response_format": ["wav"]}, 400, "bad_request", "'response_format' must be a string"),
    ({"stream_format": 1}, 400, "bad_request", "'stream_format' must be a string, got a number"),
    ({"speed": int("9" * 400)}, 400, "unsupported_option", "within 0.25-4.0, got 999"),
    ({"speed": "fast"}, 400, "unsupported_option", "got a string"),
])
def test_each_bad_request_gets_the_one_error_shape(app: Any, body: dict[str, Any], status: int,
                                                   code: str, words: str) -> None:
    client, backend, _ = app
    response = client.post("/v1/audio/speech", json={"input": "Hello.", **body})
    assert response.status_code == status
    error = response.json()
    assert error["error"]["code"] == code and words in error["error"]["message"]
    assert error["error"]["type"] == "invalid_request_error"
    assert (error["code"], error["message"]) == (code, error["error"]["message"])
    assert backend.requests == []


def test_a_body_that_is_not_a_json_object_is_refused(app: Any) -> None:
    client, backend, _ = app
    json_type = {"Content-Type": "application/json"}
    for body in (b"[1, 2]", b"{oops", b'{"input": "Hi.", "speed": NaN}',
                 b'{"input": "Hi.", "speed": 1e400}', b"[" * 3000 + b"]" * 3000):
        response = client.post("/v1/audio/speech", content=body, headers=json_type)
        assert response.status_code == 400 and response.json()["code"] == "bad_request", body[:40]
    assert backend.requests == []


def test_a_body_that_is_not_sent_as_json_is_refused_with_415(app: Any) -> None:
    client, backend, _ = app
    body = json.dumps({"input": "Hello there."}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        response = client.post("/v1/audio/speech", content=body, headers=headers)
        assert response.status_code == 415 and response.json()["code"] == "not_json"
    ok = client.post("/v1/audio/speech", content=body,
                     headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    assert len(backend.requests) == 1


def test_a_body_over_the_cap_is_refused_with_413_as_it_streams(app: Any) -> None:
    client, backend, _ = app

    def chunked() -> Iterator[bytes]:  # no Content-Length: the cap holds while reading
        yield b'{"input": "'
        for _ in range(100):
            yield b"x" * 4096
        yield b'"}'

    response = client.post("/v1/audio/speech", content=chunked(),
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["code"] == "body_too_large"
    assert backend.requests == []


def test_a_server_shutting_down_answers_busy(app: Any) -> None:
    client, _, state = app
    state.is_shutting_down = True
    response = speak(client)
    assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
    assert response.json()["code"] == "busy"


def test_another_tenants_voice_is_unknown_to_a_key_and_the_error_lists_no_voice(
        tmp_path: Path) -> None:
    from gateway.access.keys import AuthConfig, tenant_of

    key_a, key_b = "sk-tenant-a-0123", "sk-tenant-b-0123"
    backend = RecordingBackend()
    config = GatewayConfig(voice="v", data_dir=tmp_path, web_dir=tmp_path / "no-web",
                           auth=AuthConfig(api_keys=(key_a, key_b)))
    application = create_app(config, engine=Engine(backend, EngineConfig(warmup_text="")))
    with TestClient(application, base_url="http://localhost") as client:
        application.state.voxgate.catalog.add("a-private", owner=tenant_of(key_a))
        for voice in ("a-private", "nope"):
            response = client.post("/v1/audio/speech", json={"input": "Hello.", "voice": voice},
                                   headers={"Authorization": f"Bearer {key_b}"})
            assert (response.status_code, response.json()["code"]) == (400, "unknown_voice")
            assert response.json()["message"] == (f"unknown voice {voice!r}; GET /v1/voices lists "
                                                   "the voices this key may use")
        assert backend.requests == []
        mine = client.post("/v1/audio/speech", json={"input": "Hello.", "voice": "v"},
                           headers={"Authorization": f"Bearer {key_b}"})
        assert mine.status_code == 200  # the built-in voice is everyone's


def test_text_skipped_in_thousands_of_pieces_is_one_log_line_with_counts_not_text(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from engine.types import VoiceInfo

    class EnglishBackend(RecordingBackend):
        def voices(self) -> list[VoiceInfo]:
            return [VoiceInfo("v", "scripted", "en", self.name, self.sample_rate,
                              languages=("en",))]

    backend = EnglishBackend()
    config = GatewayConfig(voice="v", data_dir=tmp_path, web_dir=tmp_path / "no-web")
    application = create_app(config, engine=Engine(backend, EngineConfig(warmup_text="")))
    with TestClient(application, base_url="http://localhost") as client, \
            caplog.at_level("INFO", logger="voxgate.gateway"):
        only = client.post("/v1/audio/speech", json={"input": "中。" * 2000, "voice": "v"})
        assert only.status_code == 400 and "nothing voice 'v' can say" in only.json()["message"]
        mixed = speak(client, input="Hello there. " + "中。" * 1500 + " Goodbye now.",
                      response_format="pcm")
        assert mixed.status_code == 200
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 2  # one per request, not one per piece
    assert lines[0].endswith("skipped 4000 characters of zh in 2000 pieces: no voice for it")
    assert "3000 characters of zh in 1500 pieces" in lines[1]
    assert "中" not in "".join(lines)
    assert [r.text for r in backend.requests] == ["Hello there.", "Goodbye now."]
