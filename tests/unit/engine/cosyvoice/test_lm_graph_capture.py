"""The speech LM's CUDA graphs (lm/graphs.py): every (batch, KV) bucket captured at load, serving
never captures. There is no CUDA here: a stand-in graph records its bucket and replays the static
step eagerly.
"""

from __future__ import annotations

from typing import Any

from engine.backends.cosyvoice.lm.graphs import StaticDecoder
from engine.backends.cosyvoice.lm.runner import SpeechLMRunner
from engine.backends.cosyvoice.models.qwen2 import Qwen2Config
from engine.backends.cosyvoice.models.speech_lm import SpeechLM
from tests.support.cosyvoice_parity import one_torch_thread  # noqa: F401 (autouse)
from tests.support.cosyvoice_random_checkpoint import QWEN2_TINY


class _RecordedGraph:  # stand-in for torch.cuda.CUDAGraph: replays the recorded body eagerly
    def __init__(self, body: Any) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


def test_every_lm_bucket_is_captured_at_load_and_serving_never_captures() -> None:
    lm = SpeechLM(2, Qwen2Config.from_dict({"model_type": "qwen2", **QWEN2_TINY})).eval()
    lm.body.reset_rope("cpu")
    runner = SpeechLMRunner(lm, 100, 512, decode_mode="static", kv_bucket=256)
    static = runner.static
    assert isinstance(static, StaticDecoder)
    assert static.batch_buckets == [1, 2, 4, 8, 16, 32, 64, 96, 100]  # multiples of 32 above 64
    captured: list[tuple[int, int]] = []

    def capture(b: int, kv: int) -> None:
        captured.append((b, kv))
        static.graphs[(b, kv)] = _RecordedGraph(lambda: static._body(b, kv))  # type: ignore[assignment]

    static.use_graphs = True
    static.capture = capture  # type: ignore[method-assign]
    assert static.capture_all() == 9 * 2
    assert sorted(captured) == [(b, kv) for b in static.batch_buckets for kv in (256, 512)]
    streams = [runner.add_request([1, 2, 3], seed=i) for i in range(70)]
    for _ in range(3):
        runner.step(streams[:5])
        runner.step(streams)
    assert len(captured) == 18 and static.num_eager == 0
