"""Piper in decoder windows (windows.py): equal to the whole decode, click-free joins, paces,
cancel.

Each step is handed the plan the engine would give it (`StepPlan`): what runs beside
the segment is the engine's to say, and these tests say it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import numpy as np
import pytest

from engine.backend import BackendRequest, StepPlan, StepResult
from engine.backends.piper import windows as piper_windows
from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.backends.piper.graphs import split as piper_split
from engine.engine import Engine, EngineConfig
from engine.types import RequestId, SamplingParams, SynthesisRequest, WordTiming
from tests.support.wait import async_wait_until

LONG = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the woods, "
        "where nobody can find it until the morning comes again.")
SHORT = "Yes, okay."


def request(text: str, voice: str = "joe", speed: float = 1.0,
            context: str = "") -> SynthesisRequest:
    # VITS samples otherwise
    params = SamplingParams(speed=speed, noise_scale=0.0, noise_w_scale=0.0)
    return SynthesisRequest(RequestId(text[:8]), text, voice, context_key=context,
                            params=params)


@pytest.fixture(scope="module")
def backends() -> dict[str, PiperBackend]:
    made = {}
    for name, config in {
        "whole": PiperBackendConfig(num_threads=1, windowed=False),
        "windows": PiperBackendConfig(num_threads=1),
        "full_context": PiperBackendConfig(num_threads=1, window_context_frames=100_000),
    }.items():
        made[name] = PiperBackend(config)
        made[name].load()
    return made


# What the engine's plan says runs beside a segment's steps (`StepPlan`; its due is set per step).
ONE_SESSION = StepPlan(0.0, is_lone=True)  # the only talking session, its steps alone
TWO_SESSIONS = StepPlan(0.0)  # another session talks too; its steps alone
BESIDE_LOOK_AHEAD = StepPlan(0.0, is_alone=False)  # another lane's step runs look-ahead work
# another lane's step is due soon
BESIDE_WORK_DUE = StepPlan(0.0, is_alone=False, is_contended=True)


def stream(backend: PiperBackend, req: SynthesisRequest, due_in: float = 0.0,
           later_due_in: float | None = None, beside: StepPlan = ONE_SESSION,
           ) -> tuple[list[StepResult], list[WordTiming] | None]:
    """Every piece of one segment, each step's next audio due `due_in` s from then (0: urgent).

    With `later_due_in`, the pieces after the first are due that far ahead instead.
    `beside`: what the engine's plan says of the rest of the box at every step.
    """
    item = backend.prepare(req)
    results: list[StepResult] = []
    words = None
    while not (results and results[-1].is_finished):
        lead = due_in if not results or later_due_in is None else later_due_in
        item.due = time.monotonic() + lead  # what the engine's playback clock would set
        item.plan = dataclasses.replace(beside, due=item.due)  # and its plan for the step
        (result,) = backend.step([item])
        assert result.error is None
        results.append(result)
        words = words or result.words
    backend.release(item)  # as the engine does with a finished request
    return results, words


@pytest.mark.parametrize("text", [LONG, SHORT])
def test_windowed_decode_equals_the_whole_decode_for_every_bundled_voice(
        backends: dict[str, PiperBackend], text: str) -> None:
    for voice in backends["whole"].voices():
        (whole,), whole_words = stream(backends["whole"], request(text, voice.voice_id))
        windows, words = stream(backends["windows"], request(text, voice.voice_id))
        pcm = np.concatenate([w.pcm for w in windows])
        assert len(pcm) == len(whole.pcm)
        assert np.abs(pcm - whole.pcm).max() < 1e-3
        assert words == whole_words, "word timings changed"
        if text is LONG:
            assert len(windows) >= 3, "a long segment came in one piece"
            assert windows[0].words is not None and all(w.words is None for w in windows[1:])
            assert len(windows[0].pcm) < len(windows[1].pcm), \
                "the first window is not the small one"


def test_windows_with_full_context_equal_the_whole_decode_exactly(
        backends: dict[str, PiperBackend]) -> None:
    (whole,), _ = stream(backends["whole"], request(LONG))
    windows, _ = stream(backends["full_context"], request(LONG))
    assert len(windows) >= 3
    assert np.array_equal(np.concatenate([w.pcm for w in windows]), whole.pcm)


def test_window_joins_are_click_free(backends: dict[str, PiperBackend]) -> None:
    (whole,), _ = stream(backends["whole"], request(LONG))
    windows, _ = stream(backends["windows"], request(LONG))
    pcm = np.concatenate([w.pcm for w in windows])
    joins = np.cumsum([len(w.pcm) for w in windows])[:-1]
    steps = np.abs(np.diff(pcm))  # [N - 1] sample-to-sample differences
    whole_steps = np.abs(np.diff(whole.pcm))
    typical = np.percentile(whole_steps, 99.9)
    for join in joins:
        # The step across the join is the whole decode's step there, and no louder than speech is.
        assert abs(steps[join - 1] - whole_steps[join - 1]) < 1e-3
        assert steps[join - 1] <= typical + 1e-3


def test_speed_and_loudness_are_the_whole_decodes(backends: dict[str, PiperBackend]) -> None:
    (whole,), _ = stream(backends["whole"], request(LONG, speed=1.5))
    windows, _ = stream(backends["windows"], request(LONG, speed=1.5))
    pcm = np.concatenate([w.pcm for w in windows])
    assert len(pcm) == len(whole.pcm)
    assert np.abs(pcm).max() == pytest.approx(np.abs(whole.pcm).max(), abs=1e-3)
    assert backends["windows"].get_voice("joe").gain == backends["whole"].get_voice("joe").gain


def test_a_cancel_stops_a_segment_within_one_window() -> None:
    async def scenario() -> tuple[list[list[str]], int]:
        piper = PiperBackend(PiperBackendConfig(num_threads=1))
        steps: list[list[str]] = []
        step = piper.step

        def counting_step(batch: list[BackendRequest]) -> list[StepResult]:
            steps.append([str(item.request_id) for item in batch])
            return step(batch)

        released: list[str] = []
        release = piper.release

        def counting_release(item: BackendRequest) -> None:
            released.append(str(item.request_id))
            release(item)

        piper.step = counting_step  # type: ignore[method-assign]
        piper.release = counting_release  # type: ignore[method-assign]
        engine = Engine(piper, EngineConfig(warmup_text=""))
        await engine.start()
        got = 0
        async for _chunk in engine.submit(SynthesisRequest(RequestId("long"), LONG * 3, "joe")):
            got += 1
            if got == 1:
                engine.cancel(RequestId("long"))
                at_cancel = len(steps)
        # Released: the engine never steps it again, so the steps counted are all there are.
        await async_wait_until(lambda: "long" in released, timeout=10.0, message="never released")
        await engine.stop()
        return steps, at_cancel

    steps, at_cancel = asyncio.run(asyncio.wait_for(scenario(), 120))
    after = [batch for batch in steps[at_cancel:] if "long" in batch]
    assert len(after) <= 1, "the segment kept being decoded after its cancel"


def test_the_flow_on_a_slice_with_its_context_equals_the_whole_flow(
        backends: dict[str, PiperBackend]) -> None:
    voice = backends["windows"].get_voice("joe")
    assert voice.has_flow, "the joe voice's flow was not cut out"
    item = backends["windows"].prepare(request(LONG))
    state = item.state
    backends["windows"].release(item)  # only its ids are read here
    scales = np.array(state.scales, dtype=np.float32)
    outputs, durations = voice.run_front(np.array([state.ids]), np.array([len(state.ids)]), scales,
                                         None)
    total = int(np.rint(durations).sum())
    whole = voice.run_flow(voice.flow_feeds(outputs, None))  # [1, C, T]
    context = PiperBackendConfig().window_flow_context_frames
    for needed in (24, 40, 100):
        part = voice.run_flow(piper_windows.flow_slice(outputs, 0, needed + context, total))
        # float rounding only
        assert np.abs(part[:, :, :needed] - whole[:, :, :needed]).max() < 1e-4
    rest = voice.run_flow(piper_windows.flow_slice(outputs, 40 - context, total, total))
    assert np.abs(rest[:, :, context:] - whole[:, :, 40:total]).max() < 1e-4


def count_flow_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Frames of each flow call (a counting wrapper around the real run_flow)."""
    from engine.backends.piper.loader import LoadedVoice

    frames: list[int] = []
    run_flow = LoadedVoice.run_flow

    def counting(self: LoadedVoice, feeds: dict[str, np.ndarray], **kwargs: bool) -> np.ndarray:
        latent = run_flow(self, feeds, **kwargs)
        frames.append(latent.shape[2])
        return latent

    monkeypatch.setattr(LoadedVoice, "run_flow", counting)
    return frames


