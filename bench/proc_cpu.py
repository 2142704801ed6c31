"""CPU time of a process tree and of each of its threads, read from /proc (Linux).

A snapshot (`sample`) holds, for a root process and its descendants, each process's CPU
seconds (utime + stime of /proc/PID/stat: every thread's, those that ended included) and each
live thread's, with its name (/proc/PID/task/TID/comm). Two snapshots give CPU shares over the
time between them (`cores_between`). A thread is known by its OS name, which Python sets only
where asked (bench/gpu_shaped_serve.py names them); a process's main thread is the one whose
id is the process's, which in uvicorn is the thread that runs the event loop.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(slots=True, frozen=True)
class ThreadCpu:
    pid: int
    tid: int
    name: str
    cpu_s: float

    @property
    def is_main(self) -> bool:
        return self.pid == self.tid


@dataclass(slots=True)
class Sample:
    """CPU seconds of a process tree at `at` (time.monotonic())."""

    at: float
    processes: dict[int, float] = field(default_factory=dict)
    threads: dict[tuple[int, int], ThreadCpu] = field(default_factory=dict)


def parse_stat(text: str) -> tuple[int, float]:
    """(parent pid, CPU seconds) from a /proc/.../stat line; the name may hold spaces and ')'."""
    fields = text[text.rindex(")") + 2 :].split()
    # after the name: state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
    # utime stime
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def descendants(root: int) -> list[int]:
    """`root` and every process below it (one pass over /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid, _ = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def sample(root: int) -> Sample:
    """A snapshot of `root`'s tree; processes or threads that end while it is read are skipped."""
    snap = Sample(time.monotonic())
    for pid in descendants(root):
        try:
            snap.processes[pid] = parse_stat(Path(f"/proc/{pid}/stat").read_text())[1]
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except (OSError, ValueError, IndexError):
            continue
        for task in tasks:
            try:
                cpu = parse_stat((task / "stat").read_text())[1]
                name = (task / "comm").read_text().strip()
            except (OSError, ValueError, IndexError):
                continue
            tid = int(task.name)
            snap.threads[(pid, tid)] = ThreadCpu(pid, tid, name, cpu)
    return snap


def cores_between(
    before: Sample, after: Sample
) -> tuple[dict[int, float], list[tuple[ThreadCpu, float]]]:
    """CPU seconds of each process between two snapshots, and each thread's cores (most first).

    A process or thread that is only in `after` counts from zero (it started between them).
    """
    wall = max(after.at - before.at, 1e-9)
    processes = {pid: cpu - before.processes.get(pid, 0.0) for pid, cpu in after.processes.items()}
    threads = []
    for key, thread in after.threads.items():
        old = before.threads.get(key)
        threads.append((thread, (thread.cpu_s - (old.cpu_s if old else 0.0)) / wall))
    threads.sort(key=lambda pair: -pair[1])
    return processes, threads
