"""The one place that chooses the flow estimator's runtime: TensorRT, CUDA graphs or torch.

`accelerate_flow` swaps a loaded flow's estimator for the chosen runtime
(estimator_onnx.use_estimator); flow.py never knows which one runs.

- `auto`: TensorRT on a GPU where it imports, else CUDA graphs on a GPU, else
  the torch estimator. Any TensorRT failure under `auto` (the import, an
  ONNX export, the build, loading the engine) falls back to CUDA graphs with
  one warning line: the server starts either way. Asking for `tensorrt` by
  name makes its failure an error.
- Only the streaming graph is exported and built (token-to-wave always
  streams); the offline mode runs the torch estimator.
- The CUDA graphs of every streaming bucket are captured here, at load
  (`GraphedEstimator.capture_all`), never while serving.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

from engine.backends.cosyvoice.flow_runtime.estimator_graphs import GraphedEstimator
from engine.backends.cosyvoice.flow_runtime.estimator_onnx import (
    FILE_NAMES,
    example_inputs,
    export_estimator,
    use_estimator,
)
from engine.backends.cosyvoice.flow_runtime.estimator_trt import (
    TrtEstimator,
    TrtProfile,
    cached_engine,
    trt_available,
    weights_digest,
)

log = logging.getLogger("voxgate.engine")

RUNTIMES = ("auto", "tensorrt", "cuda_graphs", "torch")


def choose_runtime(requested: str, device_type: str, has_tensorrt: bool) -> str:
    """"auto": TensorRT on a GPU that has it, else CUDA graphs on a GPU, else the torch
    estimator."""
    if requested not in RUNTIMES:
        raise ValueError(f"expected a flow estimator runtime in {RUNTIMES}, got {requested!r}")
    if requested == "auto":
        if device_type != "cuda":
            return "torch"
        return "tensorrt" if has_tensorrt else "cuda_graphs"
    if requested != "torch" and device_type != "cuda":
        raise ValueError(f"expected a CUDA device for the {requested} estimator, got {device_type}")
    if requested == "tensorrt" and not has_tensorrt:
        raise ValueError("expected the tensorrt package for the tensorrt estimator, got none "
                         "(pip install tensorrt)")
    return requested


def install_tensorrt(flow: nn.Module, estimator: nn.Module, device: torch.device,
                     cache_dir: str | Path,
                     profile: TrtProfile, precision: str, num_contexts: int) -> None:
    """Export the streaming graph (once per checkpoint), build or load its engine, install it."""
    folder = Path(cache_dir).expanduser()
    onnx_path = folder / f"onnx-{weights_digest(estimator)[:16]}" / FILE_NAMES[True]
    if not onnx_path.is_file():
        # float32 graph I/O whatever the flow's dtype; the engine's precision is the builder's
        export_estimator(copy.deepcopy(estimator).float(), onnx_path, streaming=True)
    engine = cached_engine(onnx_path, folder, profile, precision, device)
    use_estimator(flow, TrtEstimator(engine, profile, estimator, num_contexts, device))


def install_graphs(flow: nn.Module, estimator: nn.Module, device: torch.device, max_rows: int,
                   max_frames: int, max_graph_row_frames: int = 0) -> GraphedEstimator:
    """CUDA graphs of the streaming buckets up to `max_graph_row_frames` (0: all), captured now
    (on a CPU: the same static path, eager)."""
    graphed = GraphedEstimator(estimator, max_rows, max_frames, use_graphs=device.type == "cuda",
                               max_graph_row_frames=max_graph_row_frames)
    if graphed.use_graphs:
        like = example_inputs(1, 2, next(estimator.parameters()).dtype, device)[0]
        log.info("flow estimator: %d CUDA graphs captured",
                 graphed.capture_all(like, streaming=True))
    use_estimator(flow, graphed)
    return graphed


def accelerate_flow(flow: nn.Module, runtime: str = "auto",
                    cache_dir: str | Path = "~/.cache/voxgate/trt",
                    profile: TrtProfile | None = None, precision: str = "fp16",
                    num_contexts: int = 1,
                    max_rows: int = 256, max_frames: int = 1024, device_type: str | None = None,
                    max_graph_row_frames: int = 0) -> str:
    """Swap the flow's estimator for the chosen runtime; returns the runtime used.

    `device_type` overrides the estimator's device for the choice (tests inject a
    TensorRT failure on a CPU with "cuda").
    """
    estimator: nn.Module = flow.decoder.estimator  # type: ignore[union-attr,assignment]
    device = next(estimator.parameters()).device
    chosen = choose_runtime(runtime, device_type or device.type, trt_available())
    if chosen == "tensorrt":
        try:
            install_tensorrt(flow, estimator, device, cache_dir,
                             profile or TrtProfile(max_rows=max_rows, max_frames=max_frames),
                             precision, num_contexts)
        except Exception as exc:
            if runtime != "auto":
                raise
            log.warning("flow estimator: TensorRT failed (%s: %s); running CUDA graphs instead",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            chosen = "cuda_graphs"
    if chosen == "cuda_graphs":
        install_graphs(flow, estimator, device, max_rows, max_frames, max_graph_row_frames)
    return chosen