@pytest.mark.parametrize("talking", ["alone", "beside another session"])
def test_an_urgent_segment_streams_a_flow_slice_and_small_first_windows(
        backends: dict[str, PiperBackend], monkeypatch: pytest.MonkeyPatch, talking: str) -> None:
    # One talking session gets the smaller first window (nobody else's work can delay its
    # second); beside another talking session the small one.
    piper = backends["windows"]
    frames = count_flow_calls(monkeypatch)
    plan = PiperBackendConfig().window_plan
    first = plan.lone_first_frames if talking == "alone" else plan.first_frames
    assert plan.lone_first_frames < plan.first_frames
    beside = ONE_SESSION if talking == "alone" else TWO_SESSIONS
    windows, _ = stream(piper, request(LONG, context="s1"), beside=beside)  # each piece due now
    hop = piper.get_voice("joe").config.hop_length
    assert len(windows[0].pcm) == first * hop
    assert len(windows[1].pcm) == plan.second_frames * hop
    # The first slice runs on the short context and is not kept: the second, due within
    # the first window's playback, runs only its own flow, from frame 0 as it would anyway.
    assert plan.is_first_slice_provisional(first + plan.context_frames)
    assert frames[0] == first + plan.context_frames + plan.first_flow_context_frames
    assert frames[1] == first + plan.second_frames + plan.context_frames + plan.flow_context_frames
    longest = plan.flow_frames + plan.flow_frames // 2 + 2 * plan.flow_context_frames
    assert len(frames) >= 2 and max(frames[1:]) <= longest, frames
    (whole,), _ = stream(backends["whole"], request(LONG))
    assert np.abs(np.concatenate([w.pcm for w in windows]) - whole.pcm).max() < 1e-3


