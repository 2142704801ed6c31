"""bench.gateway_scale end to end at a tiny level (a real server on loopback, the real load tool),
the engine-alone floor, and the /proc reading they use: structure and that audio flowed, no
wall-time assertions."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

from bench import gateway_scale, proc_cpu
from bench.gpu_shaped import GpuShape
from bench.gpu_shaped_floor import run_level
from bench.scale_report import histogram_quantile


def test_a_tiny_level_reports_ttfa_cpu_threads_and_engine_counters(tmp_path: Path) -> None:
    report = gateway_scale.main(
        [
            "--sessions",
            "2",
            "--duration",
            "3",
            "--drain",
            "5",
            "--workdir",
            str(tmp_path),
            "--json",
            str(tmp_path / "report.json"),
        ]
    )
    assert json.loads((tmp_path / "report.json").read_text())["levels"] == report["levels"]
    assert [b["label"] for b in report["builds"]] == ["this"] and report["builds"][0][
        "workers"
    ] == 1
    (row,) = report["levels"]
    assert row["sessions"] == 2 and row["ttfa_n"] >= 1 and row["ttfa_p95_ms"] > 0
    assert row["audio_sent_s"] > 0 and row["audio_s_per_s"] > 0 and row["gpu_model"]["audio_s"] > 0
    assert row["server_cores"] > 0 and row["cpu_ms_per_audio_s"] > 0 and row["load_tool_cores"] > 0
    (process,) = row["processes"]
    assert process["main_thread_cores"] is not None and row["loop_thread_cores"] is not None
    assert any(t["tid"] == t["pid"] for t in row["threads"])  # the event loop's thread was read
    assert row["engine"]["steps"] > 0 and row["engine"]["busy_s"] > 0
    # the engine's share of first audio, read from the server's /metrics histogram
    assert 0 < row["engine"]["first_audio_p50_ms"] <= row["engine"]["first_audio_p95_ms"]
    assert isinstance(row["holds"], bool)
    # the server's gaps, split by where they fell (loadtest/metrics.py)
    assert 0 <= row["inside_segment_gaps"] <= row["server_gaps"] <= row["gaps"]
    assert "| this (" in gateway_scale.format_table(report["levels"])


def test_the_engine_alone_plays_turns_and_counts_its_steps() -> None:
    row = asyncio.run(run_level(2, 2.0, GpuShape()))
    assert row["turns"] >= 2 and row["audio_s_per_s"] > 0 and row["steps"] > 0
    assert row["ttfa_p50_ms"] <= row["ttfa_p95_ms"]


def test_stat_lines_parse_with_any_name_and_threads_are_read_by_name() -> None:
    line = "42 (a (b) c) S 7 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0"
    assert proc_cpu.parse_stat(line) == (7, 300 / os.sysconf("SC_CLK_TCK"))
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="probe")
    thread.start()
    try:
        assert thread.native_id is not None
        Path(f"/proc/self/task/{thread.native_id}/comm").write_text("probe-thread")
        before = proc_cpu.sample(os.getpid())
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # some CPU on the main thread
            pass
        after = proc_cpu.sample(os.getpid())
    finally:
        stop.set()
        thread.join()
    processes, threads = proc_cpu.cores_between(before, after)
    assert processes[os.getpid()] > 0
    names = {t.name: cores for t, cores in threads}
    assert "probe-thread" in names
    main = next(cores for t, cores in threads if t.is_main)
    assert main > names["probe-thread"]


def test_a_quantile_is_read_from_cumulative_buckets_as_prometheus_reads_it() -> None:
    name = "voxgate_engine_first_audio_seconds"
    buckets = {"0.1": 0.0, "0.2": 2.0, "0.3": 4.0, "+Inf": 4.0}
    samples = {f'{name}_bucket{{le="{le}"}}': count for le, count in buckets.items()}
    samples["voxgate_engine_steps_total"] = 9.0  # other samples are not its buckets
    assert histogram_quantile(samples, name, 0.5) == 0.2
    assert abs(histogram_quantile(samples, name, 0.95) - 0.29) < 1e-9
    samples[f'{name}_bucket{{le="+Inf"}}'] = 5.0  # one past the last bound: that bound
    assert histogram_quantile(samples, name, 0.99) == 0.3
    assert histogram_quantile({}, name, 0.5) is None  # a build without it
