"""Piper's LayerNorms fused into one operator each: the same outputs, checked at load."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from engine.backends.piper import loader as piper_voices
from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.backends.piper.graphs import checked
from engine.backends.piper.graphs.layernorm import fuse_layer_norms
from engine.backends.piper.graphs.split import SplitGraphs, split_voice
from engine.backends.piper.loader import default_voice_files, open_session, read_patched_model
from engine.types import RequestId, SamplingParams, SynthesisRequest

SENTENCES = ["The quick answer is yes, and here is why.",
             "Paris has been the capital of France for a very long time.", "Okay."]


@pytest.fixture(scope="module")
def split() -> SplitGraphs:
    graphs = split_voice(read_patched_model(default_voice_files()))
    assert graphs is not None
    return graphs


@pytest.fixture(scope="module")
def piper() -> PiperBackend:
    backend = PiperBackend(PiperBackendConfig(num_threads=1))
    backend.load()
    return backend


def ops(graph: bytes) -> list[str]:
    return [node.op_type for node in onnx.load_from_string(graph).graph.node]


def test_joes_layer_norms_fuse_and_the_text_part_gives_the_same_outputs(
        split: SplitGraphs, piper: PiperBackend) -> None:
    fused, count = fuse_layer_norms(split.front)
    assert count == 36  # 6 text-encoder layers x 2, and the duration predictor's
    assert ops(fused).count("LayerNormalization") == count
    assert ops(fused).count("ReduceMean") == ops(split.front).count("ReduceMean") - 2 * count
    graph = onnx.load_from_string(fused).graph
    read = {name for node in graph.node for name in node.input}
    # nothing left that no node reads (onnxruntime warns about each at every session)
    assert all(init.name in read for init in graph.initializer)
    assert all(node.output[0] in read for node in graph.node if node.op_type == "Constant")
    original, rewritten = open_session(1, split.front), open_session(1, fused)
    params = SamplingParams(noise_scale=0.0, noise_w_scale=0.0)
    for text in SENTENCES:
        item = piper.prepare(SynthesisRequest(RequestId("t"), text, "joe", params=params))
        state = item.state
        feeds = {"input": np.array([state.ids], dtype=np.int64),
                 "input_lengths": np.array([len(state.ids)], dtype=np.int64),
                 "scales": np.array(state.scales, dtype=np.float32)}
        want, got = original.run(None, feeds), rewritten.run(None, feeds)
        assert np.array_equal(want[-1], got[-1]), "the durations changed"
        for a, b in zip(want[:-1], got[:-1], strict=True):
            assert a.shape == b.shape and np.abs(a - b).max() < 1e-4
        piper.release(item)


def test_a_graph_without_the_pattern_comes_back_unchanged(split: SplitGraphs) -> None:
    assert fuse_layer_norms(split.decoder) == (split.decoder, 0)


def test_a_mean_over_another_axis_is_not_a_layer_norm(split: SplitGraphs) -> None:
    model = onnx.load_from_string(split.front)
    for node in model.graph.node:
        if node.op_type == "ReduceMean":
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("axes", [1]))
    _, count = fuse_layer_norms(model.SerializeToString())
    assert count == 0


def test_a_fused_front_that_differs_is_not_used(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A rewrite gone wrong (here: every epsilon 1.0) must not change the voice: the
    # load-time check keeps the original graph and says so.
    def wrong(graph: bytes) -> tuple[bytes, int]:
        fused, count = fuse_layer_norms(graph)
        model = onnx.load_from_string(fused)
        for node in model.graph.node:
            if node.op_type == "LayerNormalization":
                for attribute in node.attribute:
                    if attribute.name == "epsilon":
                        attribute.f = 1.0
        return model.SerializeToString(), count

    monkeypatch.setattr(checked, "fuse_layer_norms", wrong)
    with caplog.at_level(logging.WARNING, logger="voxgate.engine"):
        voice = piper_voices.load_voice(default_voice_files(), 1, 0.5)
    assert any("LayerNorms stay unfused" in r.getMessage() for r in caplog.records)
    assert voice.is_split
