"""Speaking rate by stretching the mel in time, chunk by chunk, before the vocoder.

Upstream changes speed only offline: it resamples the whole mel linearly to
`int(frames / speed)` frames before HiFT (CosyVoice2Model.token2wav) and
refuses `speed` while streaming. Pitch is kept, since the vocoder predicts f0
from the stretched mel itself. `MelStretcher` does the same resampling as the
mel arrives, holding back at most the one frame an interpolation still needs,
so the chunks it emits join into exactly `stretch(whole mel)`:

    output frame k reads source position p = (k + 0.5) * speed - 0.5
    (half-pixel centres, as torch's linear interpolation without
    align_corners), linearly between frames floor(p) and floor(p) + 1,
    both clamped to the mel; the whole mel gives int(frames / speed) frames.

Upstream's offline path uses the ratio frames / int(frames / speed) instead
of `speed` itself, which differs from it by under one frame over an answer.
"""

from __future__ import annotations

import math

import torch

MIN_SPEED, MAX_SPEED = 0.5, 2.0


def _positions(first: int, count: int, speed: float) -> torch.Tensor:
    """Source positions of output frames first .. first + count - 1 (float64: exact for long
    answers)."""
    k = torch.arange(first, first + count, dtype=torch.float64)
    return ((k + 0.5) * speed - 0.5).clamp(min=0.0)


def _interpolate(mel: torch.Tensor, offset: int, positions: torch.Tensor) -> torch.Tensor:
    """mel [80, n] holding source frames offset .. offset + n - 1 -> [80, len(positions)]."""
    last = offset + mel.shape[1] - 1
    low = positions.floor().long().clamp(max=last)
    high = (low + 1).clamp(max=last)
    weight = (positions - low.double()).clamp(0.0, 1.0).to(mel.dtype).to(mel.device)  # [m]
    low, high = (low - offset).to(mel.device), (high - offset).to(mel.device)
    return mel[:, low] * (1 - weight) + mel[:, high] * weight


def stretch(mel: torch.Tensor, speed: float) -> torch.Tensor:
    """The whole mel [80, n] at `speed` -> [80, int(n / speed)]."""
    count = int(mel.shape[1] / speed)
    if count == 0:
        return mel[:, :0]
    return _interpolate(mel, 0, _positions(0, count, speed))


class MelStretcher:
    """One stream's mel, stretched as it arrives; `push` chunks, the last with `is_final`."""

    def __init__(self, speed: float) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"expected speed within {MIN_SPEED}-{MAX_SPEED}, got {speed}")
        self.speed = speed
        self.num_in = 0  # source frames received
        self.num_out = 0  # stretched frames emitted
        self._tail = torch.zeros(80, 0)  # source frames offset .. num_in - 1 still needed
        self._offset = 0

    def push(self, mel: torch.Tensor, is_final: bool) -> torch.Tensor:
        """New source frames [80, n] -> the stretched frames [80, m] that can be made now."""
        if self._tail.shape[1] == 0:
            self._tail = self._tail.to(device=mel.device, dtype=mel.dtype)
        held = torch.cat([self._tail, mel], dim=1)
        self.num_in += mel.shape[1]
        total = int(self.num_in / self.speed)  # what the whole mel so far would give
        if is_final:
            end = total
        else:  # frame k is ready once floor(p_k) + 1 has arrived: p_k < num_in - 1
            end = max(self.num_out, min(total, math.ceil((self.num_in - 0.5) / self.speed - 0.5)))
            while end > self.num_out and (end - 0.5) * self.speed - 0.5 >= self.num_in - 1:
                end -= 1  # float rounding at the boundary
        out = _interpolate(held, self._offset,
                           _positions(self.num_out, end - self.num_out, self.speed)) \
            if end > self.num_out and held.shape[1] else held[:, :0]
        self.num_out = max(self.num_out, end)
        keep = min(self.num_in, max(0, math.floor((self.num_out + 0.5) * self.speed - 0.5)))
        self._tail, self._offset = held[:, keep - self._offset:], keep
        return out
