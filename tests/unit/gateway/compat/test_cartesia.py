"""The Cartesia adapter against Cartesia's documented shapes, driven sans-I/O: frames in, actions
out.

The shapes come from Cartesia's docs ("Context Flushing and Flush IDs",
"Concurrency and WebSocket Limits") and the response models of its Python SDK
(generated from its API spec): `flush_done` is {type, context_id, flush_id,
flush_done, done, status_code}; a chunk's `flush_id` counts the context's
flushes from 1; its `step_time` is the server's processing time for the chunk
in ms. The engine's chunks are made here, with the step time the engine would
have measured.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from engine.types import AudioChunk, WordTiming
from gateway.compat.cartesia import CartesiaSession
from gateway.compat.formats import OutputFormat
from gateway.stream.actions import Action, Close, SendFrame, Submit
from gateway.stream.options import Limits, SessionOptions
from gateway.voices.catalog import VoiceCatalog

RATE = 22050
FORMAT = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


def _session() -> CartesiaSession:
    session = CartesiaSession("s1", catalog=VoiceCatalog({"joe"}), sample_rate=RATE,
                              options=SessionOptions(voice="joe"), limits=Limits(),
                              output=OutputFormat("pcm_s16le", 24000), admit=lambda key: None,
                              release=lambda key: None)
    session.start(0.0)
    return session


def _send(session: CartesiaSession, now: float = 0.0, **fields: Any) -> list[Action]:
    message = {"context_id": "c", "voice": {"mode": "id", "id": "joe"}, "output_format": FORMAT,
               "continue": True, **fields}
    return session.receive_frame(json.dumps(message), now)


def _frames(actions: list[Action]) -> list[dict[str, Any]]:
    return [json.loads(a.frame) for a in actions if isinstance(a, SendFrame)
            and isinstance(a.frame, str)]


def _submits(actions: list[Action]) -> list[Submit]:
    return [a for a in actions if isinstance(a, Submit)]


def _chunk(submit: Submit, seconds: float, *, step_ms: float, is_last: bool = True) -> AudioChunk:
    pcm = (np.sin(np.arange(int(RATE * seconds)) / 5.0) * 0.3).astype(np.float32)
    tokens = submit.request.text.split()
    words = [WordTiming(t, i * 1000.0 * seconds / len(tokens),
                        (i + 1) * 1000.0 * seconds / len(tokens))
             for i, t in enumerate(tokens)] if is_last else None
    return AudioChunk(submit.request.request_id, pcm, RATE, is_last=is_last, words=words,
                      step_ms=step_ms)


def test_a_flush_speaks_its_text_and_flush_done_follows_its_last_chunk_in_cartesias_shape() -> None:
    session = _session()
    assert _submits(_send(session, transcript="The first part is here. ")) == []  # buffered
    (first,) = _submits(_send(session, transcript="", flush=True))  # forced out at once
    assert first.request.text == "The first part is here."
    frames = _frames(session.receive_audio(_chunk(first, 0.5, step_ms=30.0), 0.1))
    chunks = [f for f in frames if f["type"] == "chunk"]
    assert chunks and all(f["flush_id"] == 1 for f in chunks)
    assert frames[-1] == {"type": "flush_done", "context_id": "c", "status_code": 206,
                          "done": False, "flush_done": True, "flush_id": 1}
    # the context goes on: the next input is group 2, and its end is `done`, not another flush_done
    (second,) = _submits(_send(session, 0.2, transcript="Then a second part. ",
                               **{"continue": False}))
    frames = _frames(session.receive_audio(_chunk(second, 0.4, step_ms=20.0), 0.3))
    assert {f["flush_id"] for f in frames if f["type"] == "chunk"} == {2}
    assert [f["type"] for f in frames if f["type"] != "chunk"] == ["done"]


def test_flush_done_waits_for_the_audio_and_flushes_are_answered_in_order() -> None:
    session = _session()
    (first,) = _submits(_send(session, transcript="Group one speaks. ", flush=True))
    # a flush with nothing buffered is done at once, but not before group 1, still speaking
    frames = _frames(_send(session, transcript="", flush=True))
    assert [f for f in frames if f["type"] == "flush_done"] == []
    frames = _frames(session.receive_audio(_chunk(first, 0.3, step_ms=10.0), 0.1))
    assert [f["flush_id"] for f in frames if f["type"] == "flush_done"] == [1, 2]
    last_chunk = max(i for i, f in enumerate(frames) if f["type"] == "chunk")
    assert min(i for i, f in enumerate(frames) if f["type"] == "flush_done") > last_chunk


def test_a_cancelled_context_gets_no_flush_done() -> None:
    session = _session()
    (first,) = _submits(_send(session, transcript="Never heard. ", flush=True))
    actions = session.receive_frame(json.dumps({"context_id": "c", "cancel": True}), 0.1)
    actions += session.receive_audio(_chunk(first, 0.3, step_ms=10.0), 0.2)
    assert _frames(actions) == []


def test_step_time_is_the_engine_time_behind_each_chunks_audio_and_adds_up_to_it() -> None:
    session = _session()
    text = "The first sentence is short. The second sentence is here. "
    actions = _send(session, transcript=text, flush=True, **{"continue": False})
    one, two = _submits(actions)
    # the engine took 30 ms for the first 0.5 s and 90 ms for the next: 60 and 180 ms a second
    frames = _frames(session.receive_audio(_chunk(one, 0.5, step_ms=30.0), 0.1))
    frames += _frames(session.receive_audio(_chunk(two, 0.5, step_ms=90.0), 0.2))
    chunks = [f for f in frames if f["type"] == "chunk"]
    assert frames[-1]["type"] == "done"
    assert abs(sum(f["step_time"] for f in chunks) - 120.0) < 0.05
    # each chunk's share follows the audio it carries (PCM16 at 24 kHz: 2 bytes a sample)
    per_s = [f["step_time"] / (len(_pcm(f)) / 2 / 24000) for f in chunks if len(_pcm(f))]
    assert abs(per_s[0] - 60.0) < 1.0 and abs(per_s[-2] - 180.0) < 1.0
    assert all(59.0 < r < 181.0 for r in per_s[:-1])  # the last is padding past the audio


def test_an_idle_cartesia_socket_gets_a_plain_close_and_no_message() -> None:
    session = _session()
    assert session.idle_close(300.0) == [Close(1000, "idle for 300 s")]


def test_the_engine_time_ledger_lets_go_of_a_context_once_it_is_over() -> None:
    session = _session()
    for n in range(3):
        actions = session.receive_frame(json.dumps({
            "context_id": f"c{n}", "voice": {"mode": "id", "id": "joe"}, "output_format": FORMAT,
            "transcript": "A whole turn of speech. ", "continue": False}), float(n))
        (submit,) = _submits(actions)
        assert _frames(session.receive_audio(_chunk(submit, 0.2, step_ms=5.0),
                                             n + 0.5))[-1]["type"] == "done"
    assert session._engine_time is not None and len(session._engine_time) == 0


def _pcm(frame: dict[str, Any]) -> bytes:
    import base64

    return base64.b64decode(frame["data"])
