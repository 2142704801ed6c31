"""Piper voices split at their decoder, so that a segment streams in windows.

A Piper VITS graph is a front part (text encoder, duration predictor, flow)
followed by a HiFi-GAN decoder that turns the masked latent [B, 192, T]
(T frames of `hop_length` samples) into audio. The decoder begins at
`/dec/conv_pre/Conv`; its input is the latent. Graph surgery (onnx's
Extractor, the file on disk is never changed) gives two graphs:

- the front part: the voice's inputs -> (latent, durations), run once per segment;
- the decoder: latent (plus `sid` for multi-speaker voices) -> audio, run over
  windows of the latent: W frames plus C frames of context on each side, the
  context's samples cut from the output.

The decoder is convolutional with a finite receptive field, so a window with
enough context equals the whole decode. Measured on joe (1 thread, a 4.4 s
sentence, DESIGN.md "piper backend"): the decoder is ~70-78% of the cost;
W=64, C=16 equals the whole decode exactly (max abs 0.0) and costs 1.16x the
whole decode, W=128, C=16 1.03x; C=8 differs by 1e-4; W=16 costs 2.6x. So a
segment's first window is small (first audio = front part + one short
decode), later ones large (`WindowPlan`). A graph without the cut point (an
unknown export) is not split: `split_voice` returns None, the caller logs it
and synthesizes whole segments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger("voxgate.engine")

DECODER_ENTRY = "/dec/conv_pre/Conv"


@dataclass(slots=True, frozen=True)
class WindowPlan:
    """Window sizes in latent frames: the first small, the next ones growing to `frames`."""

    first_frames: int = 24
    second_frames: int = 48
    frames: int = 128
    context_frames: int = 16

    def __post_init__(self) -> None:
        for name in ("first_frames", "second_frames", "frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.context_frames < 0:
            raise ValueError(f"context_frames must be >= 0, got {self.context_frames}")

    def window_end(self, start: int, index: int, total: int) -> int:
        """Where window `index` (from 0) that begins at frame `start` ends."""
        size = self.first_frames if index == 0 else self.second_frames if index == 1 else self.frames
        end = min(total, start + size)
        if total - end < max(1, size // 4):
            end = total  # no sliver of a last window: it would cost a whole call
        return end


@dataclass(slots=True)
class SplitGraphs:
    """The two serialized graphs and the tensor names that join them."""

    front: bytes
    decoder: bytes
    latent_name: str
    decoder_inputs: tuple[str, ...]  # latent first, then graph inputs it also needs (sid)


def split_voice(model: Any) -> SplitGraphs | None:
    """Cut a patched piper graph (outputs: audio, durations) at its decoder; None if it cannot."""
    from onnx.utils import Extractor

    graph = model.graph
    entry = next((n for n in graph.node if n.name == DECODER_ENTRY), None)
    if entry is None or len(graph.output) != 2:
        return None
    latent = entry.input[0]
    audio_name, durations_name = graph.output[0].name, graph.output[1].name
    inputs = [i.name for i in graph.input]
    needed = _graph_inputs_reached(model, audio_name, stop=latent)
    extra = tuple(name for name in inputs if name in needed)
    try:
        extractor = Extractor(model)
        front = extractor.extract_model(inputs, [latent, durations_name])
        decoder = extractor.extract_model([latent, *extra], [audio_name])
    except Exception as exc:  # noqa: BLE001 - onnx raises its own types for a graph it cannot cut
        logger.warning("piper graph cannot be split at %s: %s", DECODER_ENTRY, exc)
        return None
    if any(i.name == durations_name for i in decoder.graph.input):
        return None  # the decoder depends on the durations: not the graph we know
    return SplitGraphs(front.SerializeToString(), decoder.SerializeToString(), latent, (latent, *extra))


def _graph_inputs_reached(model: Any, output: str, stop: str) -> set[str]:
    """Names reached walking back from `output` without passing `stop`."""
    producer = {out: node for node in model.graph.node for out in node.output}
    seen: set[str] = set()
    todo = [output]
    while todo:
        name = todo.pop()
        if name in seen or name == stop:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None:
            todo.extend(i for i in node.input if i)
    return seen


def decode_window(
    decode: Callable[[np.ndarray], np.ndarray], latent: np.ndarray, start: int, end: int,
    context: int, hop: int,
) -> np.ndarray:
    """Raw audio [(end - start) * hop] of frames [start, end) of `latent` [1, C, T].

    `decode(latent_slice) -> [1, N * hop]` is one decoder call; the slice has
    `context` frames on each side where the latent has them, cut from the output.
    """
    total = latent.shape[2]
    lo, hi = max(0, start - context), min(total, end + context)
    audio = decode(latent[:, :, lo:hi]).reshape(-1)  # [(hi - lo) * hop]
    cut = (start - lo) * hop
    return audio[cut: cut + (end - start) * hop]
