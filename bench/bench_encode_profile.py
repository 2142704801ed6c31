"""Where the gateway's encoding CPU goes, by library: the share that can run without the GIL.

    python -m bench.bench_encode_profile [--seconds 6]

Each work of bench.bench_gil_encode (Opus through the gateway's `StreamEncoder`, PyAV's
resampler, libmp3lame) runs alone in a child process under `perf record` (sampling every
thread, the first second of imports and warm-up left out), and `perf report --sort dso` says
which library each sample was in. PyAV runs the codec and filter calls with the GIL released
(`with cython.nogil:` around `avcodec_send_frame`, `avcodec_receive_packet` and the filter
graph's buffer source and sink, bench.bench_gil_encode prints where), so the codec libraries'
share is about the share of the work that another Python thread could run beside; the
interpreter and PyAV's Cython wrappers hold the GIL. Sampling shares do not depend on how busy
the box is, unlike the timings of bench.bench_gil_encode. Needs `perf` (Linux, and
kernel.perf_event_paranoid <= 2 for a user's own processes).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_gil_encode import WORKS

#: libraries whose code runs with the GIL released (FFmpeg's and the codecs PyAV bundles)
CODEC_LIBS = ("libopus", "libmp3lame", "libswresample", "libavcodec", "libavfilter", "libavutil")
#: the interpreter and compiled wrappers: they hold the GIL
PYTHON_LIBS = ("libpython", "python", ".abi3.so", "cpython-")
DELAY_MS = 1000


def child(label: str, seconds: float) -> None:
    """Run one work until `seconds` of this thread's CPU are spent (after the perf delay)."""
    work = WORKS[label]()
    end = time.thread_time() + seconds + DELAY_MS / 1000.0
    while time.thread_time() < end:
        work()


def shares(report: str) -> dict[str, float]:
    """Percent of samples in the codec libraries, the interpreter and the rest (perf, by dso)."""
    out = {"codec": 0.0, "python": 0.0, "other": 0.0}
    for line in report.splitlines():
        match = re.match(r"\s*([\d.]+)%\s+(\S+)", line)
        if not match:
            continue
        pct, dso = float(match.group(1)), match.group(2)
        if dso.startswith(CODEC_LIBS):
            out["codec"] += pct
        elif any(part in dso for part in PYTHON_LIBS):
            out["python"] += pct
        else:
            out["other"] += pct
    return out


def profile(label: str, seconds: float, workdir: Path) -> dict[str, float]:
    data = workdir / "perf.data"
    command = [
        sys.executable,
        "-m",
        "bench.bench_encode_profile",
        "--child",
        label,
        "--seconds",
        str(seconds),
    ]
    subprocess.run(
        [
            "perf",
            "record",
            "-q",
            "-F",
            "2000",
            "-D",
            str(DELAY_MS),
            "-o",
            str(data),
            "--",
            *command,
        ],
        check=True,
        capture_output=True,
    )
    done = subprocess.run(
        ["perf", "report", "-i", str(data), "--sort", "dso", "--stdio"],
        check=True,
        capture_output=True,
        text=True,
    )
    return shares(done.stdout)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="CPU seconds each work runs")
    parser.add_argument("--child", choices=list(WORKS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.seconds)
        return {}
    if shutil.which("perf") is None:
        raise SystemExit("expected `perf` on the PATH (linux-tools), got none")
    print(
        "| work | codec libraries (GIL released) % | interpreter and wrappers % | other % |\n"
        "|---|---:|---:|---:|"
    )
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in WORKS:
            row = profile(label, args.seconds, Path(tmp))
            out[label] = row
            print(
                f"| {label} | {row['codec']:.1f} | {row['python']:.1f} | {row['other']:.1f} |",
                flush=True,
            )
    return out


if __name__ == "__main__":
    main()
