"""The decoder kept in onnxruntime's blocked layout: fewer reorders, the same audio, checked at
load."""

from __future__ import annotations

import logging
import platform
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine.backends.piper import loader as piper_voices
from engine.backends.piper.graphs import checked
from engine.backends.piper.graphs.blocked import _polyphase, blocked_decoder
from engine.backends.piper.graphs.split import SplitGraphs, decoder_as_2d, split_voice
from engine.backends.piper.loader import default_voice_files, open_session, read_patched_model

# onnxruntime's blocked (NCHWc) kernels are x86's; the CI and dev boxes are x86-64.
pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="onnxruntime has NCHWc kernels on x86 only")


@pytest.fixture(scope="module")
def split() -> SplitGraphs:
    graphs = split_voice(read_patched_model(default_voice_files()))
    assert graphs is not None
    return graphs


def op_counts(graph: bytes) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in onnx.load_from_string(graph).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def decode(graph: bytes, name: str, latent: np.ndarray) -> np.ndarray:
    (audio,) = open_session(1, graph).run(None, {name: latent})
    return np.asarray(audio).reshape(-1)


def test_joes_decoder_keeps_its_residual_blocks_blocked_and_decodes_the_same(
        split: SplitGraphs) -> None:
    lifted = decoder_as_2d(split.decoder)
    assert lifted is not None
    blocked = blocked_decoder(lifted, 192)
    assert blocked is not None
    counts = op_counts(blocked)
    # onnxruntime's own graph reorders around each of the 20 convolutions (34 in all);
    # what is left is a pair around each of the 3 upsamplings' interleaves, the input's
    # and the output's.
    assert counts["ReorderInput"] == counts["ReorderOutput"] == 4
    assert "ConvTranspose" not in counts and counts["Conv"] == 20 + 3
    assert counts["Add"] == 24 - 18  # each residual Add but the blocks' sums went into a Conv
    rng = np.random.default_rng(3)
    for frames in (17, 34, 72, 148):  # a lone first window with context, up to a long one
        latent = rng.standard_normal((1, 192, frames)).astype(np.float32)
        want = decode(split.decoder, split.latent_name, latent)
        got = decode(blocked, split.latent_name, latent)
        assert got.shape == want.shape == (frames * 256,)
        assert np.abs(got - want).max() < 1e-5  # float rounding only


def test_the_loaded_voice_decodes_with_the_blocked_graph(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="voxgate.engine"):
        voice = piper_voices.load_voice(default_voice_files(), 1, 0.5)
    assert "its decoder runs in 2-D, in onnxruntime's blocked layout" in caplog.text
    assert voice.decoder is not None


