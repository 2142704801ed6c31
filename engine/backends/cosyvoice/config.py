"""Options of the cosyvoice backend, from `--engine-option KEY=VALUE` and `VOXGATE_COSYVOICE_*`.

Every field maps onto an environment variable of its upper-cased name
(`model_dir` <- VOXGATE_COSYVOICE_MODEL_DIR); explicit options override the
environment. Values given as strings are converted to the field's type.

Options are data: this module imports nothing of the runtime (no torch), and
the names each option accepts are spelled here, for the runtime modules to
check against. The options that depend on the device ("auto", 0) are
resolved once, when the backend is made (`resolve`, with the device's answer
passed in), into `Resolved`, which the runtime reads; nothing asks torch
about the device again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.options import config_from_options

ENV_PREFIX = "VOXGATE_COSYVOICE_"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DECODE_MODES = ("auto", "dynamic", "static", "cuda_graphs")
SAMPLING = ("ras", "greedy")
LM_BACKENDS = ("torch", "vllm")  # lm/driver.py, lm/driver_vllm.py
TOKENIZER_MODES = ("auto", "hf", "bytes")  # frontend/frontend.py
TEXT_FRONTENDS = ("auto", "wetext", "none")  # frontend/textnorm.py
GPU_BATCH, CPU_BATCH = 256, 8  # default requests per step
GPU_FLOW_STREAMS = 128  # default streams per flow call on a GPU: 256 CFG rows
FLOW_CACHE_RESERVE_GIB = 8.0  # GPU memory left beside the flow's K/V cache (sized at load)


@dataclass(slots=True)
class CosyVoiceBackendConfig:
    """Options of the cosyvoice backend; `model_dir` (an official CosyVoice 2/3 directory) is
    required."""

    model_dir: Path | None = None
    device: str = "auto"  # auto: cuda when available
    lm_dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    # auto: bfloat16 on cuda (upstream offers half precision), float32 on cpu
    flow_dtype: str = "auto"
    lm_backend: str = "torch"  # "vllm": see lm/driver.py (the seam)
    vllm_gpu_memory_share: float = 0.3  # lm_backend=vllm on a GPU: its share (weights + KV cache)
    decode_mode: str = "auto"  # auto: cuda_graphs on cuda, dynamic on cpu
    # requests per step; 0: GPU_BATCH (256) on a GPU, CPU_BATCH (8) on the CPU
    max_batch_size: int = 0
    max_streams: int = 0  # KV-cache slots; 0: 2 x max_batch_size (preempted streams recompute)
    # streams per flow call, the most starved (earliest due) first; 0: GPU_FLOW_STREAMS on a GPU
    # (128: 256 CFG rows, the estimator's largest graph), every ready stream on the CPU
    max_flow_streams: int = 0
    # a flow tick takes rows due within this many seconds, and rows due later only while it has
    # fewer than flow_min_rows (scheduler.plan_flow); 0: every ready row
    flow_horizon_s: float = 0.5
    flow_min_rows: int = 16
    # CFG rows x frames of the largest flow call replayed as a CUDA graph (captured at load);
    # larger calls are compute-bound and run eagerly on their exact shapes. 0: every bucket
    # (flow_runtime/estimator_graphs.py; docs/benchmarks.md, "Flow estimator pass").
    max_flow_graph_row_frames: int = 8192
    # cuDNN's attention kernels on a GPU (off: flash or memory-efficient attention). torch builds
    # a cuDNN attention plan per exact shape (batch and lengths), on each thread, cached without
    # bound: every eager call at a new shape (flow calls past the graph limit, LM prefills) pays a
    # build of tens of ms to about a second (loader.choose_attention; docs/cosyvoice-design.md,
    # "Attention kernels").
    cudnn_attention: bool = False
    # flow + vocoder on their own thread (and CUDA stream), overlapping the LM: auto = on a GPU
    flow_thread: str = "auto"
    cpu_workers: int = 1  # the backend's CPU executor: text frontend and voice registration
    max_len: int = 2048  # positions per slot: prompt + speech tokens
    sampling: str = "ras"  # "greedy": argmax (deterministic; tests)
    seed: int = 0
    tokenizer: str = "auto"  # "bytes": ByteTokenizer, for tests only (frontend/frontend.py)
    text_frontend: str = "auto"  # text normalization: auto (wetext where installed), wetext, none
    first_hop_tokens: int = 15
    # history the flow attends over (tokens, whole 25-token chunks with the K/V cache; without it,
    # the recomputation window); -1: the whole history (upstream; with the cache: while memory
    # allows)
    max_history_tokens: int = 100
    # CosyVoice 3's K/V cache (flow_runtime/kv_cache.py): auto = on for a CosyVoice 3 model unless
    # flow_runtime is tensorrt (the cache runs the torch DiT, its solve a CUDA graph on a GPU)
    flow_kv_cache: str = "auto"
    # its memory in GiB; 0: on a GPU what is free after loading less FLOW_CACHE_RESERVE_GIB
    # (graphs, activations), on the CPU enough for every stream slot and a few voices
    flow_cache_gib: float = 0.0
    # flow estimator: auto = TensorRT on a GPU that has it, else CUDA graphs on a GPU, else torch
    flow_runtime: str = "auto"
    default_voice_audio: Path | None = None  # a reference clip for the default voice ...
    default_voice_text: str = ""  # ... and its transcript
    default_voice_language: str = "en"
    num_threads: int = 0  # torch CPU threads; 0: half the cores
    chars_per_second: float = 14.0  # est_audio_s of Latin text (engine.types.estimate_audio_s)

    def __post_init__(self) -> None:
        if self.model_dir is not None:
            self.model_dir = Path(self.model_dir)
        if self.default_voice_audio is not None:
            self.default_voice_audio = Path(self.default_voice_audio)
        for name, allowed in (("device", DEVICES), ("lm_dtype", DTYPES), ("flow_dtype", DTYPES),
                              ("flow_runtime", ("auto", "torch", "cuda_graphs", "tensorrt")),
                              ("lm_backend", LM_BACKENDS), ("decode_mode", DECODE_MODES),
                              ("sampling", SAMPLING),
                              ("tokenizer", TOKENIZER_MODES),
                              ("text_frontend", TEXT_FRONTENDS),
                              ("flow_thread", ("auto", "on", "off")),
                              ("flow_kv_cache", ("auto", "on", "off"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("max_len", "first_hop_tokens", "cpu_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.flow_horizon_s < 0:
            raise ValueError(f"flow_horizon_s must be >= 0 (0: off), got {self.flow_horizon_s}")
        if self.flow_min_rows < 1:  # a tick with nothing due soon still computes look-ahead
            raise ValueError(f"flow_min_rows must be >= 1, got {self.flow_min_rows}")
        for name in ("max_batch_size", "max_flow_streams"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the device's default), got "
                                 f"{getattr(self, name)}")
        if self.max_flow_graph_row_frames < 0:
            raise ValueError(f"max_flow_graph_row_frames must be >= 0 (0: every bucket), "
                             f"got {self.max_flow_graph_row_frames}")
        if self.max_streams < 0:
            raise ValueError("max_streams must be >= 0 (0: 2 x max_batch_size), got "
                             f"{self.max_streams}")
        if self.max_history_tokens < -1:
            raise ValueError("max_history_tokens must be >= -1 (-1: all), got "
                             f"{self.max_history_tokens}")
        if self.flow_cache_gib < 0:
            raise ValueError("flow_cache_gib must be >= 0 (0: sized at load), got "
                             f"{self.flow_cache_gib}")
        if self.flow_kv_cache == "on" and self.flow_runtime == "tensorrt":
            raise ValueError("flow_kv_cache=on runs the torch DiT over the cache; expected "
                             "flow_runtime auto, torch or cuda_graphs, got tensorrt")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if not 0.0 < self.vllm_gpu_memory_share <= 1.0:
            raise ValueError("vllm_gpu_memory_share must be within (0, 1], got "
                             f"{self.vllm_gpu_memory_share}")
        if self.chars_per_second <= 0:
            raise ValueError(f"chars_per_second must be > 0, got {self.chars_per_second}")
        if self.default_voice_audio is not None and not self.default_voice_text.strip():
            raise ValueError("default_voice_text must be the transcript of default_voice_audio, "
                             "got none")

    def resolve(self, has_cuda: bool, num_cores: int | None = None) -> Resolved:
        """What "auto" and 0 mean on this machine: `has_cuda` is whether a CUDA device is
        available (the caller asks torch, once); `num_cores` the CPU's (default: os.cpu_count)."""
        is_gpu = self.device == "cuda" or (self.device == "auto" and has_cuda)
        batch = self.max_batch_size or (GPU_BATCH if is_gpu else CPU_BATCH)
        streams = self.max_streams or 2 * batch
        cores = num_cores or os.cpu_count() or 2
        return Resolved(
            device="cuda" if is_gpu else "cpu",
            lm_dtype=_dtype(self.lm_dtype, is_gpu), flow_dtype=_dtype(self.flow_dtype, is_gpu),
            decode_mode=self.decode_mode if self.decode_mode != "auto" else (
                "cuda_graphs" if is_gpu else "dynamic"),
            # a step never holds more requests than the LM has slots: each can then start
            batch_size=min(batch, streams), num_streams=streams,
            flow_streams=self.max_flow_streams or (
                min(GPU_FLOW_STREAMS, streams) if is_gpu else streams),
            uses_flow_thread=self.flow_thread == "on" or (self.flow_thread == "auto" and is_gpu),
            # half the cores, so the event loop (Opus encoding, sockets) keeps the rest
            num_threads=self.num_threads or max(1, min(8, cores // 2)),
            max_history_tokens=None if self.max_history_tokens < 0 else self.max_history_tokens)

    def uses_kv_cache(self, version: int) -> bool:
        """Whether the flow runs over CosyVoice 3's K/V cache (one chunk a run, no
        recomputation)."""
        if self.flow_kv_cache == "on" and version != 3:
            raise ValueError("flow_kv_cache=on needs a CosyVoice 3 model (its DiT), got CosyVoice "
                             f"{version}")
        return version == 3 and (self.flow_kv_cache == "on"
                                 or (self.flow_kv_cache == "auto"
                                     and self.flow_runtime != "tensorrt"))

    @classmethod
    def from_options(cls, options: dict[str, Any],
                     environ: dict[str, str] | None = None) -> CosyVoiceBackendConfig:
        """VOXGATE_COSYVOICE_<FIELD> variables, then `options` (strings converted to the field's
        type)."""
        return config_from_options(cls, "cosyvoice", options, ENV_PREFIX, environ)


@dataclass(slots=True, frozen=True)
class Resolved:
    """The options that depend on the machine, as `CosyVoiceBackendConfig.resolve` decided them."""

    device: str  # "cuda" or "cpu"
    lm_dtype: str  # "float32", "bfloat16" or "float16"
    flow_dtype: str
    decode_mode: str  # "dynamic", "static" or "cuda_graphs"
    batch_size: int  # requests per step, at most `num_streams`
    num_streams: int  # the LM's slots (KV-cache rows, or vLLM's running requests)
    flow_streams: int  # streams per flow call (their CFG rows are twice as many)
    uses_flow_thread: bool
    num_threads: int  # torch's CPU threads
    max_history_tokens: int | None  # None: the whole history


def _dtype(name: str, is_gpu: bool) -> str:
    return name if name != "auto" else ("bfloat16" if is_gpu else "float32")
