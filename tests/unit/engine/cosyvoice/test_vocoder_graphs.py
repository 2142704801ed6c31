"""CosyVoice 3's vocoder step at a stream's usual shapes, padded to row buckets and replayed as
graphs (t2w/vocoder_graphs.py): the audio is the eager path's, and a steady stream's calls are all
replays
but its last. No CUDA here: the graph path runs as its static body, or as a stand-in graph that
records its bucket and replays that body."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.flow import FlowModel, build_flow
from engine.backends.cosyvoice.models.hift import HiFT, build_hift
from engine.backends.cosyvoice.t2w.cached_flow import CachedFlow
from engine.backends.cosyvoice.t2w.streams import FlowPrompt, T2WConfig, TokenToWave, WaveChunk
from engine.backends.cosyvoice.t2w.vocoder_graphs import VocoderGraphs, steady_shapes
from tests.support.cosyvoice_parity import (
    assert_close_report,
    fixture_dir,
    one_torch_thread,  # noqa: F401 (autouse)
)


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[FlowModel, HiFT, FlowPrompt, list[int]]]:
    model_dir = load_model_dir(fixture_dir(3))
    ref = torch.load(model_dir.path / "reference.pt", weights_only=True)
    tokens = torch.cat([ref["prompt_speech_token"][0], ref["flow_token"][0]])
    mel = torch.cat([ref["prompt_feat"][0], ref["flow_mel"][0].T])
    yield (build_flow(model_dir), build_hift(model_dir),
           FlowPrompt(tokens, mel, ref["embedding"][0]), ref["lm_greedy_tokens"].tolist())


class _RecordedGraph:  # stand-in for torch.cuda.CUDAGraph: replays the recorded body eagerly
    def __init__(self, graphs: VocoderGraphs, key: tuple[int, tuple[int, int]]) -> None:
        self.graphs, self.key = graphs, key

    def replay(self) -> None:
        self.graphs.outputs[self.key] = self.graphs._body(*self.key)


def speak(t2w: TokenToWave, prompt: FlowPrompt,
          answers: list[list[int]]) -> dict[str, list[WaveChunk]]:
    out: dict[str, list[WaveChunk]] = {}
    for k in range(len(answers)):
        t2w.add_stream(f"s{k}", prompt)
    for i in range(0, 240, 6):
        for k, tokens in enumerate(answers):
            if i < len(tokens):
                t2w.feed(f"s{k}", tokens[i:i + 6])
                if i + 6 >= len(tokens):
                    t2w.finish(f"s{k}")
        for chunk in t2w.run(t2w.ready()):
            out.setdefault(chunk.stream_id, []).append(chunk)
    return out


def t2w_of(flow: FlowModel, hift: HiFT, graphs: VocoderGraphs | None) -> TokenToWave:
    return TokenToWave(flow, hift, T2WConfig(), CachedFlow.build(flow, 64, 100, 4, False),
                       vocoder_graphs=graphs)


def test_the_usual_shapes_are_the_first_hop_the_chunk_that_completes_it_and_then_one() -> None:
    assert steady_shapes(15, 24) == [(30, 0), (50, 27), (82, 29)]
    assert steady_shapes(None, 24) == [(50, 0), (82, 29)]


def test_graph_replays_speak_what_the_eager_vocoder_speaks_and_only_last_chunks_run_eager(
        models: Any) -> None:
    flow, hift, prompt, answer = models
    # 3 streams: a bucket of 4 with a padding row
    answers = [answer[:140], answer[60:200], answer[100:190]]
    want = speak(t2w_of(flow, hift, None), prompt, answers)
    graphs = VocoderGraphs(hift, 4, steady_shapes(15, 24), use_graphs=False)
    captured: list[tuple[int, tuple[int, int]]] = []

    def capture(rows: int, shape: tuple[int, int]) -> None:
        captured.append((rows, shape))
        graphs.graphs[(rows, shape)] = _RecordedGraph(graphs, (rows, shape))

    graphs.use_graphs = True
    graphs.capture = capture  # type: ignore[method-assign]
    assert graphs.capture_all() == 3 * 3  # rows 1, 2, 4 at each shape, at load
    got = speak(t2w_of(flow, hift, graphs), prompt, answers)
    for sid in want:
        audio = torch.cat([c.audio for c in got[sid]])
        expected = torch.cat([c.audio for c in want[sid]])
        assert audio.shape == expected.shape
        assert_close_report(f"vocoder_graphs.{sid}", audio, expected, 1e-5)
    assert len(captured) == 9 and graphs.num_static == 0
    # eager: the last chunks only (streams 0 and 1 end together, in one call); every other call a
    # replay
    assert graphs.num_eager == 2 and graphs.num_replays >= 6


def test_the_static_path_pads_rows_to_a_bucket_and_changes_nothing(models: Any) -> None:
    flow, hift, prompt, answer = models
    answers = [answer[:90], answer[30:120], answer[50:140]]
    want = speak(t2w_of(flow, hift, None), prompt, answers)
    graphs = VocoderGraphs(hift, 4, steady_shapes(15, 24), use_graphs=False)
    got = speak(t2w_of(flow, hift, graphs), prompt, answers)
    for sid in want:
        assert_close_report(f"vocoder_static.{sid}", torch.cat([c.audio for c in got[sid]]),
                            torch.cat([c.audio for c in want[sid]]), 1e-5)
    assert graphs.num_static > 0 and graphs.num_eager == 1  # the three last chunks, together
