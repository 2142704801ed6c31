"""Deferred encoding: a deferred playout and session give their PCM out as jobs, each due when its
listener runs out of the audio before it, and pack the frames when they come back, exactly as they
would have inline; the queue runs jobs on the loop earliest due first, a slice at a time; the
worker runs a loop turn's jobs as one call on its own thread, in order."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from engine.types import AudioChunk
from gateway.audio.codecs import decode_opus_packets, make_encoder
from gateway.stream import encoding
from gateway.stream.actions import Encode, Send, Submit
from gateway.stream.encoding import THREAD_PREFIX, EncodeJob, EncodeQueue, EncodeWorker
from gateway.stream.events import AudioEvent, ContextDone
from gateway.stream.options import SessionOptions
from gateway.stream.playout import Playout
from gateway.stream.session import Session
from gateway.voices.catalog import VoiceCatalog

RATE = 24000


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * RATE)) / RATE
    tone = 0.2 * np.sin(2 * np.pi * 180 * t) + 0.02 * rng.standard_normal(len(t))
    return tone.astype(np.float32)


def messages_of(playout: Playout) -> list[tuple[int, float, float, tuple[bytes, ...]]]:
    return [(m.seq, m.pts_ms, m.duration_ms, m.payloads) for m in playout.release(0.0, 0.0)]


def test_a_deferred_playout_sends_what_an_inline_one_does_once_its_jobs_are_back() -> None:
    pieces = [speech(0.37, 1), speech(0.5, 2), speech(0.11, 3)]
    inline = Playout("c", make_encoder("opus", 48000, 20, None, RATE), is_realtime=False)
    deferred = Playout("c", make_encoder("opus", 48000, 20, None, RATE), is_realtime=False,
                       is_deferred=True)
    for pcm in pieces:
        inline.push(pcm)
        deferred.push(pcm)
    inline.finish()
    deferred.push(pieces[0][:0])  # nothing: still one job with the rest
    deferred.finish()
    assert deferred.pcm_ms_framed == pytest.approx(inline.pcm_ms_framed)  # counted at once
    assert deferred.release(0.0, 0.0) == [] and not deferred.is_empty  # nothing encoded yet
    job = deferred.take_job(0.0)
    assert job is not None and deferred.take_job(0.0) is None
    assert job.pcm_ms == pytest.approx(980.0)
    thread = threading.Thread(target=job.run)  # as the worker runs it
    thread.start()
    thread.join()
    assert not deferred.is_empty  # the job is not back until `complete`
    deferred.complete(job)
    expected = messages_of(inline)
    assert messages_of(deferred) == expected and deferred.is_empty
    packets = [p for _, _, _, payloads in expected for p in payloads]
    assert len(decode_opus_packets(packets, 48000)) >= 0.98 * 48000


def one_job(codec: str, seconds: float) -> tuple[Playout, EncodeJob]:
    playout = Playout("c", make_encoder(codec, 48000 if codec == "opus" else RATE, 20, None, RATE),
                      is_realtime=False, is_deferred=True)
    playout.push(speech(seconds))
    job = playout.take_job(0.0)
    assert job is not None
    return playout, job


def test_a_job_of_a_cleared_playout_is_dropped() -> None:
    playout, job = one_job("pcm16", 0.2)
    job.run()
    playout.clear()  # cancelled while the worker held the job
    playout.complete(job)
    assert playout.release(0.0, 0.0) == [] and playout.is_empty


def session_with_text(context_id: str = "c") -> tuple[Session, list[Any]]:
    session = Session("s1", catalog=VoiceCatalog({"joe"}), sample_rate=RATE,
                      options=SessionOptions(codec="opus"), defer_encode=True)
    session.start(0.0)
    actions = session.receive_frame(
        '{"type": "text", "context_id": "%s", "text": "Hello there.", "flush": true}' % context_id,
        0.0)
    return session, [a.request for a in actions if isinstance(a, Submit)]


def test_a_deferred_session_sends_audio_and_done_only_after_its_encodes_are_back() -> None:
    session, (request,) = session_with_text()
    actions = session.receive_audio(AudioChunk(request.request_id, speech(0.5), RATE, True), 0.1)
    encodes = [a for a in actions if isinstance(a, Encode)]
    assert len(encodes) == 1 and encodes[0].context_id == "c"
    events = [a.message for a in actions if isinstance(a, Send)]
    assert [e.type for e in events] == ["segment"]  # no audio, no done: the encode is out
    encodes[0].job.run()
    back = [a.message for a in session.receive_encoded("c", encodes[0].job, 0.2)
            if isinstance(a, Send)]
    audio = [e for e in back if isinstance(e, AudioEvent)]
    done = [e for e in back if isinstance(e, ContextDone)]
    assert audio and [m.seq for m in audio] == list(range(len(audio)))
    assert done and done[0].audio_ms == pytest.approx(sum(m.duration_ms for m in audio))
    assert back.index(done[0]) > back.index(audio[-1])


def test_an_encoder_fault_ends_its_context_with_internal_and_nothing_else() -> None:
    session, (request,) = session_with_text()
    actions = session.receive_audio(AudioChunk(request.request_id, speech(0.2), RATE, True), 0.1)
    (encode,) = [a for a in actions if isinstance(a, Encode)]
    encode.job.error = RuntimeError("the codec broke")
    back = [a.message.to_wire() for a in session.receive_encoded("c", encode.job, 0.2)
            if isinstance(a, Send)]
    assert [(e["type"], e.get("code")) for e in back] == [("error", "internal")]
    assert "codec broke" not in str(back)  # logged, never sent
    assert not session.has_context("c")
    assert session.receive_encoded("c", encode.job, 0.3) == []  # late: its context is gone


def test_the_worker_runs_a_loop_turns_jobs_as_one_call_on_its_thread_in_order() -> None:
    before = set(threading.enumerate())

    async def scenario() -> tuple[list[str], list[str], EncodeWorker]:
        worker = EncodeWorker()
        loop_thread = threading.current_thread().name
        ran_on: list[str] = []
        done: list[str] = []
        finished = asyncio.Event()

        class Recorded(EncodeJob):
            def run(self) -> None:
                ran_on.append(threading.current_thread().name)
                EncodeJob.run(self)

        encoder = make_encoder("pcm16", 24000, 20, None, RATE)
        for n in range(3):  # one turn of the loop: one batch
            job = Recorded(encoder, [speech(0.1, n)], 0, 100.0)

            def on_done(job: EncodeJob, name: str = f"j{n}") -> None:
                assert threading.current_thread().name == loop_thread and job.frames
                done.append(name)
                if len(done) == 3:
                    finished.set()

            worker.submit(job, on_done)
        await asyncio.wait_for(finished.wait(), 5)
        worker.close()
        return ran_on, done, worker

    ran_on, done, worker = asyncio.run(scenario())
    assert done == ["j0", "j1", "j2"]
    assert all(name.startswith(THREAD_PREFIX) for name in ran_on)
    assert (worker.num_batches, worker.num_jobs) == (1, 3)
    alive = [t.name for t in threading.enumerate()
             if t.name.startswith(THREAD_PREFIX) and t not in before]
    assert alive == []  # closed: its thread ended


def test_a_job_after_close_is_encoded_on_the_loop_as_before() -> None:
    async def scenario() -> list[EncodeJob]:
        worker = EncodeWorker()
        worker.close()
        got: list[EncodeJob] = []
        job = EncodeJob(make_encoder("pcm16", 24000, 20, None, RATE), [speech(0.1)], 0, 100.0)
        worker.submit(job, got.append)
        await asyncio.sleep(0.01)
        return got

    (job,) = asyncio.run(scenario())
    assert job.frames and job.error is None


def test_a_jobs_due_is_when_its_listener_runs_out_of_the_audio_before_it() -> None:
    playout = Playout("c", make_encoder("pcm16", 24000, 20, None, RATE), is_realtime=False,
                      is_deferred=True)
    playout.push(speech(0.6))
    first = playout.take_job(10.0, playback_end=10.5)  # the context before it plays until 10.5
    assert first is not None and first.due == pytest.approx(10.5)
    playout.push(speech(0.4))
    second = playout.take_job(10.1)  # not playing yet: its start is the earliest it could be
    assert second is not None and second.due == pytest.approx(10.7)
    first.run()
    playout.complete(first)
    playout.release(10.6, 0.0)  # its first message leaves: the playback clock starts at 10.6
    second.run()
    playout.complete(second)
    playout.push(speech(1.0))
    third = playout.take_job(10.8)
    assert third is not None and third.due == pytest.approx(10.6 + 1.0)  # after 1 s of audio
    third.run()
    playout.complete(third)
    playout.push(speech(0.1))
    early = playout.take_job(9.0)  # a clock read early never puts a job before the last
    assert early is not None and early.due >= third.due
    early.run()
    playout.complete(early)
    playout.release(13.0, 0.0)  # the listener ran dry at 11.2 and resumes with these at 13.0
    playout.push(speech(0.1))
    late = playout.take_job(13.0)
    assert late is not None  # due when the resumed listener runs out, not at 10.6 + 2.1 s
    assert late.due == pytest.approx(13.0 + 1.5, abs=0.021)  # one frame: the encoder holds it


def run_queue(dues: list[tuple[str, float]]) -> list[str]:
    """The order an `EncodeQueue` runs jobs due `dues` (s from now) in, submitted in order."""
    async def scenario() -> list[str]:
        queue = EncodeQueue()
        loop_thread = threading.current_thread().name
        now = asyncio.get_running_loop().time()  # the monotonic clock, as the session's
        order: list[str] = []
        for name, due_in_s in dues:
            job = EncodeJob(make_encoder("pcm16", 24000, 20, None, RATE), [speech(0.1)], 0,
                            100.0, now + due_in_s)

            def on_done(job: EncodeJob, name: str = name) -> None:
                assert threading.current_thread().name == loop_thread and job.frames
                order.append(name)

            queue.submit(job, on_done)
        assert order == [] and len(queue) == len(dues)  # nothing runs inside submit
        await asyncio.sleep(0.05)
        assert len(queue) == 0 and queue.num_jobs == len(dues)
        return order

    return asyncio.run(scenario())


def test_the_queue_runs_audio_needed_now_before_audio_needed_later() -> None:
    order = run_queue([("ahead-2", 3.0), ("ahead-1", 2.0), ("first-audio", 0.0),
                       ("ahead-1b", 2.0)])
    assert order == ["first-audio", "ahead-1", "ahead-1b", "ahead-2"]


def test_audio_all_due_now_runs_in_arrival_order() -> None:
    # past its core, the loop serves the turns already playing as they came: a new turn's
    # first audio does not jump ahead of a playing turn's next chunk
    order = run_queue([("playing-next", 0.1), ("first-audio", -0.5), ("playing-late", -1.0),
                       ("ahead", 2.0)])
    assert order == ["playing-next", "first-audio", "playing-late", "ahead"]


def test_the_queue_gives_the_loop_back_between_slices_of_audio_not_needed_yet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoding, "SLICE_S", 0.0)  # one job a slice, unless it is urgent

    async def scenario(due_in_s: float) -> list[str]:
        queue = EncodeQueue()
        seen: list[str] = []
        now = asyncio.get_running_loop().time()  # the monotonic clock, as the session's
        for n in range(3):
            job = EncodeJob(make_encoder("pcm16", 24000, 20, None, RATE), [speech(0.1)], 0,
                            100.0, now + due_in_s + 0.1 * n)
            queue.submit(job, lambda job, n=n: seen.append(f"job{n}"))
        asyncio.get_running_loop().call_soon(lambda: seen.append("socket read"))
        await asyncio.sleep(0.05)
        return seen

    later = asyncio.run(scenario(due_in_s=5.0))
    assert later.index("socket read") < later.index("job2")  # other callbacks ran in between
    assert [s for s in later if s.startswith("job")] == ["job0", "job1", "job2"]
    urgent = asyncio.run(scenario(due_in_s=-1.0))  # overdue: encoded before anything else
    assert urgent == ["job0", "job1", "job2", "socket read"]


def test_a_job_cancelled_while_it_waits_is_not_encoded() -> None:
    playout, job = one_job("opus", 0.5)
    playout.clear()  # the listener barged in before the queue reached it
    assert job.is_dropped
    job.run()
    assert job.frames == [] and job.error is None
    playout.complete(job)
    assert playout.release(0.0, 0.0) == [] and playout.is_empty
