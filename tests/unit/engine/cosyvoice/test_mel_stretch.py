"""Speed by stretching the mel: chunk by chunk equals the whole at once, and torch's own
interpolation."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from engine.backends.cosyvoice.t2w.mel_stretch import MelStretcher, stretch


def _streamed(mel: torch.Tensor, speed: float, cuts: list[int]) -> torch.Tensor:
    stretcher = MelStretcher(speed)
    bounds = [0, *cuts, mel.shape[1]]
    parts = [stretcher.push(mel[:, a:b], is_final=b == mel.shape[1])
             for a, b in itertools.pairwise(bounds)]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("speed", [0.5, 0.73, 1.0, 1.25, 1.5, 1.9, 2.0])
@pytest.mark.parametrize("seed", range(4))
def test_chunks_stretched_as_they_come_join_into_the_whole_mel_stretched(
        speed: float, seed: int) -> None:
    rng = random.Random(seed)
    frames = rng.randint(40, 260)
    mel = torch.randn(80, frames, generator=torch.Generator().manual_seed(seed))
    cuts = sorted(rng.sample(range(1, frames), rng.randint(1, 8)))
    got = _streamed(mel, speed, cuts)
    assert got.shape == (80, int(frames / speed))
    torch.testing.assert_close(got, stretch(mel, speed), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("frames", "speed"),
                         [(200, 2.0), (200, 0.5), (150, 1.5), (100, 1.25), (64, 1.0)])
def test_stretch_is_torchs_linear_interpolation_where_the_frame_ratio_is_the_speed(
        frames: int, speed: float) -> None:
    mel = torch.randn(80, frames, generator=torch.Generator().manual_seed(frames))
    # upstream's offline speed
    want = F.interpolate(mel[None], size=int(frames / speed), mode="linear")[0]
    torch.testing.assert_close(stretch(mel, speed), want, atol=1e-5, rtol=0)


def test_a_chunk_emits_what_it_can_and_holds_back_at_most_the_frame_it_still_needs() -> None:
    stretcher = MelStretcher(2.0)
    out = stretcher.push(torch.randn(80, 30), is_final=False)
    assert out.shape[1] == 15  # frame 14 reads source 28.5 (frames 28, 29); frame 15 needs 31
    assert stretcher.push(torch.randn(80, 0), is_final=False).shape[1] == 0
    assert stretcher.push(torch.randn(80, 2), is_final=True).shape[1] == 16 - 15


def test_speeds_outside_the_protocols_range_are_refused() -> None:
    for speed in (0.49, 2.01, 0.0):
        with pytest.raises(ValueError, match="expected speed within 0.5-2.0"):
            MelStretcher(speed)
