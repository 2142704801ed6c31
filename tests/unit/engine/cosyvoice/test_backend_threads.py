"""The cosyvoice backend's threads: flow + vocoder on their own thread (t2w/worker.py) speak what
the serial path speaks, flow calls are capped earliest-due first and leave rows due beyond their
horizon to later calls, and the text frontend runs on the backend's CPU executor."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from engine.backends.cosyvoice.sequences import Sequence
from tests.support.cosyvoice_parity import one_torch_thread  # noqa: F401 (autouse)
from tests.support.cosyvoice_steps import Requests, make_backend, run

prepare = Requests("fix")


def test_flow_on_its_own_thread_speaks_what_the_serial_path_speaks(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp()
    serial, threaded = make_backend(base, flow_thread="off"), make_backend(base, flow_thread="on")
    assert serial.flow_worker is None and threaded.flow_worker is not None
    texts = ("Hello world.", "Hi.", "A somewhat longer sentence, to make several chunks.")
    serial_items = [prepare(serial, t) for t in texts]
    threaded_items = [prepare(threaded, t) for t in texts]
    want, got = run(serial, serial_items), run(threaded, threaded_items)
    for a, b in zip(threaded_items, serial_items, strict=True):
        (tokens, pcm), (want_tokens, want_pcm) = got[a.request_id], want[b.request_id]
        assert tokens == want_tokens and len(pcm) == len(want_pcm) > 0
        np.testing.assert_allclose(pcm, want_pcm, atol=1e-4)  # batch company differs: float noise
    threaded.close()
    serial.close()


def test_flow_rows_per_step_are_capped_the_earliest_due_stream_first(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = make_backend(tmp_path_factory.getbasetemp(), max_flow_streams=1, flow_thread="off")
    assert backend.model is not None
    t2w = backend.model.t2w
    batches: list[list[str]] = []
    t2w_run = t2w.run
    monkeypatch.setattr(t2w, "run", lambda ids: batches.append(list(ids)) or t2w_run(ids))
    late = prepare(backend, "Hello world.", due=9.0)
    early = prepare(backend, "Hello world.", due=1.0)
    got = run(backend, [late, early])
    assert batches and all(len(b) == 1 for b in batches)
    assert batches[0] == [str(early.request_id)]  # both ready at once: the more starved goes first
    assert len(got[late.request_id][1]) == len(got[early.request_id][1])


@pytest.mark.parametrize(("horizon_s", "first_tick"), [(0.3, ["now"]), (0.0, ["now", "ahead"])])
def test_a_row_due_beyond_the_flow_horizon_waits_while_the_tick_has_enough(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
        horizon_s: float, first_tick: list[str]) -> None:
    backend = make_backend(tmp_path_factory.getbasetemp(), flow_thread="off",
                           flow_horizon_s=horizon_s, flow_min_rows=1)
    assert backend.model is not None
    t2w = backend.model.t2w
    batches: list[list[str]] = []
    t2w_run = t2w.run
    monkeypatch.setattr(t2w, "run", lambda ids: batches.append(list(ids)) or t2w_run(ids))
    now = time.monotonic()  # the engine's dues are on this clock
    ahead = prepare(backend, "Hello world.", due=now + 10.0)
    urgent = prepare(backend, "Hello world.", due=now)
    names = {str(ahead.request_id): "ahead", str(urgent.request_id): "now"}
    got = run(backend, [ahead, urgent])
    assert [names[key] for key in batches[0]] == first_tick
    assert len(got[ahead.request_id][1]) == len(got[urgent.request_id][1]) > 0  # both spoke


def test_prepare_hands_the_text_frontend_to_the_backends_cpu_executor(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = make_backend(tmp_path_factory.getbasetemp())
    assert backend.model is not None
    frontend = backend.model.frontend
    release, threads = threading.Event(), []
    lm_input = frontend.lm_input

    def slow(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        release.wait(30)
        return lm_input(*args)

    monkeypatch.setattr(frontend, "lm_input", slow)
    item = prepare(backend, "Hello world.")  # returns while the frontend still waits
    assert isinstance(item.state, Sequence) and not item.state.inputs.is_input_ready
    release.set()
    tokens, pcm = run(backend, [item])[item.request_id]
    assert threads and threads[0].startswith("voxgate-cosyvoice-cpu") and tokens and len(pcm)