@pytest.mark.parametrize("talking", ["alone", "beside another session"])
def test_only_the_one_talking_sessions_front_part_spins(
        backends: dict[str, PiperBackend], talking: str) -> None:
    # Spinning threads would take the core of another lane's step: only the one talking
    # session's front part runs the spinning session on every core, any other the
    # one-thread session (spied on: a counting wrapper around each real session).
    piper = backends["windows"]
    voice = piper.get_voice("joe")
    if voice.lone_session is None:
        pytest.skip("one core: no session runs on every core")  # CI and this box have two
    assert voice.solo_session is None, "a split voice keeps no non-spinning front on every core"
    calls: list[str] = []

    class Spy:
        def __init__(self, name: str, session: object) -> None:
            self.name, self.session = name, session

        def run(self, *args: object) -> object:
            calls.append(self.name)
            return self.session.run(*args)  # type: ignore[attr-defined]

    sessions = {name: getattr(voice, name) for name in ("session", "lone_session")}
    try:
        for name, session in sessions.items():
            setattr(voice, name, Spy(name, session))
        beside = ONE_SESSION if talking == "alone" else TWO_SESSIONS
        windows, _ = stream(piper, request(LONG, context="s1"), beside=beside)
    finally:
        for name, session in sessions.items():
            setattr(voice, name, session)
    assert len(windows) > 2
    assert calls == ["lone_session" if talking == "alone" else "session"]


def test_the_engine_releases_every_prepared_segment_finished_or_cancelled() -> None:
    # Who talks is the engine's count of prepared, unreleased segments: a leak would
    # leave one session never alone again, and its segments' state held.
    async def scenario() -> tuple[list[str], list[str], bool]:
        piper = PiperBackend(PiperBackendConfig(num_threads=1))
        prepared: list[str] = []
        released: list[str] = []
        prepare, release = piper.prepare, piper.release

        def counting_prepare(req: SynthesisRequest) -> BackendRequest:
            prepared.append(str(req.request_id))
            return prepare(req)

        def counting_release(item: BackendRequest) -> None:
            released.append(str(item.request_id))
            release(item)

        piper.prepare = counting_prepare  # type: ignore[method-assign]
        piper.release = counting_release  # type: ignore[method-assign]
        engine = Engine(piper, EngineConfig(warmup_text=""))
        await engine.start()
        done = [chunk async for chunk in engine.submit(SynthesisRequest(
            RequestId("a"), SHORT, "joe", context_key="s1"))]
        assert done and done[-1].is_last
        async for _chunk in engine.submit(SynthesisRequest(
                RequestId("b"), LONG * 2, "joe", context_key="s2")):
            engine.cancel(RequestId("b"))
        await async_wait_until(lambda: "b" in released, timeout=10.0,
                               message="b was never released")
        # nothing is held: a third session's segment is planned as the only one talking
        item = BackendRequest(SynthesisRequest(RequestId("c"), SHORT, "joe", context_key="s3"))
        engine.loop.plan([item], {})
        await engine.stop()
        assert item.plan is not None
        return prepared, released, item.plan.is_lone

    prepared, released, is_lone = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert sorted(prepared) == sorted(released) == ["a", "b"]
    assert is_lone


