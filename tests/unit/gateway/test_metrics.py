"""Metrics: the app's gauges are read when /metrics is scraped, never written on the audio path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.engine import Engine, EngineConfig
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.state import AppState
from tests.support.scripted_backend import ScriptedBackend


class FakeConnection:
    """A stand-in for `Connection`: the gauges read only its count of open contexts."""

    def __init__(self, contexts: dict[str, Any]) -> None:
        self.contexts = contexts

    @property
    def num_open_contexts(self) -> int:
        return len(self.contexts)

    def close_going_away(self) -> None:
        raise AssertionError("nothing shuts down here")


def gauge(state: AppState, name: str) -> float:
    for line in state.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_the_sessions_and_contexts_gauges_are_read_from_the_connections_at_scrape_time(
        tmp_path: Path) -> None:
    engine = Engine(ScriptedBackend(), EngineConfig(warmup_text=""))
    state = AppState(GatewayConfig(voice="v", data_dir=tmp_path), engine, Metrics(engine))
    assert gauge(state, "voxgate_sessions") == 0 and gauge(state, "voxgate_contexts") == 0
    first, second = FakeConnection({"a": 1, "b": 2}), FakeConnection({"c": 3})
    state.connections |= {first, second}
    assert gauge(state, "voxgate_sessions") == 2 and gauge(state, "voxgate_contexts") == 3
    del first.contexts["a"]  # nothing is told: the next scrape sees it
    assert gauge(state, "voxgate_contexts") == 2 == state.num_open_contexts()


def test_socket_admissions_are_counted_by_protocol_and_result(tmp_path: Path) -> None:
    engine = Engine(ScriptedBackend(), EngineConfig(warmup_text=""))
    metrics = Metrics(engine)
    metrics.admissions.labels(protocol="deepgram", result="rate_limited").inc()
    text = metrics.render().decode()
    assert 'voxgate_socket_admissions_total{protocol="deepgram",result="rate_limited"} 1.0' in text


def test_what_the_backend_could_not_run_yet_is_exported_by_reason(tmp_path: Path) -> None:
    engine = Engine(ScriptedBackend(), EngineConfig(warmup_text=""))
    metrics = Metrics(engine)
    assert "voxgate_engine_waits_total{" not in metrics.render().decode()  # none yet
    for reason in ("flow_cache", "flow_cache", "lm_slot"):
        engine.stats.count_wait(reason)
    text = metrics.render().decode()
    assert 'voxgate_engine_waits_total{reason="flow_cache"} 2.0' in text
    assert 'voxgate_engine_waits_total{reason="lm_slot"} 1.0' in text


def test_the_engines_first_audio_is_exported_as_a_histogram(tmp_path: Path) -> None:
    engine = Engine(ScriptedBackend(), EngineConfig(warmup_text=""))
    metrics = Metrics(engine)
    for seconds in (0.12, 0.18, 0.9):
        engine.stats.observe_first_audio(seconds)
    text = metrics.render().decode()
    assert 'voxgate_engine_first_audio_seconds_bucket{le="0.1"} 0.0' in text
    assert 'voxgate_engine_first_audio_seconds_bucket{le="0.2"} 2.0' in text
    assert 'voxgate_engine_first_audio_seconds_bucket{le="+Inf"} 3.0' in text
    assert "voxgate_engine_first_audio_seconds_count 3.0" in text
    assert "voxgate_engine_first_audio_seconds_sum 1.2" in text
