"""The arithmetic of the component benches: the fidelity measures, the perf table's grouping,
and one deflate row over real Opus messages."""

from __future__ import annotations

import numpy as np
import pytest

from bench.bench_encode_profile import shares
from bench.bench_opus_settings import fidelity
from bench.bench_ws_deflate import measure


def test_fidelity_is_zero_distance_for_the_same_audio_and_6_db_for_half_of_it() -> None:
    pcm = (0.1 * np.random.default_rng(0).standard_normal(48000)).astype(np.float32)  # every bin
    lsd, snr = fidelity(pcm, pcm, 48000)
    assert lsd == pytest.approx(0.0, abs=1e-6) and snr > 100
    lsd, snr = fidelity(pcm, 0.5 * pcm, 48000)
    assert lsd == pytest.approx(20 * np.log10(2), abs=1e-3)  # every bin 6.02 dB down
    assert snr == pytest.approx(20 * np.log10(2), abs=1e-3)


def test_perf_rows_are_grouped_into_codec_interpreter_and_other() -> None:
    report = """# Overhead  Shared Object
#
    76.07%  libopus-114e2b1a.so.0.11.1
     8.95%  libpython3.11.so.1.0
     5.00%  libc.so.6
     4.59%  libswresample-f0bc92fc.so.6.3.102
     0.33%  context.abi3.so
"""
    assert shares(report) == pytest.approx({"codec": 80.66, "python": 9.28, "other": 5.0})


def test_deflate_rows_count_opus_messages_and_their_compression() -> None:
    row = measure("opus", 48000, 5, repeats=1)
    assert row["messages_per_audio_s"] == pytest.approx(10.0, rel=0.02)  # 5 x 20 ms a message
    assert 0.5 < row["ratio"] < 1.05 and row["deflate_ms_per_audio_s"] > 0
