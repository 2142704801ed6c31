"""The flow estimator on TensorRT 10: the streaming engine cached per GPU, one execution context.

Used only where `import tensorrt` works (`trt_available()`); nothing here
imports it at module level, so the pure parts (profile, cache key, context
pool) are tested on any machine.

- Engines are built from the exported ONNX (estimator_onnx.py) with one
  optimization profile over CFG rows and mel frames, and cached under
  `cache_dir` by a key of the GPU name and compute capability, the TensorRT
  version, the profile, the precision and a digest of the ONNX file(s), so
  a new GPU, driver stack or checkpoint builds anew and nothing else does.
- Flow calls come from one thread (the backend's flow worker, one batch per
  call), so one execution context serves (`num_contexts`, default 1; each
  more is another scratch allocation, kept only where measured useful). A
  call borrows a context from a pool for its duration.
- TensorRT 10 is required (the `gpu` extra pins it): 11 removed the weakly
  typed `BuilderFlag.FP16`/`BF16` this builder sets.
- The ONNX graph's inputs and output are float32; `precision` ("fp16",
  "bf16", "fp32") is the builder's choice of kernels inside.
"""

from __future__ import annotations

import hashlib
import importlib.util
import queue
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from engine.backends.cosyvoice.flow_runtime.estimator_graphs import split_rows
from engine.backends.cosyvoice.flow_runtime.estimator_onnx import INPUT_NAMES, MEL_BINS, OUTPUT_NAME

PRECISIONS = ("fp16", "bf16", "fp32")
Item = TypeVar("Item")


def trt_available() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


@dataclass(slots=True, frozen=True)
class TrtProfile:
    """The shapes an engine accepts: CFG rows and mel frames, min / opt / max."""

    min_rows: int = 2
    opt_rows: int = 64
    max_rows: int = 256
    min_frames: int = 4
    opt_frames: int = 200
    max_frames: int = 1024

    def __post_init__(self) -> None:
        if not 1 <= self.min_rows <= self.opt_rows <= self.max_rows:
            raise ValueError(f"expected 1 <= min_rows <= opt_rows <= max_rows, got "
                             f"{self.min_rows}, {self.opt_rows}, {self.max_rows}")
        if not 2 <= self.min_frames <= self.opt_frames <= self.max_frames:
            raise ValueError(f"expected 2 <= min_frames <= opt_frames <= max_frames, got "
                             f"{self.min_frames}, {self.opt_frames}, {self.max_frames}")

    def shapes(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) shape of one input of the estimator graph."""
        dims = ((self.min_rows, self.min_frames), (self.opt_rows, self.opt_frames),
                (self.max_rows, self.max_frames))
        per_input = {"x": (MEL_BINS,), "mu": (MEL_BINS,), "cond": (MEL_BINS,), "mask": (1,)}
        if name in per_input:
            return tuple((b, per_input[name][0], t) for b, t in dims)  # type: ignore[return-value]
        if name == "t":
            return tuple((b,) for b, _ in dims)  # type: ignore[return-value]
        if name == "spks":
            return tuple((b, MEL_BINS) for b, _ in dims)  # type: ignore[return-value]
        raise ValueError(f"expected one of {INPUT_NAMES}, got {name!r}")

    def accepts(self, rows: int, frames: int) -> bool:
        return (self.min_rows <= rows <= self.max_rows
                and self.min_frames <= frames <= self.max_frames)

    def tag(self) -> str:
        return (f"r{self.min_rows}-{self.opt_rows}-{self.max_rows}"
                f"_f{self.min_frames}-{self.opt_frames}-{self.max_frames}")


def file_digest(path: Path) -> str:
    """sha256 of an ONNX file and of its external-data file (`<name>.data`) when there is one."""
    digest = hashlib.sha256()
    for part in (path, path.with_name(path.name + ".data")):
        if part.is_file():
            with part.open("rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
    return digest.hexdigest()


def engine_file_name(onnx_digest: str, gpu_name: str, capability: tuple[int, int], trt_version: str,
                     profile: TrtProfile, precision: str) -> str:
    """The cache file name: every input that changes the engine is in it."""
    if precision not in PRECISIONS:
        raise ValueError(f"expected precision in {PRECISIONS}, got {precision!r}")
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-") or "gpu"
    return (f"estimator_{onnx_digest[:16]}_{gpu}-sm{capability[0]}{capability[1]}_trt{trt_version}"
            f"_{precision}_{profile.tag()}.plan")


class ContextPool(Generic[Item]):
    """Items (execution contexts with their streams) lent one call at a time; thread-safe."""

    def __init__(self, items: list[Item]) -> None:
        if not items:
            raise ValueError("expected at least one execution context, got none")
        self._free: queue.Queue[Item] = queue.Queue()
        for item in items:
            self._free.put(item)
        self.size = len(items)

    @contextmanager
    def borrow(self, timeout: float | None = None) -> Iterator[Item]:
        """A free item for the block; waits (up to `timeout` s) when all are lent."""
        try:
            item = self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"expected a free execution context within {timeout} s, got none") from None
        try:
            yield item
        finally:
            self._free.put(item)

    def num_free(self) -> int:
        return self._free.qsize()


def build_engine(onnx_path: Path, profile: TrtProfile, precision: str, workspace_gib: float = 8.0,
                 optimization_level: int = 3) -> bytes:
    """A serialized TensorRT engine of the estimator graph (minutes for the real DiT)."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    major = int(trt.__version__.split(".")[0])
    explicit = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH) if major < 10 else 0
    network = builder.create_network(explicit)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"{onnx_path}: expected an ONNX graph TensorRT parses, got: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    config.builder_optimization_level = optimization_level
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    opt = builder.create_optimization_profile()
    for name in INPUT_NAMES:
        opt.set_shape(name, *profile.shapes(name))
    config.add_optimization_profile(opt)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"{onnx_path}: expected TensorRT to build an engine, got none "
                           "(see its log)")
    return bytes(serialized)


