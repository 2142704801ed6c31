"""Piper graphs cut at their flow and decoder (graphs/split.py): fallbacks, the decoder's 2-D
form."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.backends.piper.graphs import split as piper_split
from engine.types import RequestId, SamplingParams, SynthesisRequest

LONG = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the woods, "
        "where nobody can find it until the morning comes again.")


def request(text: str) -> SynthesisRequest:
    params = SamplingParams(noise_scale=0.0, noise_w_scale=0.0)  # VITS samples otherwise
    return SynthesisRequest(RequestId(text[:8]), text, "joe", params=params)


@pytest.fixture(scope="module")
def piper() -> PiperBackend:
    backend = PiperBackend(PiperBackendConfig(num_threads=1))
    backend.load()
    return backend


def test_a_graph_without_the_decoder_cut_falls_back_to_whole_segments_with_a_log_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(piper_split, "DECODER_ENTRY", "/dec/not_in_this_graph/Conv")
    piper = PiperBackend(PiperBackendConfig(num_threads=1))
    with caplog.at_level(logging.WARNING, logger="voxgate.engine"):
        piper.load()
    assert any("no decoder windows" in r.getMessage() for r in caplog.records)
    assert not piper.get_voice("joe").is_split
    (result,) = piper.step([piper.prepare(request(LONG))])
    assert result.error is None and result.is_finished and len(result.pcm) > 0


def _joe_split() -> piper_split.SplitGraphs:
    from engine.backends.piper.loader import default_voice_files, read_patched_model

    split = piper_split.split_voice(read_patched_model(default_voice_files()))
    assert split is not None
    return split


def test_the_loaded_decoder_runs_2d_convolutions_and_equals_the_1d_graph(
        piper: PiperBackend) -> None:
    import onnxruntime

    split = _joe_split()
    lifted = piper_split.decoder_as_2d(split.decoder)
    assert lifted is not None, "joe's decoder did not convert"
    original = onnxruntime.InferenceSession(split.decoder, providers=["CPUExecutionProvider"])
    latent = np.random.default_rng(1).standard_normal((1, 192, 100)).astype(np.float32)
    (want,) = original.run(None, {split.latent_name: latent})
    voice = piper.get_voice("joe")
    got = voice.run_decoder(latent, None)
    assert got.shape == (1, 100 * voice.config.hop_length)
    assert np.abs(got - want.reshape(1, -1)).max() < 1e-5  # float rounding only
    ops = {node.op_type for node in __import__("onnx").load_from_string(lifted).graph.node}
    assert "Unsqueeze" in ops and ops <= {"Unsqueeze", "Conv", "ConvTranspose", "Add", "Div",
                                          "LeakyRelu", "Tanh", "Identity", "Constant"}


def test_a_decoder_with_an_op_the_2d_form_does_not_know_runs_as_it_is() -> None:
    import onnx
    from onnx import helper

    split = _joe_split()
    model = onnx.load_from_string(split.decoder)
    graph = model.graph
    last = graph.node[-1]
    renamed = last.output[0] + "/pre"
    graph.node.append(helper.make_node("Softsign", [renamed], [last.output[0]]))
    last.output[0] = renamed
    assert piper_split.decoder_as_2d(model.SerializeToString()) is None
