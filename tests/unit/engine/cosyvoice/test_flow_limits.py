"""The flow's largest shapes: a bounded prompt and history bound every flow row (t2w/streams.py
`max_chunk_frames`, loader `flow_limits`), and every flow call of a 256-stream pipeline fits the
graphs' rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.loader import flow_limits
from engine.backends.cosyvoice.t2w.streams import FlowPrompt, T2WConfig, max_chunk_frames, schedule


def test_the_flow_prompt_is_bounded_and_the_frame_limit_follows_from_it() -> None:
    with pytest.raises(ValueError, match="at most 750 prompt tokens"):
        FlowPrompt(torch.zeros(751, dtype=torch.long), torch.zeros(10, 80), torch.zeros(192))
    config = T2WConfig()
    limit = max_chunk_frames(config)
    assert limit == 2 * (750 + 124 + 34 + 3)
    for prompt in (1, 20, 149, 750):  # every row the schedule makes fits, whatever the prompt
        for history_start, _, end in schedule(prompt, 3000, config):
            assert 2 * (prompt + end + 3 - history_start) <= limit
    cpu = CosyVoiceBackendConfig(model_dir=Path("m"), device="cpu").resolve(has_cuda=False)
    rows, frames = flow_limits(cpu.flow_streams, config, 25, 3)
    assert frames == 1856 and frames % 64 == 0 and rows == 2 * 16
    # unbounded: eager past the graphs
    assert max_chunk_frames(T2WConfig(max_history_tokens=None)) is None


def test_a_256_stream_pipeline_keeps_every_flow_call_within_the_graphs_rows() -> None:
    # the bench's
    config = CosyVoiceBackendConfig(model_dir=Path("m"), max_batch_size=256, max_streams=256)
    on_gpu = config.resolve(has_cuda=True)  # as on a GPU (none here)
    rows, frames = flow_limits(on_gpu.flow_streams, T2WConfig(), 25, 3)
    # 2 CFG rows per stream: every call fits a graph
    assert on_gpu.flow_streams == 128 and rows == 256
    # the serving sizes the flow bench now measures (480 frames)
    assert frames >= 2 * (150 + 75 + 15)
