"""16-bit mono WAV files for tests, written with the standard library."""

from __future__ import annotations

import wave
from pathlib import Path
from typing import BinaryIO

import numpy as np


def write_pcm16_wav(target: Path | BinaryIO, pcm: np.ndarray, rate: int) -> None:
    """`pcm` (int16 samples) as a mono WAV at `rate`, to a path or an open binary file."""
    with wave.open(str(target) if isinstance(target, Path) else target, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.astype("<i2").tobytes())
