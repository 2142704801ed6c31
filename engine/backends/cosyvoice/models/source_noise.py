"""CosyVoice 2's HiFT source noise, counter-based on the device.

Upstream draws the sine source's noise from torch's global generator; voxgate
gave each stream a CPU generator, so every chunk's noise was drawn on the host
and copied to the GPU. Here the k-th normal a stream ever draws is a pure
function of (its seed, k): a 32-bit integer hash (lowbias32) of the counter
under the seed's key gives two uniforms, and Box-Muller makes the normal, all
on the device in a few integer ops (as lm/sampling.py's uniforms). Chunking
changes nothing: drawing 2 x 5000 or 10000 at once gives the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32), elementwise on int64 tensors holding 32-bit values."""
    x = x & _MASK32
    x = (x ^ (x >> 16)) * 0x7FEB352D & _MASK32
    x = (x ^ (x >> 15)) * 0x846CA68B & _MASK32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= _MASK32
    x = (x ^ (x >> 16)) * 0x7FEB352D & _MASK32
    x = (x ^ (x >> 15)) * 0x846CA68B & _MASK32
    return x ^ (x >> 16)


@dataclass(slots=True)
class NoiseCounter:
    """CosyVoice 2's source noise for one stream, counter-based: the k-th normal it ever draws is a
    hash of (seed, k), made on the device (no CPU generator, no host-to-device copy per chunk)."""

    seed: int
    drawn: int = 0

    def normal(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        counters = torch.arange(self.drawn, self.drawn + n, device=device, dtype=torch.long)
        self.drawn += n
        # a host int
        key = _mix32_int((self.seed & _MASK32) ^ _mix32_int((self.seed >> 32) & _MASK32))
        bits1 = _mix32(key ^ _mix32(2 * counters & _MASK32))
        bits2 = _mix32(key ^ _mix32((2 * counters + 1) & _MASK32))
        u1 = ((bits1 >> 8).float() + 0.5) / float(1 << 24)  # (0, 1): the log is finite
        u2 = (bits2 >> 8).float() / float(1 << 24)
        # Box-Muller
        return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).reshape(shape)