def test_a_segments_length_is_exact_once_its_first_window_ran(
        backends: dict[str, PiperBackend]) -> None:
    # The next segment of the context is due when this one's audio ends: the engine reads
    # the backend's estimate after every step, and from the first window on it is exact.
    piper = backends["windows"]
    item = piper.prepare(request(LONG))
    estimates, made = [], 0
    while True:
        item.due = time.monotonic()
        (result,) = piper.step([item])
        assert result.error is None
        made += len(result.pcm)
        estimates.append(item.est_audio_s)
        if result.is_finished:
            break
    piper.release(item)
    assert len(estimates) > 2
    assert estimates == [pytest.approx(made / piper.sample_rate, abs=1e-9)] * len(estimates)


def test_the_engine_predicts_the_next_segment_from_the_backends_exact_length() -> None:
    async def scenario() -> tuple[float, float, float]:
        piper = PiperBackend(PiperBackendConfig(num_threads=1))
        engine = Engine(piper, EngineConfig(warmup_text=""))
        await engine.start()
        now = time.monotonic()
        first = engine.submit(SynthesisRequest(RequestId("a"), LONG, "joe", context_key="s1"))
        # The second plays after the first in their context: due when the first's audio ends.
        second = engine.submit(SynthesisRequest(RequestId("b"), SHORT, "joe", context_key="s1"))
        handles = engine.requests.handles
        est_at_first_chunk = made = 0.0
        async for chunk in first:
            if not est_at_first_chunk:
                est_at_first_chunk = handles[RequestId("a")].est_s
                start_of_second = handles[RequestId("b")].start()
            made += chunk.duration_ms / 1000.0
        async for _chunk in second:
            pass
        await engine.stop()
        return est_at_first_chunk, made, start_of_second - now

    est, made, second_starts_in = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert est == pytest.approx(made, abs=2e-3)  # chunk durations are whole milliseconds
    assert second_starts_in > 0.8 * made  # when the first's audio runs out, not at once


