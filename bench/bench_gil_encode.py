"""Does PyAV let other threads run while it encodes? Opus, the resampler and MP3, beside Python.

    python -m bench.bench_gil_encode [--seconds 2] [--repeats 3] [--switch-interval-ms 5]

The installed PyAV's own source says where it lets go of the GIL (`with cython.nogil:` around
`avcodec_send_frame`, `avcodec_receive_packet` and the filter graph's buffer source and sink):
printed first. That is once per call into FFmpeg, a few times per 20 ms frame; between them
PyAV builds Python objects with the GIL held. bench.bench_encode_profile says what share of the
CPU falls on each side. This measures what that means for a thread beside a busy one:
1. A sleeper thread wakes every 0.5 ms; how late it wakes while the main thread runs the work
   is how long it waited for the GIL (the box's own lateness: the main thread asleep).
2. The same number of calls by one thread, then split over two: the two threads' throughput
   over one's, ~2 where the work runs without the GIL and two cores are free, ~1 where not.
3. The gateway's question: Opus on a worker thread beside an event loop's stand-in (pure
   Python for a share of every 10 ms): the worker's throughput against alone, and the loop's
   Python work against the loop alone. A worker that needs the GIL back after every frame
   waits for the loop to yield it, up to the switch interval each time.
Each work is one call as the gateway makes it: Opus is `gateway.audio.codecs`'s
`StreamEncoder.encode` of one second of 24 kHz PCM into 48 kHz 20 ms packets at complexity 5
(its codec context also resamples); the resampler is PyAV's `AudioResampler` (24 -> 48 kHz,
float, one second a call); MP3 is FFmpeg's libmp3lame at 24 kHz, one second a call. Wall
times on a shared box are noisy (a box with no free core shows no gain from threads at all):
run it on a quiet one, and read the CPU profile beside it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import av
import numpy as np

from gateway.audio.codecs import make_encoder, to_frame

RATE_IN = 24000


def speech_like(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(120 + 40 * np.sin(2 * np.pi * 0.7 * t)) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    return (0.2 * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2) * voiced).astype(np.float32)


def opus_work() -> Callable[[], None]:
    pcm = speech_like(1.0, RATE_IN)
    encoder = make_encoder("opus", 48000, 20, None, RATE_IN)

    def call() -> None:
        encoder.encode(pcm)

    return call


def resampler_work() -> Callable[[], None]:
    pcm = speech_like(1.0, RATE_IN)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=48000)

    def call() -> None:
        resampler.resample(to_frame(pcm, RATE_IN))

    return call


def mp3_work() -> Callable[[], None]:
    pcm = speech_like(1.0, RATE_IN)
    context = av.CodecContext.create("libmp3lame", "w")
    assert isinstance(context, av.AudioCodecContext)
    context.sample_rate, context.layout, context.format, context.bit_rate = (
        RATE_IN,
        "mono",
        "fltp",
        64000,
    )
    context.open()

    def call() -> None:
        context.encode(to_frame(pcm, RATE_IN))

    return call


def python_work() -> Callable[[], None]:
    def call() -> None:
        total = 0
        for i in range(200_000):
            total += i

    return call


WORKS: dict[str, Callable[[], Callable[[], None]]] = {
    "opus (StreamEncoder, 1 s)": opus_work,
    "resampler (1 s)": resampler_work,
    "mp3 (libmp3lame, 1 s)": mp3_work,
    "pure Python (held baseline)": python_work,
}


class Counter:
    """A thread counting in pure Python until stopped: it wants the GIL all the time."""

    def __init__(self) -> None:
        self.value = 0
        self.cpu_s = 0.0  # its own CPU time, once stopped
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="counter", daemon=True)

    def _run(self) -> None:
        start = time.thread_time()
        while not self._stop:
            self.value += 1
        self.cpu_s = time.thread_time() - start

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


class Ticker:
    """A thread that sleeps 0.5 ms again and again and records how late it wakes (ms): to run
    after its sleep it needs the GIL, so a lateness is how long another thread held it."""

    def __init__(self) -> None:
        self.late_ms: list[float] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ticker", daemon=True)

    def _run(self) -> None:
        while not self._stop:
            start = time.perf_counter()
            time.sleep(0.0005)
            self.late_ms.append(1000.0 * (time.perf_counter() - start - 0.0005))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def repeat_for(work: Callable[[], None], seconds: float) -> int:
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        work()
        calls += 1
    return calls


def alone(work: Callable[[], None], seconds: float) -> tuple[float, float]:
    """(wall ms, CPU ms) a call, nothing beside it."""
    wall, cpu = time.perf_counter(), time.thread_time()
    calls = repeat_for(work, seconds)
    return 1000.0 * (time.perf_counter() - wall) / calls, 1000.0 * (
        time.thread_time() - cpu
    ) / calls


class Loop:
    """An event loop's stand-in: pure Python for `duty` of every 10 ms, asleep the rest; counts
    the Python work it gets done (`value`) until stopped."""

    def __init__(self, duty: float) -> None:
        self.duty = duty
        self.value = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="loop", daemon=True)

    def _run(self) -> None:
        while not self._stop:
            start = time.perf_counter()
            while time.perf_counter() - start < 0.01 * self.duty:
                for _ in range(100):
                    self.value += 1
            if self.duty < 1.0:
                time.sleep(0.01 * (1.0 - self.duty))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def beside_loop(
    work: Callable[[], None] | None, duty: float, seconds: float
) -> tuple[float, float]:
    """(calls a second of `work` in a worker thread, the loop's work a second) with a loop of
    `duty` beside it; `work` None: the loop alone."""
    calls = [0]
    stop = threading.Event()

    def worker() -> None:
        while work is not None and not stop.is_set():
            work()
            calls[0] += 1

    thread = threading.Thread(target=worker, name="encoder")
    with Loop(duty) as loop:
        time.sleep(0.05)
        start, value0 = time.perf_counter(), loop.value
        thread.start()
        time.sleep(seconds)
        stop.set()
        thread.join()
        wall = time.perf_counter() - start
        done = loop.value - value0
    return calls[0] / wall, done / wall


def thread_pool_rows(
    make: Callable[[], Callable[[], None]],
    seconds: float,
    duties: tuple[float, ...] = (0.0, 0.5, 0.8, 1.0),
) -> list[dict[str, float]]:
    """Encoding on a worker thread beside an event loop busy for each share of its time: the
    worker's calls a second against alone, and the loop's Python work against the loop alone."""
    work = make()
    alone_rate = beside_loop(work, 0.0, seconds)[0]
    rows = []
    for duty in duties:
        rate, loop_rate = beside_loop(work, duty, seconds)
        loop_alone = beside_loop(None, duty, seconds)[1] if duty else 0.0
        rows.append(
            {
                "loop_duty": duty,
                "worker_share": rate / alone_rate,
                "loop_share": loop_rate / loop_alone if loop_alone else 1.0,
            }
        )
    return rows


def lateness(work: Callable[[], None], seconds: float) -> tuple[float, float]:
    """(p99, max) ms a sleeping thread waits past its wake-up while the work runs."""
    with Ticker() as ticker:
        repeat_for(work, seconds)
    late = sorted(ticker.late_ms)
    return late[int(0.99 * (len(late) - 1))], late[-1]


def thread_speedup(make: Callable[[], Callable[[], None]], calls: int) -> float:
    """Two threads' throughput over one's, for the same number of calls (each its own encoder)."""

    def run(work: Callable[[], None], n: int) -> None:
        for _ in range(n):
            work()

    one = make()
    start = time.perf_counter()
    run(one, calls)
    single = time.perf_counter() - start
    works = [make(), make()]
    threads = [threading.Thread(target=run, args=(w, calls // 2)) for w in works]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return single / (time.perf_counter() - start)


def source_evidence() -> list[str]:
    """The C calls the installed PyAV runs under `with cython.nogil:` (its .py sources)."""
    root = Path(av.__file__).parent
    found = []
    for name in ("codec/context.py", "filter/context.py"):
        path = root / name
        if not path.is_file():
            return [f"{name}: no source shipped with PyAV {av.__version__}"]
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "with cython.nogil" in line:
                called = re.findall(r"lib\.(\w+)\(", "\n".join(lines[i + 1 : i + 4]))
                found += [f"{name}: {c}" for c in called[:1]]
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="medians of this many")
    parser.add_argument(
        "--calls", type=int, default=60, help="calls per thread-speedup measurement"
    )
    parser.add_argument(
        "--switch-interval-ms", type=float, help="sys.setswitchinterval (default 5)"
    )
    args = parser.parse_args(argv)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    print(
        f"PyAV {av.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, "
        f"switch interval {1000 * sys.getswitchinterval():g} ms"
    )
    print("released around: " + ", ".join(source_evidence()))
    print(
        "\n| work | ms a call (CPU) | a sleeper's lateness p99 / max ms | two threads / one |"
        "\n|---|---:|---|---:|"
    )
    idle = lateness(lambda: time.sleep(0.01), args.seconds)
    print(f"| main thread asleep (the box's own noise) | - | {idle[0]:.2f} / {idle[1]:.2f} | - |")
    out: dict[str, Any] = {"asleep": {"late_p99_ms": idle[0], "late_max_ms": idle[1]}}
    for label, make in WORKS.items():
        work = make()
        work()  # warm up
        rows = []
        for _ in range(args.repeats):
            wall_ms, cpu_ms = alone(work, args.seconds)
            late = lateness(work, args.seconds)
            rows.append(
                {
                    "wall_ms": wall_ms,
                    "cpu_ms": cpu_ms,
                    "late_p99_ms": late[0],
                    "late_max_ms": late[1],
                    "thread_speedup": thread_speedup(make, args.calls),
                }
            )
        row = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        out[label] = row
        print(
            f"| {label} | {row['wall_ms']:.2f} ({row['cpu_ms']:.2f}) "
            f"| {row['late_p99_ms']:.2f} / {row['late_max_ms']:.2f} "
            f"| {row['thread_speedup']:.2f} |",
            flush=True,
        )
    print(
        "\nOpus on a worker thread beside an event loop busy for a share of its time "
        "(each the median of the repeats)\n"
        "| loop busy | encoder calls / alone | loop work / alone |\n|---:|---:|---:|"
    )
    runs = [thread_pool_rows(opus_work, args.seconds) for _ in range(args.repeats)]
    out["thread_pool"] = []
    for i, first in enumerate(runs[0]):
        row = {key: statistics.median(run[i][key] for run in runs) for key in first}
        out["thread_pool"].append(row)
        print(
            f"| {row['loop_duty']:.0%} | {row['worker_share']:.2f} | {row['loop_share']:.2f} |",
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()
