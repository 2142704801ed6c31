"""The flow estimator as ONNX: export with dynamic batch and time, and an onnxruntime runner.

The estimator (DiT for CosyVoice 3, U-Net for CosyVoice 2) is the only part
of the flow that runs ten times per chunk (twice the rows, for CFG), so it is
the part worth handing to another runtime. The graph takes upstream's inputs
and output names (cosyvoice/bin/export_onnx.py):

    x [B, 80, T]  mask [B, 1, T]  mu [B, 80, T]  t [B]  spks [B, 80]  cond [B, 80, T]
        -> estimator_out [B, 80, T]

with B (CFG rows: twice the streams) and T (mel frames) dynamic. Upstream
exports batch 2 only, and only full attention; the estimator's `streaming`
flag is a Python bool that chooses the attention mask (full, or 50-frame
chunks), so here each mode is its own graph: `estimator_streaming.onnx` and
`estimator_offline.onnx`.

Exporter: torch 2.13's default (dynamo) exporter, which needs `onnxscript`.
The TorchScript exporter (`dynamo=False`) fails on both estimators: it
records `layer_norm`'s normalized shape and the DiT's partial-rotary concat
as dynamic values it cannot lower. torch.export traces the Python control
flow away, so the graph's only dynamic values are B and T.

`OnnxEstimator` has the torch estimator's call signature, so the flow runs it
unchanged: `use_estimator(flow, OnnxEstimator(paths))` (tested: the whole
flow's mel equals the torch flow's within 1e-4).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

INPUT_NAMES = ("x", "mask", "mu", "t", "spks", "cond")
OUTPUT_NAME = "estimator_out"
MEL_BINS = 80
OPSET = 18  # LayerNormalization is native from 17; TensorRT 8.6+ parses 18
FILE_NAMES = {True: "estimator_streaming.onnx", False: "estimator_offline.onnx"}
MAX_ROWS = 4096  # bounds the exported batch dimension (CFG rows)
MAX_FRAMES = 30000  # bounds the exported time dimension (upstream's noise table is 15000 frames)

log = logging.getLogger("voxgate.engine.cosyvoice")


class FixedModeEstimator(nn.Module):
    """The estimator with its attention mode fixed: the six tensor inputs of the ONNX graph."""

    def __init__(self, estimator: nn.Module, streaming: bool) -> None:
        super().__init__()
        self.estimator = estimator
        self.streaming = streaming

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.estimator(x, mask, mu, t, spks, cond, self.streaming)
        return out


def example_inputs(rows: int, frames: int, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu",
                   seed: int = 0, num_padded: int = 0) -> tuple[torch.Tensor, ...]:
    """Random (x, mask, mu, t, spks, cond); the first `num_padded` rows are valid for half the
    frames only."""
    if rows < 1 or frames < 2:
        raise ValueError(f"expected rows >= 1 and frames >= 2, got {rows}, {frames}")
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, 1, frames)
    mask[:num_padded, :, frames // 2:] = 0.0
    x, mu, cond = (torch.randn(rows, MEL_BINS, frames, generator=gen) for _ in range(3))
    t, spks = torch.rand(rows, generator=gen), torch.randn(rows, MEL_BINS, generator=gen)
    return tuple(a.to(device, dtype) for a in (x, mask, mu, t, spks, cond))


def export_estimator(estimator: nn.Module, path: str | Path, streaming: bool,
                     example_frames: int = 64) -> Path:
    """Write one mode of the estimator as ONNX (float32 or the estimator's dtype), batch and time
    dynamic.

    Exported on the estimator's device. The example shape only seeds tracing:
    it must not be 0 or 1 (torch.export would specialize those) nor a multiple
    of the 50-frame attention chunk (T = 64 is neither).
    """
    from torch.export import Dim  # torch.export is slow to import; only exports need it

    param = next(estimator.parameters())
    args = example_inputs(4, example_frames, param.dtype, param.device)
    rows, frames = Dim("rows", min=1, max=MAX_ROWS), Dim("frames", min=2, max=MAX_FRAMES)
    per_frame = {0: rows, 2: frames}
    shapes = {"x": per_frame, "mask": per_frame, "mu": per_frame, "t": {0: rows}, "spks": {0: rows},
              "cond": per_frame}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    with warnings.catch_warnings(), torch.no_grad():
        # The exporter's own deprecation and shape-naming notices (and its log lines about
        # torchvision ops it cannot register); they say nothing about this model.
        warnings.simplefilter("ignore")
        exporter_log.setLevel(logging.ERROR)
        try:
            program = torch.onnx.export(FixedModeEstimator(estimator, streaming).eval(), args, None,
                                        dynamo=True,
                                        input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME],
                                        dynamic_shapes=shapes, opset_version=OPSET, verbose=False)
        finally:
            exporter_log.setLevel(level)
        if program is None:
            raise RuntimeError("expected torch.onnx.export(dynamo=True) to return an ONNXProgram, "
                               "got None")
        program.save(str(path))
    log.info("exported the %s estimator to %s", "streaming" if streaming else "offline", path)
    return path


def export_estimators(estimator: nn.Module, folder: str | Path) -> dict[bool, Path]:
    """Both attention modes -> {streaming: path} (`estimator_streaming.onnx`,
    `estimator_offline.onnx`)."""
    return {mode: export_estimator(estimator, Path(folder) / name, mode)
            for mode, name in FILE_NAMES.items()}


def onnx_paths(folder: str | Path) -> dict[bool, Path]:
    """The exported files of a folder, checked to exist."""
    paths = {mode: Path(folder) / name for mode, name in FILE_NAMES.items()}
    missing = [p.name for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: expected {' and '.join(FILE_NAMES.values())}, missing "
                                f"{missing}")
    return paths


class OnnxEstimator(nn.Module):
    """onnxruntime in place of the torch estimator: same call, same output (float32 inside).

    A module without parameters, so it can stand where the flow's `CFM`
    holds its estimator. Inputs go through host memory (numpy), so on a GPU
    this is a correctness reference, not the fast path (that is TensorRT).
    """

    def __init__(self, paths: Mapping[bool, str | Path], providers: list[str] | None = None,
                 num_threads: int | None = None) -> None:
        super().__init__()
        import onnxruntime as ort

        if set(paths) - {True, False} or not paths:
            raise ValueError("expected paths keyed by the streaming flag (True/False), got "
                             f"{sorted(paths)}")
        options = ort.SessionOptions()
        if num_threads is not None:
            options.intra_op_num_threads = num_threads
            options.inter_op_num_threads = 1
        chosen = providers or ["CPUExecutionProvider"]
        self.paths = {mode: Path(p) for mode, p in paths.items()}
        self.sessions = {mode: ort.InferenceSession(str(p), options, providers=chosen)
                         for mode, p in paths.items()}
        for mode, session in self.sessions.items():
            names = tuple(i.name for i in session.get_inputs())
            if names != INPUT_NAMES:
                raise ValueError(f"{paths[mode]}: expected inputs {INPUT_NAMES}, got {names}")

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        # x, mu, cond: [B, 80, T]; mask: [B, 1, T]; t: [B]; spks: [B, 80] -> [B, 80, T] in x's dtype
        session = self.sessions.get(streaming)
        if session is None:
            raise ValueError(f"expected an exported {'streaming' if streaming else 'offline'} "
                             "graph, got none")
        feed = {name: as_numpy(a)
                for name, a in zip(INPUT_NAMES, (x, mask, mu, t, spks, cond), strict=True)}
        out: Any = session.run([OUTPUT_NAME], feed)[0]
        return torch.from_numpy(out).to(x.device, x.dtype)


def as_numpy(a: torch.Tensor) -> np.ndarray:
    """A contiguous float32 host copy (the CFG inputs include expanded views, e.g. t)."""
    return np.ascontiguousarray(a.detach().to("cpu", torch.float32).numpy())


def use_estimator(flow: nn.Module, estimator: nn.Module) -> nn.Module:
    """Put `estimator` into a FlowModel's solver; returns the one it replaces.

    `CFM.forward` calls `self.estimator(x, mask, mu, t, spks, cond, streaming)`
    and nothing else of it, so any module with that call works: the torch
    estimator, OnnxEstimator, TrtEstimator or GraphedEstimator.
    """
    decoder = getattr(flow, "decoder", None)
    if decoder is None or not isinstance(getattr(decoder, "estimator", None), nn.Module):
        raise TypeError(f"expected a FlowModel (with decoder.estimator), got {type(flow).__name__}")
    previous: nn.Module = decoder.estimator
    decoder.estimator = estimator
    return previous
