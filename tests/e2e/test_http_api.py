"""HTTP beside the socket: health, metrics, voices, and OpenAI's speech endpoint."""

from __future__ import annotations

import base64
import io
import json

import av
import httpx
import numpy as np
import pytest

from tests.support.server import ServerProcess


def decode_file(data: bytes) -> tuple[float, float]:
    """(duration seconds, rms) of an audio file decoded by PyAV."""
    with av.open(io.BytesIO(data)) as container:
        samples = [frame.to_ndarray().astype(np.float64).reshape(-1)
                   for frame in container.decode(audio=0)]
        rate = container.streams.audio[0].rate
    pcm = np.concatenate(samples)
    if np.abs(pcm).max() > 2.0:  # integer sample formats
        pcm = pcm / 32768.0
    return len(pcm) / rate, float(np.sqrt(np.mean(pcm**2)))


def test_health_and_readiness(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_voices_list_the_embedded_joe_voice(server: ServerProcess) -> None:
    body = httpx.get(server.url + "/v1/voices").json()
    assert body["default"] == "joe"
    assert any(v["id"] == "joe" and v["backend"] == "piper" for v in body["voices"])


def test_official_openai_client_streams_speech_to_a_decodable_file(
        server: ServerProcess, tmp_path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    path = tmp_path / "speech.mp3"
    with client.audio.speech.with_streaming_response.create(
            model="voxgate", voice="alloy",
            input="The official client can stream this. Twice over.",
            response_format="mp3") as response:
        response.stream_to_file(path)
    duration, rms = decode_file(path.read_bytes())
    assert 1.5 < duration < 10.0
    assert rms > 0.01


@pytest.mark.parametrize("fmt", ["opus", "wav", "flac", "aac"])
def test_each_response_format_decodes(server: ServerProcess, fmt: str) -> None:
    response = httpx.post(server.url + "/v1/audio/speech",
                          json={"model": "voxgate", "voice": "joe", "input": "Format check.",
                                "response_format": fmt}, timeout=60)
    assert response.status_code == 200, response.text
    duration, rms = decode_file(response.content)
    assert 0.4 < duration < 5.0 and rms > 0.01


def test_pcm_format_is_raw_24khz_samples(server: ServerProcess) -> None:
    response = httpx.post(server.url + "/v1/audio/speech",
                          json={"input": "Raw pcm.", "voice": "joe", "response_format": "pcm"},
                          timeout=60)
    pcm = np.frombuffer(response.content, dtype="<i2")
    assert response.headers["content-type"].startswith("audio/pcm")
    assert 0.3 < len(pcm) / 24000 < 4.0


def test_sse_stream_format_sends_deltas_then_done(server: ServerProcess) -> None:
    response = httpx.post(server.url + "/v1/audio/speech",
                          json={"input": "Server sent events. In two parts.", "voice": "joe",
                                "response_format": "wav", "stream_format": "sse"}, timeout=60)
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events
                     if e["type"] == "speech.audio.delta")
    assert audio[:4] == b"RIFF" and len(audio) > 24000


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"voice": "joe"}, "bad_request"),
        ({"input": "x", "voice": "nobody"}, "unknown_voice"),
        ({"input": "x", "response_format": "ogg-vorbis"}, "unsupported_option"),
        ({"input": "x", "speed": 9}, "unsupported_option"),
        ({"input": "x" * 5000}, "text_too_long"),
        ({"input": "x", "instructions": "whisper"}, "unsupported_option"),
    ],
)
def test_bad_speech_requests_get_a_clear_4xx(server: ServerProcess, body: dict, code: str) -> None:
    response = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code


def test_metrics_expose_sessions_ttfa_and_engine_counters(server: ServerProcess) -> None:
    text = httpx.get(server.url + "/metrics").text
    for name in ("voxgate_sessions", "voxgate_ttfa_seconds_bucket",
                 "voxgate_audio_sent_seconds_total",
                 "voxgate_engine_queue_depth", "voxgate_engine_max_contexts",
                 "voxgate_errors_total"):
        assert name in text, name
