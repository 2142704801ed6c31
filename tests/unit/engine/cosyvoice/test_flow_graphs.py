"""The flow estimator's CUDA graphs (flow_runtime/estimator_graphs.py): every bucket captured at
load, only where a graph pays, and a call never captures. There is no CUDA here: a stand-in graph
records its bucket and replays the static path eagerly (`recording_captures`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.flow_runtime.estimator_graphs import GraphedEstimator
from engine.backends.cosyvoice.loader import flow_limits
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.flow import build_flow
from engine.backends.cosyvoice.t2w.streams import T2WConfig
from tests.support.cosyvoice_parity import (
    fixture_dir,
    one_torch_thread,  # noqa: F401 (autouse)
)


def tiny_flow() -> Any:
    return build_flow(load_model_dir(fixture_dir(3)))


class _RecordedGraph:  # stand-in for torch.cuda.CUDAGraph: replays the recorded body eagerly
    def __init__(self, body: Any) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


def recording_captures(graphed: GraphedEstimator) -> list[tuple[bool, int, int]]:
    """Stand-in for CUDA (none here): graph mode on, each capture records its bucket's static
    path."""
    captured: list[tuple[bool, int, int]] = []

    def capture(bucket: tuple[bool, int, int], like: torch.Tensor) -> None:
        captured.append(bucket)
        graphed._static_for(bucket, like)
        graphed.graphs[bucket] = _RecordedGraph(lambda: graphed.outputs.__setitem__(
            bucket, graphed._run_static(bucket)))

    graphed.use_graphs = True
    graphed.capture = capture  # type: ignore[method-assign]
    return captured


def test_every_flow_bucket_is_captured_at_load_and_a_call_never_captures() -> None:
    estimator = tiny_flow().decoder.estimator
    graphed = GraphedEstimator(estimator, max_rows=100, max_frames=128, use_graphs=False)
    assert graphed.rows == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    captured = recording_captures(graphed)
    assert graphed.capture_all(torch.zeros(1), streaming=True) == 9 * 2
    inputs = tuple(torch.randn(70, 80, 50) if i in (0, 2, 5) else a
                   for i, a in enumerate((None, torch.ones(70, 1, 50), None, torch.rand(70),
                                          torch.randn(70, 80), None)))
    with torch.inference_mode():
        got = graphed(*inputs, True)
        want = estimator(*inputs, True)
    assert len(captured) == 18 and graphed.num_eager == 0
    assert torch.allclose(got, want, atol=1e-5)


def test_only_flow_buckets_where_a_graph_pays_are_captured_and_larger_calls_run_unpadded() -> None:
    estimator = tiny_flow().decoder.estimator
    graphed = GraphedEstimator(estimator, max_rows=100, max_frames=128, use_graphs=False,
                               max_graph_row_frames=16 * 64)
    captured = recording_captures(graphed)
    # rows 1-8 at both frame buckets (64, 128), rows 16 at 64 frames only
    assert graphed.capture_all(torch.zeros(1), streaming=True) == 4 * 2 + 1
    assert max(rows * frames for _, rows, frames in captured) <= 16 * 64

    def call(rows: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = (torch.randn(rows, 80, frames), torch.ones(rows, 1, frames),
                  torch.randn(rows, 80, frames),
                  torch.rand(rows), torch.randn(rows, 80), torch.randn(rows, 80, frames))
        with torch.inference_mode():
            return graphed(*inputs, True), estimator(*inputs, True)

    got, want = call(3, 50)  # a graph bucket: replayed
    assert graphed.num_plain == 0 and torch.allclose(got, want, atol=1e-5)
    # 32 rows x 128 frames past the limit: the plain estimator, no padding
    got, want = call(20, 100)
    assert graphed.num_plain == 1 and graphed.num_eager == 0 and torch.equal(got, want)
    assert len(captured) == 9  # and no call captured


def test_the_default_limits_capture_119_flow_graphs_not_377() -> None:
    config = CosyVoiceBackendConfig(model_dir=Path("m"), device="cpu", max_batch_size=256,
                                    max_streams=256, max_flow_streams=128)
    t2w = T2WConfig(first_hop_tokens=config.first_hop_tokens,
                    max_history_tokens=config.max_history_tokens)
    rows, frames = flow_limits(config.max_flow_streams, t2w, 25, 3)
    assert (rows, frames) == (256, 1856)
    estimator = tiny_flow().decoder.estimator
    for limit, count in ((0, 377), (config.max_flow_graph_row_frames, 119)):
        graphed = GraphedEstimator(estimator, rows, frames, use_graphs=False,
                                   max_graph_row_frames=limit)
        assert sum(graphed.has_graph_size((True, r, f)) for r in graphed.rows
                   for f in graphed.frames) == count
    with pytest.raises(ValueError, match="max_flow_graph_row_frames must be >= 0"):
        CosyVoiceBackendConfig(model_dir=Path("m"), max_flow_graph_row_frames=-1)
