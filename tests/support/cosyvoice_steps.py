"""Driving a tiny cosyvoice backend by hand in unit tests: build one on the tiny random model
(cosyvoice_tiny), prepare requests, and step them together until each finishes."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.backend import BackendRequest
from engine.backends import create_backend
from engine.backends.cosyvoice.backend import CosyVoiceBackend
from engine.backends.cosyvoice.sequences import Sequence
from engine.types import RequestId, SynthesisRequest
from tests.support.cosyvoice_tiny import REFERENCE_TEXT, reference_wav, tiny_model_dir


def make_backend(base: Path, version: int = 3, load: bool = True,
                 **options: object) -> CosyVoiceBackend:
    """A greedy, byte-token backend on the tiny model under `base` (loaded unless `load` is False);
    `options` override the defaults."""
    options = {"tokenizer": "bytes", "sampling": "greedy", "max_batch_size": 4, "num_threads": 1,
               "default_voice_audio": str(reference_wav(base)),
               "default_voice_text": REFERENCE_TEXT, **options}
    backend = create_backend("cosyvoice", model_dir=str(tiny_model_dir(base, version)), **options)
    assert isinstance(backend, CosyVoiceBackend)
    if load:
        backend.load()
    return backend


class Requests:
    """Prepares requests in the default voice under the ids `prefix-0`, `prefix-1`, ...

    An unseeded stream's seed follows its request id, so each test module keeps its own sequence:
    what a sampled request speaks then does not depend on which modules ran before."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self._ids = prefix, itertools.count()

    def __call__(self, backend: CosyVoiceBackend, text: str, context: str = "", due: float = 0.0,
                 **fields: Any) -> BackendRequest:
        """`due`: when its next audio is due (the engine's clock would set it); `fields` go to
        SynthesisRequest."""
        request = SynthesisRequest(RequestId(f"{self.prefix}-{next(self._ids)}"), text, "default",
                                   context_key=context, **fields)
        item = backend.prepare(request)
        item.due = due
        return item


def run(backend: CosyVoiceBackend, items: list[BackendRequest], max_steps: int = 3000,
        after_step: Callable[[], object] | None = None) -> dict[str, tuple[list[int], np.ndarray]]:
    """Step the items together until each finishes (released then); (speech tokens, PCM) per
    request id. `after_step` is called after every step (to record what a step left behind)."""
    pcm: dict[str, list[np.ndarray]] = {item.request_id: [] for item in items}
    out: dict[str, tuple[list[int], np.ndarray]] = {}
    live = list(items)
    for _ in range(max_steps):
        if not live:
            return out
        for item, result in zip(list(live), backend.step(live), strict=True):
            assert result.error is None, result.error
            pcm[item.request_id].append(result.pcm)
            if result.is_finished:
                assert isinstance(item.state, Sequence)
                out[item.request_id] = (list(item.state.tokens),
                                        np.concatenate(pcm[item.request_id]))
                backend.release(item)
                live.remove(item)
        if after_step is not None:
            after_step()
    raise AssertionError(f"{len(live)} requests did not finish in {max_steps} steps")