@pytest.mark.parametrize("beside", ["work due soon", "look-ahead work"])
def test_an_urgent_segment_beside_work_due_soon_takes_one_medium_first_window(
        backends: dict[str, PiperBackend], monkeypatch: pytest.MonkeyPatch, beside: str) -> None:
    # Under load small windows cost every stream (context decoded twice, a step each):
    # only a step that runs alone, or beside look-ahead work that can wait, gets them.
    # Beside work due soon a new turn gets one medium first window, then long ones.
    # Here another lane's step runs throughout.
    piper = backends["windows"]
    frames = count_flow_calls(monkeypatch)
    step = BESIDE_WORK_DUE if beside == "work due soon" else BESIDE_LOOK_AHEAD
    windows, _ = stream(piper, request(LONG), later_due_in=1.0, beside=step)  # first audio due now
    plan = PiperBackendConfig().window_plan
    hop = piper.get_voice("joe").config.hop_length
    if beside == "work due soon":
        assert [len(w.pcm) // hop for w in windows[:2]] == [plan.medium_first_frames, plan.frames]
        assert frames[0] == (plan.medium_first_frames + plan.context_frames
                             + plan.flow_context_frames)
    else:
        assert len(windows[0].pcm) == plan.first_frames * hop
        assert frames[0] == plan.first_frames + plan.context_frames + plan.first_flow_context_frames
    (whole,), _ = stream(backends["whole"], request(LONG))
    assert np.abs(np.concatenate([w.pcm for w in windows]) - whole.pcm).max() < 1e-3


def test_a_later_segment_due_soon_beside_work_due_soon_takes_one_medium_first_window(
        backends: dict[str, PiperBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    # Its listener hears the turn (its audio is due in 0.2 s, not already): a long first
    # window might be late, which would be a gap; a medium one is ready in time.
    piper = backends["windows"]
    frames = count_flow_calls(monkeypatch)
    windows, _ = stream(piper, request(LONG), due_in=0.2, beside=BESIDE_WORK_DUE)
    plan = PiperBackendConfig().window_plan
    hop = piper.get_voice("joe").config.hop_length
    assert [len(w.pcm) // hop for w in windows[:2]] == [plan.medium_first_frames, plan.frames]
    assert frames[0] == plan.medium_first_frames + plan.context_frames + plan.flow_context_frames
    (whole,), _ = stream(backends["whole"], request(LONG))
    assert np.abs(np.concatenate([w.pcm for w in windows]) - whole.pcm).max() < 1e-3


@pytest.mark.parametrize("catchup_lead_s", [0.15, 0.0])
def test_a_later_window_due_too_soon_for_a_long_one_is_cut_short_once(
        backends: dict[str, PiperBackend], monkeypatch: pytest.MonkeyPatch,
        catchup_lead_s: float) -> None:
    # Beside another lane's step a medium first window, then long ones; but each piece
    # here is due now: the window after the medium one is cut to `second_frames` (the
    # flow sliced for it), and only that one, so a box behind keeps its long windows.
    # With `window_catchup_lead_s` 0 the long windows stay.
    piper = backends["windows"]
    monkeypatch.setattr(piper, "_policy",
                        dataclasses.replace(piper._policy, catchup_lead_s=catchup_lead_s))
    frames = count_flow_calls(monkeypatch)
    windows, _ = stream(piper, request(LONG), beside=BESIDE_WORK_DUE)
    plan = PiperBackendConfig().window_plan
    hop = piper.get_voice("joe").config.hop_length
    sizes = [len(w.pcm) // hop for w in windows[:3]]
    if catchup_lead_s:
        assert sizes == [plan.medium_first_frames, plan.second_frames, plan.frames]
        # the short window's flow is a slice up to its own end and context, not a long piece
        assert frames[1] == plan.second_frames + 2 * plan.flow_context_frames
    else:
        assert sizes == [plan.medium_first_frames, plan.frames, plan.frames]
    (whole,), _ = stream(backends["whole"], request(LONG))
    assert np.abs(np.concatenate([w.pcm for w in windows]) - whole.pcm).max() < 1e-3


def test_the_flow_runs_ahead_of_the_windows_in_pieces_not_over_the_whole_segment(
        backends: dict[str, PiperBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    frames = count_flow_calls(monkeypatch)
    windows, _ = stream(backends["windows"], request(LONG), due_in=60.0)
    plan = PiperBackendConfig().window_plan
    hop = backends["windows"].get_voice("joe").config.hop_length
    total = sum(len(w.pcm) for w in windows) // hop
    assert total > 2 * plan.flow_frames, "the test sentence is too short to need two flow pieces"
    # The first window's flow covers its own frames and a piece ahead, never the whole segment.
    assert frames[0] == plan.flow_frames + plan.flow_context_frames
    assert len(frames) >= 2 and sum(frames) < total + 2 * len(frames) * plan.flow_context_frames


def test_a_segment_with_lead_to_spare_takes_long_windows_equal_to_the_whole(
        backends: dict[str, PiperBackend]) -> None:
    (whole,), _ = stream(backends["whole"], request(LONG))
    windows, _ = stream(backends["windows"], request(LONG), due_in=60.0)
    hop = backends["windows"].get_voice("joe").config.hop_length
    assert len(windows[0].pcm) == PiperBackendConfig().window_frames * hop
    assert np.abs(np.concatenate([w.pcm for w in windows]) - whole.pcm).max() < 1e-3


def test_a_graph_whose_flow_cannot_be_cut_out_still_streams_its_decoder(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        backends: dict[str, PiperBackend]) -> None:
    monkeypatch.setattr(piper_split, "_flow_cut", lambda model, latent: None)
    piper = PiperBackend(PiperBackendConfig(num_threads=1))
    with caplog.at_level(logging.WARNING, logger="voxgate.engine"):
        piper.load()
    assert any("the flow runs whole" in r.getMessage() for r in caplog.records)
    voice = piper.get_voice("joe")
    assert voice.is_split and not voice.has_flow
    windows, _ = stream(piper, request(LONG))
    (whole,), _ = stream(backends["whole"], request(LONG))
    assert len(windows) >= 3
    assert np.abs(np.concatenate([w.pcm for w in windows]) - whole.pcm).max() < 1e-3


def test_a_segment_whose_listener_already_waits_long_takes_long_windows(
        backends: dict[str, PiperBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    frames = count_flow_calls(monkeypatch)
    windows, _ = stream(backends["windows"], request(LONG), due_in=-2.0)  # the box is behind
    hop = backends["windows"].get_voice("joe").config.hop_length
    assert len(windows[0].pcm) == PiperBackendConfig().window_frames * hop
    config = PiperBackendConfig()
    assert frames[0] == config.window_plan.flow_frames + config.window_flow_context_frames
