"""The one place that chooses the flow estimator's runtime: TensorRT, CUDA graphs or torch.

`accelerate_flow` swaps a loaded flow's estimator for the chosen runtime
(estimator_onnx.use_estimator); flow.py never knows which one runs.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from engine.backends.cosyvoice.flow_runtime.estimator_trt import (
    TrtEstimator,
    TrtProfile,
    cached_engine,
    trt_available,
    weights_digest,
)

RUNTIMES = ("auto", "tensorrt", "cuda_graphs", "torch")


def choose_runtime(requested: str, device_type: str, has_tensorrt: bool) -> str:
    """"auto": TensorRT on a GPU that has it, else CUDA graphs on a GPU, else the torch estimator."""
    if requested not in RUNTIMES:
        raise ValueError(f"expected a flow estimator runtime in {RUNTIMES}, got {requested!r}")
    if requested == "auto":
        if device_type != "cuda":
            return "torch"
        return "tensorrt" if has_tensorrt else "cuda_graphs"
    if requested != "torch" and device_type != "cuda":
        raise ValueError(f"expected a CUDA device for the {requested} estimator, got {device_type}")
    if requested == "tensorrt" and not has_tensorrt:
        raise ValueError("expected the tensorrt package for the tensorrt estimator, got none (pip install tensorrt)")
    return requested


def accelerate_flow(flow: nn.Module, runtime: str = "auto", cache_dir: str | Path = "~/.cache/voxgate/trt",
                    profile: TrtProfile | None = None, precision: str = "fp16", num_contexts: int = 4,
                    max_rows: int = 256, max_frames: int = 1024) -> str:
    """Swap the flow's estimator for the chosen runtime; returns the runtime used.

    TensorRT exports both ONNX graphs into `cache_dir` (once per checkpoint:
    an existing export is reused) and builds or loads the engines there.
    """
    from engine.backends.cosyvoice.flow_runtime.estimator_graphs import GraphedEstimator
    from engine.backends.cosyvoice.flow_runtime.estimator_onnx import (
        FILE_NAMES,
        export_estimators,
        use_estimator,
    )

    estimator: nn.Module = flow.decoder.estimator  # type: ignore[union-attr,assignment]
    device = next(estimator.parameters()).device
    chosen = choose_runtime(runtime, device.type, trt_available())
    if chosen == "cuda_graphs":
        use_estimator(flow, GraphedEstimator(estimator, max_rows, max_frames))
    elif chosen == "tensorrt":
        profile = profile or TrtProfile(max_rows=max_rows, max_frames=max_frames)
        folder = Path(cache_dir).expanduser()
        onnx_dir = folder / f"onnx-{weights_digest(estimator)[:16]}"
        paths = {mode: onnx_dir / name for mode, name in FILE_NAMES.items()}
        if not all(p.is_file() for p in paths.values()):
            # float32 graph I/O whatever the flow's dtype; the engine's precision is the builder's
            paths = export_estimators(copy.deepcopy(estimator).float(), onnx_dir)
        engines = {mode: cached_engine(p, folder, profile, precision, device) for mode, p in paths.items()}
        use_estimator(flow, TrtEstimator(engines, profile, num_contexts, device))
    return chosen