def test_a_blocked_graph_that_decodes_otherwise_is_not_taken(
        split: SplitGraphs, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def louder(graph: bytes, channels: int) -> bytes:
        model = onnx.load_from_string(graph)
        out = model.graph.output[0].name
        last = next(node for node in model.graph.node if out in node.output)
        last.output[:] = [f"{out}/pre"]
        model.graph.initializer.append(numpy_helper.from_array(np.array(1.01, np.float32), "gain"))
        model.graph.node.append(helper.make_node("Mul", [f"{out}/pre", "gain"], [out]))
        return model.SerializeToString()

    monkeypatch.setattr(checked, "blocked_decoder", louder)
    with caplog.at_level(logging.INFO, logger="voxgate.engine"):
        chosen = checked.fastest_decoder(split.decoder, split.latent_name,
                                         lambda graph: open_session(1, graph), "joe")
    assert "keeps onnxruntime's layout reorders: the blocked 2-D decoder differs by" in caplog.text
    assert chosen == decoder_as_2d(split.decoder)


def residual_graph(channels: int = 16) -> tuple[bytes, np.ndarray]:
    """x -> Conv -> LeakyRelu -> ConvTranspose(x2) -> y; y + Conv(LeakyRelu(y)), / 2 -> Conv -> out.

    A residual block in the shape of HiFi-GAN's, already 2-D ([B, C, 1, T]).
    """
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> Any:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    nodes = [
        helper.make_node("Unsqueeze", ["x", "axes"], ["x4"]),
        helper.make_node("Conv", ["x4", "w0", "b0"], ["c0"], kernel_shape=[1, 3],
                         pads=[0, 1, 0, 1]),
        helper.make_node("LeakyRelu", ["c0"], ["a0"], alpha=0.1),
        helper.make_node("ConvTranspose", ["a0", "wt", "bt"], ["y"], kernel_shape=[1, 4],
                         strides=[1, 2], pads=[0, 1, 0, 1]),
        helper.make_node("LeakyRelu", ["y"], ["a1"], alpha=0.1),
        helper.make_node("Conv", ["a1", "w1", "b1"], ["c1"], kernel_shape=[1, 3],
                         pads=[0, 1, 0, 1]),
        helper.make_node("Add", ["c1", "y"], ["r1"]),
        helper.make_node("LeakyRelu", ["r1"], ["a2"], alpha=0.1),
        helper.make_node("Conv", ["a2", "w2", "b2"], ["c2"], kernel_shape=[1, 5], pads=[0, 4, 0, 4],
                         dilations=[1, 2]),
        helper.make_node("Add", ["c2", "r1"], ["r2"]),
        helper.make_node("Div", ["r2", "two"], ["d"]),
        helper.make_node("Conv", ["d", "w3"], ["c3"], kernel_shape=[1, 3], pads=[0, 1, 0, 1]),
        helper.make_node("Tanh", ["c3"], ["out"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([2], np.int64), "axes"),
        weight("w0", channels, channels, 1, 3), weight("b0", channels),
        weight("wt", channels, channels, 1, 4), weight("bt", channels),
        weight("w1", channels, channels, 1, 3), weight("b1", channels),
        weight("w2", channels, channels, 1, 5), weight("b2", channels),
        weight("w3", 1, channels, 1, 3), numpy_helper.from_array(np.array(2.0, np.float32), "two"),
    ]
    graph = helper.make_graph(nodes, "residual",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    latent = rng.standard_normal((1, channels, 40)).astype(np.float32)
    return model.SerializeToString(), latent


def test_a_residual_block_runs_blocked_from_its_upsampling_to_its_last_conv() -> None:
    graph, latent = residual_graph()
    blocked = blocked_decoder(graph, latent.shape[1])
    assert blocked is not None
    counts = op_counts(blocked)
    # in: the input's and the upsampling's output (read by a LeakyRelu and an Add);
    # out: the upsampling's phases (to be interleaved) and the last Conv's output
    assert counts["ReorderInput"] == 2 and counts["ReorderOutput"] == 2
    assert counts.get("Add", 0) == 0  # both residual sums went into their Conv
    assert np.abs(decode(blocked, "x", latent) - decode(graph, "x", latent)).max() < 1e-5


@pytest.mark.parametrize(("size", "stride", "pads", "has_bias"), [
    (16, 8, (4, 4), True),  # joe's first two upsamplings
    (8, 4, (2, 2), True),  # its last
    (5, 2, (1, 2), False),  # a kernel not a multiple of the stride, uneven pads, no bias
    (3, 3, (0, 0), True),
])
def test_a_conv_transpose_as_its_phases_gives_the_same_output(
        size: int, stride: int, pads: tuple[int, int], has_bias: bool) -> None:
    rng = np.random.default_rng(size)
    inputs = ["x", "w", "b"] if has_bias else ["x", "w"]
    node = helper.make_node("ConvTranspose", inputs, ["y"], kernel_shape=[1, size],
                            strides=[1, stride], pads=[0, pads[0], 0, pads[1]])
    inits = [numpy_helper.from_array(rng.standard_normal((6, 5, 1, size)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(5).astype(np.float32),
                                     "b")][: len(inputs) - 1]
    graph = helper.make_graph([node], "up",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    original = helper.make_model(graph,
                                 opset_imports=[helper.make_opsetid("", 15)]).SerializeToString()
    phased = _polyphase(original)
    assert "ConvTranspose" not in op_counts(phased)
    for frames in (1, 7, 40):
        x = rng.standard_normal((2, 6, 1, frames)).astype(np.float32)
        (want,), (got,) = (open_session(1, graph).run(None, {"x": x})
                           for graph in (original, phased))
        assert got.shape == want.shape
        assert np.abs(got - want).max() < 1e-5


def test_a_graph_without_2d_convolutions_has_nothing_to_block() -> None:
    nodes = [helper.make_node("Mul", ["x", "two"], ["y"]), helper.make_node("Tanh", ["y"], ["out"])]
    graph = helper.make_graph(nodes, "plain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    assert blocked_decoder(model.SerializeToString(), 4) is None
