"""What crosses between host and device: voice prompts go to the device once, a flow batch reads
nothing back, a step's audio comes to the host in one copy, and v2's source noise is made on the
device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.backends.cosyvoice.frontend.voice_prompts import flow_prompt_of, plain_prompt
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.flow import FlowRow, build_flow
from engine.backends.cosyvoice.models.source_noise import NoiseCounter
from engine.backends.cosyvoice.t2w.vocoder import V2VocoderState
from engine.backends.cosyvoice.t2w.worker import WaveChunk, chunks_to_host
from tests.support.cosyvoice_parity import (
    fixture_dir,
    one_torch_thread,  # noqa: F401 (autouse)
)


def tiny_flow() -> Any:
    return build_flow(load_model_dir(fixture_dir(3)))


def test_voice_prompt_tensors_are_made_on_the_models_device_once() -> None:
    flow = flow_prompt_of(plain_prompt(3), "meta")
    assert {t.device.type for t in (flow.tokens, flow.mel, flow.embedding)} == {"meta"}


def test_the_flow_batch_reads_nothing_back_from_the_device() -> None:
    # On the meta device any read-back (.item(), int(tensor), a Python loop over a device tensor)
    # raises, as it would stall the GPU; the old infer read lengths back per row.
    flow = tiny_flow().to("meta")
    rows = [FlowRow(torch.arange(n) % 50, torch.zeros(2 * p, 80, device="meta"),
                    torch.zeros(192, device="meta"),
                    3, torch.arange(2 * (n - 3))) for n, p in ((40, 10), (25, 5))]
    mels = flow.infer(rows, streaming=True)
    assert [tuple(m.shape) for m in mels] == [(80, 74), (80, 44)]


def test_one_step_brings_every_chunks_audio_to_the_host_in_one_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []
    original = torch.Tensor.cpu

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copies.append(self.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting)
    chunks = [WaveChunk(f"s{i}", torch.full((100 * (i + 1),), float(i)), i == 2, 5,
                        torch.zeros(80, 10))
              for i in range(3)]
    host = chunks_to_host(chunks)
    assert len(copies) == 1 and [len(c.pcm) for c in host] == [100, 200, 300]
    assert [float(c.pcm[0]) for c in host] == [0.0, 1.0, 2.0] and host[2].is_final


def test_cosyvoice_2s_source_noise_is_counter_based_on_the_device() -> None:
    # was a CPU torch.Generator: randn on the host, then a copy per chunk
    state = V2VocoderState.new(7)
    assert isinstance(state.noise, NoiseCounter)
    assert state.noise.normal((1, 4800, 9), torch.device("meta")).device.type == "meta"
    whole = NoiseCounter(7).normal((2, 5000), torch.device("cpu"))
    chunked = NoiseCounter(7)
    parts = torch.cat([chunked.normal((1, 5000), torch.device("cpu")),
                       chunked.normal((1, 5000), torch.device("cpu"))])
    assert torch.equal(whole, parts)  # a pure function of (seed, counter): chunking changes nothing
    assert abs(float(whole.mean())) < 0.05 and abs(float(whole.std()) - 1.0) < 0.05
    assert not torch.equal(whole, NoiseCounter(8).normal((2, 5000), torch.device("cpu")))