def cached_engine(onnx_path: str | Path, cache_dir: str | Path, profile: TrtProfile, precision: str,
                  device: torch.device, **build_args: Any) -> Path:
    """The engine file for this GPU, built and stored on first use."""
    import tensorrt as trt

    onnx_path = Path(onnx_path)
    name = engine_file_name(file_digest(onnx_path), torch.cuda.get_device_name(device),
                            torch.cuda.get_device_capability(device), trt.__version__, profile,
                            precision)
    path = Path(cache_dir) / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(build_engine(onnx_path, profile, precision, **build_args))
        tmp.replace(path)  # atomic: a crashed build leaves no half engine in the cache
    return path


class TrtEstimator(nn.Module):
    """A TensorRT engine of the streaming estimator in place of the torch estimator; same call.

    Only the streaming (chunked attention) graph is built: token-to-wave always
    streams. A call TensorRT cannot take never fails: offline mode and more
    frames than the profile run `fallback` (the torch estimator), more rows are
    split into calls that fit. One execution context unless asked otherwise;
    its scratch memory is a torch tensor (the caching allocator's, so torch and
    TensorRT share one pool instead of TensorRT reserving its own).
    """

    def __init__(self, engine_path: str | Path, profile: TrtProfile, fallback: nn.Module,
                 num_contexts: int = 1, device: str | torch.device = "cuda") -> None:
        super().__init__()
        import tensorrt as trt

        if num_contexts < 1:
            raise ValueError(f"expected num_contexts >= 1, got {num_contexts}")
        self.device = torch.device(device)
        self.profile = profile
        self.fallback = fallback
        self.num_fallbacks = 0
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        with torch.cuda.device(self.device):
            engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
            if engine is None:
                raise RuntimeError(f"{engine_path}: expected a TensorRT engine for this GPU and "
                                   "version, got none")
            self._engine = engine
            self._scratch: list[torch.Tensor] = []
            contexts = []
            for _ in range(num_contexts):
                context = engine.create_execution_context(
                    trt.ExecutionContextAllocationStrategy.USER_MANAGED)
                scratch = torch.empty(int(engine.device_memory_size_v2), dtype=torch.uint8,
                                      device=self.device)
                context.set_device_memory(scratch.data_ptr(), scratch.numel())
                self._scratch.append(scratch)
                contexts.append((context, torch.cuda.Stream(self.device)))  # type: ignore[no-untyped-call]
            self.pool: ContextPool[tuple[Any, torch.cuda.Stream]] = ContextPool(contexts)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        # x, mu, cond: [B, 80, T]; mask: [B, 1, T]; t: [B]; spks: [B, 80] -> [B, 80, T] in x's dtype
        b, frames = x.shape[0], x.shape[2]
        inputs = (x, mask, mu, t, spks, cond)
        if not streaming or not self.profile.min_frames <= frames <= self.profile.max_frames \
                or b < self.profile.min_rows:
            self.num_fallbacks += 1
            out: torch.Tensor = self.fallback(*inputs, streaming)
            return out
        if b > self.profile.max_rows:
            return split_rows(lambda *part: self(*part, streaming), inputs, self.profile.max_rows)
        return self._run(inputs)

    def _run(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = inputs[0]
        b, frames = x.shape[0], x.shape[2]
        caller = torch.cuda.current_stream(self.device)
        dev_inputs = [a.to(self.device, torch.float32).contiguous() for a in inputs]
        with self.pool.borrow() as (context, stream):
            stream.wait_stream(caller)  # the inputs were made on the caller's stream
            with torch.cuda.stream(stream):
                out = torch.empty(b, MEL_BINS, frames, device=self.device, dtype=torch.float32)
                for name, a in zip(INPUT_NAMES, dev_inputs, strict=True):
                    if not context.set_input_shape(name, tuple(a.shape)):
                        raise ValueError(f"expected {name} within the engine profile, got "
                                         f"{tuple(a.shape)}")
                    context.set_tensor_address(name, a.data_ptr())
                context.set_tensor_address(OUTPUT_NAME, out.data_ptr())
                if not context.execute_async_v3(stream.cuda_stream):
                    raise RuntimeError("expected TensorRT to run the estimator, got a failure at "
                                       f"{b} x {frames}")
            # The context (and its scratch) is reusable once its work is done; the caller's
            # stream then reads `out` without waiting on this one.
            stream.synchronize()
        # allocated on the context's stream, used and freed on the caller's
        out.record_stream(caller)
        return out.to(x.dtype)


def weights_digest(module: nn.Module) -> str:
    """sha256 of a module's parameters and buffers (names, shapes, float32 values): which checkpoint
    it holds."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
