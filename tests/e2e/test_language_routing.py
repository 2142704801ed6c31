"""Routing by language on a real server: skipped text, a second voice, barge-in, the vendor wire.

docs/voices.md, "Languages"; docs/protocol.md, `text.skipped`. Two servers:
the shared one (joe alone, English only) and one with a Mandarin voice (joe's
model phonemizing with espeak's `cmn`, tests/support/voices.py) mapped with
`--voice-for zh=...`. Audio is real Opus, decoded.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets

from gateway.audio.codecs import decode_opus_packets
from loadtest.__main__ import main as loadtest_main
from tests.support.server import ServerProcess, start_server
from tests.support.voices import install_mandarin_voice
from tests.support.wait import wait_until
from tests.support.wsclient import Client

CHINESE = "今天天气很好。"
MIXED = f"Hello there, my good friend. {CHINESE} See you tomorrow at the station."


@pytest.fixture(scope="module")
def mandarin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("mandarin")
    proc = start_server(tmp, "--voice-for", f"zh={install_mandarin_voice(tmp / 'data')}")
    yield proc
    proc.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


async def turn(url: str, text: str, context_id: str = "c", **update: Any) -> Client:
    """One context of `text`, flushed, read to its `context.done`."""
    client = await Client.connect(url)
    if update:
        await client.send({"type": "session.update", **update})
        await client.until("session.updated")
    await client.send({"type": "text", "context_id": context_id, "text": text, "flush": True})
    await client.until("context.done", context_id)
    await client.close()
    return client


def in_order(client: Client, context_id: str = "c") -> list[tuple[str, Any]]:
    return [(e["type"], e.get("segment_id")) for e in client.received.events
            if e.get("context_id") == context_id and e["type"] != "cancelled"]


def assert_contiguous(client: Client, context_id: str = "c") -> np.ndarray:
    """seq without gaps, pts_ms growing by duration_ms, segments tiling it; the decoded audio."""
    frames = client.received.audio_of(context_id)
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    for before, after in itertools.pairwise(frames):
        assert after["pts_ms"] == pytest.approx(before["pts_ms"] + before["duration_ms"], abs=1e-3)
    segments = client.received.of("segment", context_id)
    for before, after in itertools.pairwise(segments):
        assert after["pts_ms"] == pytest.approx(before["pts_ms"] + before["duration_ms"], abs=1.0)
    audio = decode_opus_packets([p for f in frames for p in f["packets"]], 48000)
    done = client.received.of("context.done", context_id)[0]
    assert len(audio) / 48 == pytest.approx(done["audio_ms"], abs=40.0)
    assert float(np.sqrt(np.mean(audio ** 2))) > 0.01  # speech, not silence
    return audio


def skipped_metric(server: ServerProcess, language: str) -> float:
    line = f'voxgate_text_skipped_characters_total{{language="{language}"}} '
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return next((float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_voices_list_the_languages_they_speak(mandarin: ServerProcess) -> None:
    voices = httpx.get(mandarin.url + "/v1/voices", timeout=10).json()["voices"]
    assert {v["id"]: v["languages"] for v in voices} == {"joe": ["en"], "zh_CN-joe-cmn": ["zh"]}


def test_a_chinese_sentence_with_no_voice_for_it_is_skipped_and_the_english_around_it_speaks(
        server: ServerProcess) -> None:
    before = skipped_metric(server, "zh")
    client = run(turn(server.ws_url, MIXED))
    assert in_order(client) == [("segment", 0), ("text.skipped", 1), ("segment", 2),
                                ("context.done", None)]
    (skipped,) = client.received.of("text.skipped", "c")
    assert (skipped["text"], skipped["language"], skipped["reason"], skipped["offset"]) == (
        CHINESE, "zh", "language_unsupported", None)
    assert [s["text"] for s in client.received.of("segment", "c")] == [
        "Hello there, my good friend.", "See you tomorrow at the station."]
    assert client.received.of("context.done", "c")[0]["segments"] == 2
    audio = assert_contiguous(client)
    # no audio for the Chinese: joe spells it out as 4.5 s of "Chinese letter"
    words = sum(s["duration_ms"] for s in client.received.of("segment", "c"))
    assert len(audio) / 48 == pytest.approx(words, abs=80.0)
    assert skipped_metric(server, "zh") == before + len(CHINESE)


def test_with_a_mandarin_voice_mapped_both_speak_in_order_with_contiguous_audio(
        mandarin: ServerProcess) -> None:
    client = run(turn(mandarin.ws_url, MIXED))
    assert in_order(client) == [("segment", 0), ("segment", 1), ("segment", 2),
                                ("context.done", None)]
    segments = client.received.of("segment", "c")
    assert [s["text"] for s in segments] == ["Hello there, my good friend.", CHINESE,
                                             "See you tomorrow at the station."]
    assert client.received.of("text.skipped", "c") == []
    # the Mandarin voice said it in 1.8 s: joe would have spelled it out for 4.5 s
    assert 800 < segments[1]["duration_ms"] < 3000
    assert_contiguous(client)


def test_a_session_can_unmap_the_servers_chinese_voice(mandarin: ServerProcess) -> None:
    client = run(turn(mandarin.ws_url, MIXED, voice_for={"zh": None}))
    assert [e["text"] for e in client.received.of("text.skipped", "c")] == [CHINESE]


def test_a_cyrillic_segment_is_skipped_as_undetermined_cyrillic(server: ServerProcess) -> None:
    client = run(turn(server.ws_url, "Привет, как дела? I am fine, thank you very much."))
    assert in_order(client) == [("text.skipped", 0), ("segment", 1), ("context.done", None)]
    (skipped,) = client.received.of("text.skipped", "c")
    assert (skipped["text"], skipped["language"]) == ("Привет, как дела?", "und-Cyrl")
    assert_contiguous(client)


def test_an_english_sentence_holding_a_chinese_name_stays_english_and_skips_the_name(
        mandarin: ServerProcess) -> None:
    client = run(turn(mandarin.ws_url, "Yesterday I met 王小明 at the station near the river."))
    assert in_order(client) == [("segment", 0), ("text.skipped", 0), ("context.done", None)]
    (segment,) = client.received.of("segment", "c")
    (skipped,) = client.received.of("text.skipped", "c")
    assert segment["text"] == "Yesterday I met at the station near the river."
    assert [w["word"] for w in segment["words"]] == segment["text"].split()  # joe's own timings
    assert (skipped["text"], skipped["language"], skipped["offset"]) == ("王小明", "zh", 15)
    assert segment["text"][:skipped["offset"]] == "Yesterday I met"
    assert_contiguous(client)


def test_at_barge_in_skipped_text_is_in_unspoken_text(server: ServerProcess) -> None:
    text = (f"I met 王小明 at the station near the old river bridge today. {CHINESE} "
            "Then we walked home together along the water, slowly, talking about the weather.")

    async def scenario() -> Client:
        client = await Client.connect(server.ws_url + "?pacing=realtime")
        await client.send({"type": "text", "context_id": "c", "text": text, "flush": True})
        await client.until("segment", "c")
        await client.send({"type": "cancel", "context_id": "c", "played_ms": 300})
        await client.until("cancelled", "c")
        await client.close()
        return client

    client = run(scenario())
    (cancelled,) = client.received.of("cancelled", "c")
    assert "王小明" not in cancelled["spoken_text"] and CHINESE not in cancelled["spoken_text"]
    assert "王小明" in cancelled["unspoken_text"] and CHINESE in cancelled["unspoken_text"]
    heard = cancelled["spoken_text"].split() + cancelled["unspoken_text"].split()
    assert "".join(heard) == "".join(text.split())


def test_a_vendor_socket_skips_silently_logs_no_text_and_counts_it(server: ServerProcess) -> None:
    before = skipped_metric(server, "und-Cyrl")

    async def scenario() -> list[dict[str, Any]]:
        url = f"ws://127.0.0.1:{server.port}/v1/text-to-speech/joe/stream-input?output_format=pcm_16000"
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps({"text": " "}))
            await ws.send(json.dumps({"text": "Hello there, my friend. Привет, как дела? Goodbye "
                                              "now. "}))
            await ws.send(json.dumps({"text": ""}))
            out: list[dict[str, Any]] = []
            while not (out and out[-1].get("isFinal")):
                out.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return out

    messages = run(scenario())
    assert not [m for m in messages if "error" in m]
    assert b"".join(base64.b64decode(m["audio"]) for m in messages if m.get("audio"))
    chars = "".join(c for m in messages if m.get("alignment") for c in m["alignment"]["chars"])
    assert "Hello" in chars and "Goodbye" in chars and "Привет" not in chars
    assert skipped_metric(server, "und-Cyrl") == before + len("Привет, как дела?")
    line = wait_until(lambda: next((x for x in server.log().splitlines()
                                    if "skipped 17 characters of und-Cyrl" in x), None),
                      timeout=10, message="the vendor socket logs the skip")
    assert "elevenlabs" in line
    assert "Привет" not in server.log()


def test_the_bundled_corpus_reports_skipped_text_and_no_han_reaches_joe(
        server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "corpus.json"
    # listeners that barge in at once keep English turns short; Chinese ones have no audio
    code = loadtest_main(["run", "--url", server.url, "--sessions", "3", "--duration", "12",
                          "--drain", "20", "--think", "0", "--token-rate", "2000",
                          "--barge-in-rate", "1", "--barge-in-at", "0.01-0.02", "--seed", "3",
                          "--json", str(out), "--turns", "--quiet"])
    assert code == 0
    result = json.loads(out.read_text())["targets"]["voxgate"]["result"]
    text = result["summary"]["text"]
    assert text["skipped_chars_by_language"].get("zh", 0) > 0
    assert text["spoken_letters_by_script"].get("Latn", 0) > 0
    assert "Hani" not in text["spoken_letters_by_script"]
    zh_turns = [t for t in result["turns"] if "zh" in t["skipped_chars"]]
    assert zh_turns and all(not t["spoken_letters"] and t["num_frames"] == 0 for t in zh_turns)


def test_the_speech_endpoint_routes_and_skips_the_same_way(server: ServerProcess,
                                                           mandarin: ServerProcess) -> None:
    def speak(target: ServerProcess, text: str) -> httpx.Response:
        return httpx.post(target.url + "/v1/audio/speech", timeout=60,
                          json={"model": "tts-1", "input": text, "voice": "joe",
                                "response_format": "pcm"})

    only_chinese = speak(server, CHINESE)
    assert only_chinese.status_code == 400 and "nothing voice 'joe' can say" in only_chinese.text
    before = skipped_metric(server, "zh")
    english = np.frombuffer(speak(server, MIXED).content, dtype="<i2")
    assert skipped_metric(server, "zh") == before + len(CHINESE)
    both = np.frombuffer(speak(mandarin, MIXED).content, dtype="<i2")
    # the Mandarin voice's 1-3 s more (joe alone would have spelled it out, 4.5 s)
    assert 0.8 < (len(both) - len(english)) / 24000 < 3.0
