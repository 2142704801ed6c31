"""What the CUDA graphs record runs at real sizes on the meta device, as a stand-in for a GPU.

A captured region must not wait for the GPU (`.item()`, `nonzero`, boolean-mask
indexing: the capture fails) nor touch a tensor left on the CPU (a device
error). On the meta device both raise too, so these catch such a bug in CI,
where no GPU is; the real sizes (Qwen2-0.5B's 14 query / 2 KV heads, the
22 x 1024 DiT) cost nothing there.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.cosyvoice.flow_runtime.estimator_graphs import GraphedEstimator
from engine.backends.cosyvoice.flow_runtime.estimator_onnx import example_inputs
from engine.backends.cosyvoice.lm.runner import LMStream, SpeechLMRunner
from engine.backends.cosyvoice.models.flow_dit import DiTEstimator
from engine.backends.cosyvoice.models.qwen2 import Qwen2Config
from engine.backends.cosyvoice.models.speech_lm import SpeechLM
from tests.support.cosyvoice_random_checkpoint import QWEN2_05B

META = torch.device("meta")


@pytest.fixture(scope="module")
def runner() -> SpeechLMRunner:
    with torch.device(META):
        lm = SpeechLM(3, Qwen2Config.from_dict({"model_type": "qwen2", **QWEN2_05B}))
    lm = lm.to(torch.bfloat16)
    lm.body.reset_rope(META)
    return SpeechLMRunner(lm, 1024, 1024, decode_mode="static")


@pytest.mark.parametrize(("batch", "kv"), [(1, 256), (1024, 512), (256, 1024)])
def test_the_captured_lm_step_runs_on_the_device_alone(runner: SpeechLMRunner, batch: int,
                                                       kv: int) -> None:
    assert runner.static is not None
    with torch.inference_mode():
        # exactly what StaticDecoder.capture records: sampling and the forward
        runner.static._body(batch, kv)
    assert runner.static.chosen.shape == (1024,)
    assert runner.state.logp.shape == (1024, runner.spec.num_rows)


def test_the_dynamic_lm_decode_and_padded_prefill_keep_to_the_device(
        runner: SpeechLMRunner) -> None:
    def streams(first: int, n: int, cached: int) -> list[LMStream]:
        return [LMStream(slot=first + i, min_len=0, max_len=100, is_greedy=True, prompt_len=0,
                         num_cached=cached, tokens=[]) for i in range(n)]

    with torch.inference_mode():
        embeds = runner.lm.token_embeds(torch.tensor([1, 2, 3, 4], device=META))
        assert runner._forward(streams(0, 4, 400), embeds).shape == (4, runner.spec.num_rows)
        prompts = torch.zeros(3, 220, 896, device=META, dtype=torch.bfloat16)
        assert runner._forward(streams(10, 3, 0), prompts, [220, 150, 100]).shape == (
            3, runner.spec.num_rows)


@pytest.mark.parametrize(("rows", "frames"), [(2, 200), (256, 456)])
def test_the_captured_dit_pass_runs_on_the_device_alone(rows: int, frames: int) -> None:
    with torch.device(META):
        dit = DiTEstimator(1024, 22, 16, 64, ff_mult=2, mel_dim=80, mu_dim=80, spk_dim=80,
                           static_chunk_size=50)
    graphed = GraphedEstimator(dit.to(torch.bfloat16).eval(), max_rows=256, max_frames=1024,
                               use_graphs=False)
    inputs = tuple(a.to(META) for a in example_inputs(rows, frames, torch.bfloat16))
    with torch.inference_mode():
        # the padded static path: what GraphedEstimator.capture records
        out = graphed(*inputs, True)
    assert out.shape == (rows, 80, frames) and out.dtype == torch.bfloat16
