"""A scripted backend for engine tests: no model, deterministic PCM, optional faults.

Used where the real piper model would only slow a test of scheduling logic
down; the end-to-end tests use the real backend.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from engine.backend import Backend, BackendRequest, StepResult
from engine.errors import UnknownVoiceError
from engine.types import SynthesisRequest, VoiceInfo


class ScriptedBackend(Backend):
    """Each request yields `chunks_per_request` chunks of `chunk_s` seconds, one per step.

    A request whose text contains "FAIL" raises inside the step (as a broken
    model would); `step_delay_s` makes steps take wall time.
    """

    name = "scripted"
    sample_rate = 16000

    def __init__(self, *, max_batch_size: int = 4, chunks_per_request: int = 1,
                 chunk_s: float = 0.1, step_delay_s: float = 0.0) -> None:
        self.max_batch_size = max_batch_size
        self.chunks_per_request = chunks_per_request
        self.chunk_s = chunk_s
        self.step_delay_s = step_delay_s
        self.batches: list[list[str]] = []
        self.released: list[str] = []
        self.release_threads: set[str] = set()  # where release ran (the worker only)
        self.step_threads: set[str] = set()
        self.events: list[str] = []  # "prepare:<id>" and "step:<ids>" in the order they ran
        self.step_started = threading.Event()
        self.gate: threading.Event | None = None

    def load(self) -> None:
        pass

    def voices(self) -> list[VoiceInfo]:
        return [VoiceInfo("v", "scripted", "en", self.name, self.sample_rate)]

    def prepare(self, request: SynthesisRequest) -> BackendRequest:
        self.events.append(f"prepare:{request.request_id}")
        if request.voice != "v":
            raise UnknownVoiceError(f"unknown voice {request.voice!r}")
        return BackendRequest(request, state={"left": self.chunks_per_request},
                              est_audio_s=self.chunks_per_request * self.chunk_s)

    def step(self, batch: list[BackendRequest]) -> list[StepResult]:
        self.step_threads.add(threading.current_thread().name)
        self.step_started.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if any("CRASH" in item.request.text for item in batch):
            raise RuntimeError("the whole step crashed")
        self.batches.append([str(item.request_id) for item in batch])
        self.events.append("step:" + ",".join(self.batches[-1]))
        results = []
        for item in batch:
            if "FAIL" in item.request.text:
                results.append(StepResult(error=RuntimeError("model exploded")))
                continue
            item.state["left"] -= 1
            pcm = np.full(int(self.chunk_s * self.sample_rate), 0.25, dtype=np.float32)
            results.append(StepResult(pcm=pcm, is_finished=item.state["left"] == 0))
        return results

    def release(self, item: BackendRequest) -> None:
        # Frees the state a running step walks: released on the event loop during
        # a step, the step would fail on it (the race the engine's contract rules out).
        self.release_threads.add(threading.current_thread().name)
        self.released.append(str(item.request_id))
        item.state = None
