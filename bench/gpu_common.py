"""What the GPU bench scripts share: the dtypes they take, the median time of a pass on the device,
and their results, rewritten to `--json` as a run goes so that a device call cut short keeps what
it measured."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def median_ms(run: Callable[[], Any], device: torch.device, steps: int, warmup: int,
              before: Callable[[], Any] | None = None) -> float:
    """Median ms of one `run` over `steps` calls after `warmup` untimed ones, the device
    synchronised around each; `before` runs ahead of every call, outside the timed part."""
    times = []
    for i in range(warmup + steps):
        if before is not None:
            before()
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


class Results:
    """A bench's results (`data`), written to `path` (when there is one) by `save`.

    `part` runs one part of the bench: past `budget_s` seconds since `started` it is skipped, and a
    part that fails does not stop the rest; either is recorded in data["errors"] (a list) and the
    results are saved after every part. With `echo`, each part's outcome is printed as it ends."""

    def __init__(self, data: dict[str, Any], path: str | None, budget_s: float = math.inf,
                 started: float | None = None, echo: bool = False) -> None:
        self.data, self.path, self.budget_s, self.echo = data, path, budget_s, echo
        self.started = time.perf_counter() if started is None else started

    def save(self) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps(self.data, indent=1), encoding="utf-8")

    def part(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            if time.perf_counter() - self.started > self.budget_s:
                self.data["errors"].append(
                    f"{name}: skipped, past the {self.budget_s:.0f} s budget")
                self._echo(f"{name}: skipped (budget)")
                return None
            try:
                out = fn()
            except Exception as exc:  # noqa: BLE001 (reported; the other parts still run)
                self.data["errors"].append(f"{name}: {type(exc).__name__}: {exc}"[:600])
                self._echo(f"{name}: FAILED {type(exc).__name__}: {exc}"[:600])
                return None
            self._echo(f"{name}: {json.dumps(out)[:1500]}")
            return out
        finally:
            self.save()

    def _echo(self, line: str) -> None:
        if self.echo:
            print(line, flush=True)
