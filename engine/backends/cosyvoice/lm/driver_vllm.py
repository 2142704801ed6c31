"""`lm_backend="vllm"`: the speech LM on vLLM's AsyncLLM behind lm_driver.SpeechLMDriver.

The backend's worker thread is synchronous; AsyncLLM wants an event loop. So
the driver owns a thread running its own loop, with the engine (vllm_lm.py)
started on it. The two threads meet only in `_Stream` objects guarded by one
condition variable:

- `start` embeds each prompt with the torch LM (`SpeechLM.prompt_embeds`; the
  exported model has only the speech vocabulary) and hands a consumer task to
  the loop; vLLM schedules and batches the streams itself;
- the consumer appends every token vLLM yields to its stream's `pending`
  and wakes the worker;
- `step(keys)` takes what each stream made since the last call. When none of
  them has anything yet it waits for the first new token, at most `wait_s`
  (a few ms), so the engine loop keeps stepping without spinning a core;
- `stop` aborts the request in vLLM before it returns: no token of it is
  produced after the next engine step, none is returned at all.

Length and stop rules are the torch runner's (runner.py): `int(2 n)` to
`int(20 n)` tokens for n text tokens, cut to what `max_len` positions hold;
vllm_lm.SpeechLogitsProcessor masks index 6561 before the minimum and every id
from 6561 up ends a stream unyielded. Resumption (`resume_tokens`) prefills
the emitted tokens' embeddings after the prompt and shortens both limits by
their count; under RAS the repetition window then starts empty (greedy
streams continue exactly).

The exported model folder (vllm_export.py) is written to a temporary folder
at load and removed by `close` (or at exit).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import shutil
import tempfile
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.backends.cosyvoice.config import CosyVoiceBackendConfig, Resolved
from engine.backends.cosyvoice.lm.driver import LMOutput, LMStart, stream_seed
from engine.backends.cosyvoice.lm.runner import NoFreeSlotError
from engine.backends.cosyvoice.lm.sampling import RasConfig
from engine.backends.cosyvoice.lm.vllm_export import CPU_HEAD_SIZES, export_for_vllm
from engine.backends.cosyvoice.lm.vllm_lm import SpeechSampling, VllmLMConfig, VllmSpeechLM
from engine.backends.cosyvoice.models.speech_lm import SpeechLM
from engine.errors import ModelLoadError

log = logging.getLogger("voxgate.engine")

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(slots=True)
class VllmDriverConfig:
    """`max_streams` running streams at most, `max_len` positions each (prompt + tokens)."""

    max_streams: int
    max_len: int
    ras: RasConfig = field(default_factory=RasConfig)
    seed: int = 0
    wait_s: float = 0.005  # longest wait in `step` for a first new token
    # vLLM's share of the GPU (weights + KV cache); the flow needs the rest
    gpu_memory_share: float = 0.3
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    def __post_init__(self) -> None:
        if self.max_streams < 1 or self.max_len < 2:
            raise ValueError(f"expected max_streams >= 1 and max_len >= 2, got "
                             f"{self.max_streams} and {self.max_len}")
        if not 0.0 <= self.wait_s <= 1.0:
            raise ValueError(f"expected wait_s in [0, 1] seconds, got {self.wait_s}")


@dataclass(slots=True)
class _Stream:
    """One key's vLLM request. `pending`: tokens not yet returned by `step`."""

    request_id: str
    pending: deque[int] = field(default_factory=deque)
    is_done: bool = False
    task: asyncio.Task[None] | None = None


class VllmLMDriver:
    """SpeechLMDriver over one VllmSpeechLM whose loop runs on the driver's own thread."""

    def __init__(self, lm: SpeechLM, engine: VllmSpeechLM, config: VllmDriverConfig) -> None:
        self.lm, self.engine, self.config = lm, engine, config
        self._streams: dict[str, _Stream] = {}
        self._cond = threading.Condition()
        self._num_started = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="voxgate-vllm",
                                        daemon=True)
        self._export_dir: Path | None = None

    # -- lifecycle ------------------------------------------------------------

    def open(self) -> VllmLMDriver:
        """Start the loop thread and the engine on it (blocking: seconds to minutes)."""
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start_engine(), self._loop).result()
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)
        return self

    async def _start_engine(self) -> None:
        self.engine.start()  # on the loop's thread: AsyncLLM binds to the loop it runs on

    def close(self) -> None:
        """Abort every stream, stop the engine, end the thread, remove the exported folder."""
        atexit.unregister(self.close)
        if self._thread.is_alive():
            for key in list(self._streams):
                self.stop(key)
            try:
                asyncio.run_coroutine_threadsafe(self.engine.stop(), self._loop).result(timeout=30)
            except (concurrent.futures.TimeoutError, RuntimeError) as exc:
                log.warning("vLLM engine did not stop cleanly: %s", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
        if self._export_dir is not None:
            shutil.rmtree(self._export_dir, ignore_errors=True)
            self._export_dir = None

    # -- SpeechLMDriver -------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.config.max_streams - len(self._streams)

    def has(self, key: str) -> bool:
        return key in self._streams

    def start(self, requests: list[LMStart]) -> dict[str, Exception]:
        failed: dict[str, Exception] = {}
        for r in requests:
            try:
                if r.key in self._streams:
                    raise ValueError(f"expected a new LM stream key, got {r.key!r} "
                                     "(already running)")
                if self.num_free < 1:
                    raise NoFreeSlotError("expected a free LM stream, got all "
                                          f"{self.config.max_streams} in use")
                embeds, sampling = self._prompt(r)
            except (ValueError, NoFreeSlotError) as exc:
                failed[r.key] = exc
                continue
            self._num_started += 1
            # ids never repeat: a stopped one may linger
            stream = _Stream(f"{r.key}#{self._num_started}")
            with self._cond:
                self._streams[r.key] = stream
            self._loop.call_soon_threadsafe(self._spawn, stream, embeds, sampling)
        return failed

    def step(self, keys: list[str]) -> dict[str, LMOutput]:
        unknown = [k for k in keys if k not in self._streams]
        if unknown:
            raise ValueError(f"expected running LM streams, got unknown key {unknown[0]!r}")
        streams = [self._streams[k] for k in keys]
        with self._cond:
            if streams and not any(s.pending or s.is_done for s in streams):
                self._cond.wait(self.config.wait_s)  # woken by the first new token
            out: dict[str, LMOutput] = {}
            for key, s in zip(keys, streams, strict=True):
                tokens = list(s.pending)
                s.pending.clear()
                out[key] = LMOutput(tokens, s.is_done)
                if s.is_done:
                    del self._streams[key]
        return out

    def stop(self, key: str) -> None:
        with self._cond:
            stream = self._streams.pop(key, None)
        if stream is None or stream.is_done:
            return
        future = asyncio.run_coroutine_threadsafe(self._abort(stream), self._loop)
        try:
            future.result(timeout=10)
        except concurrent.futures.TimeoutError:
            log.warning("vLLM abort of %s took over 10 s", stream.request_id)

    @property
    def num_unfinished(self) -> int:
        """Requests vLLM still holds (tests: 0 once every stream ended or was stopped)."""
        return self.engine.num_unfinished

    # -- internals ------------------------------------------------------------

    def _prompt(self, r: LMStart) -> tuple[torch.Tensor, SpeechSampling]:
        """The prompt embeddings [P + R, D] and the limits, as SpeechLMRunner._prompt."""
        text = r.lm_input.text_ids
        if not text:
            raise ValueError("expected at least one text token, got none")
        device = self.lm.speech_embedding.weight.device
        ids = torch.tensor([*r.lm_input.prompt_text_ids, *text], dtype=torch.long, device=device)
        speech = torch.tensor(list(r.lm_input.prompt_speech_tokens), dtype=torch.long,
                              device=device)
        resumed = torch.tensor(list(r.resume_tokens), dtype=torch.long, device=device)
        with torch.inference_mode():
            embeds = self.lm.prompt_embeds(ids, speech)  # [P, D]
            prompt_len = embeds.shape[0]
            if resumed.numel():
                embeds = torch.cat([embeds, self.lm.speech_embedding(resumed)])  # [P + R, D]
        c = self.config
        if embeds.shape[0] >= c.max_len:
            raise ValueError(f"expected a prompt shorter than {c.max_len} positions, got "
                             f"{embeds.shape[0]}")
        max_len = min(int(len(text) * c.max_token_text_ratio), c.max_len - prompt_len)
        num_resumed = len(r.resume_tokens)
        if num_resumed >= max_len:
            raise ValueError(f"expected fewer resumed tokens than {max_len}, got {num_resumed}")
        seed = sampling_seed(r, c.seed)
        ras = c.ras
        sampling = SpeechSampling(
            max_tokens=max_len - num_resumed,
            min_tokens=max(0, int(len(text) * c.min_token_text_ratio) - num_resumed),
            mode="greedy" if r.is_greedy else "ras",
            top_p=ras.top_p, top_k=ras.top_k, win_size=ras.win_size, tau_r=ras.tau_r, seed=seed)
        return embeds.detach().cpu(), sampling

    def _spawn(self, stream: _Stream, embeds: torch.Tensor, sampling: SpeechSampling) -> None:
        stream.task = self._loop.create_task(self._consume(stream, embeds, sampling))

    async def _consume(self, stream: _Stream, embeds: torch.Tensor,
                       sampling: SpeechSampling) -> None:
        try:
            async for token in self.engine.generate(stream.request_id, embeds, sampling):
                with self._cond:
                    stream.pending.append(token)
                    self._cond.notify_all()
        except Exception:  # the stream ends short; the engine serves the others
            log.exception("vLLM request %s failed", stream.request_id)
        finally:
            with self._cond:
                stream.is_done = True
                self._cond.notify_all()

    async def _abort(self, stream: _Stream) -> None:
        await self.engine.abort(stream.request_id)  # no-op once its generate has ended
        task = stream.task
        if task is not None and not task.done():
            task.cancel()  # its generate closes the vLLM stream (aborting again, harmlessly)
            await asyncio.gather(task, return_exceptions=True)


def kv_cache_bytes(lm: SpeechLM, max_streams: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache for `max_streams` full-length streams (vLLM's pages of 16 positions)."""
    body = lm.body.config
    per_position = 2 * body.num_hidden_layers * body.num_key_value_heads * body.head_dim
    positions = max_streams * (-(-max_len // 16) * 16)
    return int(per_position * positions * torch.finfo(dtype).bits // 8)


def load_vllm_driver(lm: SpeechLM, config: VllmDriverConfig, device: torch.device) -> VllmLMDriver:
    """Export `lm` to a temporary folder, start vLLM on it and return the open driver."""
    dtype = lm.speech_embedding.weight.dtype
    head_dim = lm.body.config.head_dim
    if device.type == "cpu" and head_dim not in CPU_HEAD_SIZES:
        raise ModelLoadError(f"vLLM's CPU attention expects a head size in {CPU_HEAD_SIZES}, got "
                             f"{head_dim}; use lm_backend=torch for this model")
    folder = Path(tempfile.mkdtemp(prefix="voxgate-vllm-"))
    try:
        export_for_vllm(lm, folder / "lm", dtype=dtype, max_model_len=config.max_len)
        engine = VllmSpeechLM(VllmLMConfig(
            model=str(folder / "lm"),
            dtype=_DTYPE_NAMES[dtype],
            kv_cache_memory_bytes=kv_cache_bytes(lm, config.max_streams, config.max_len, dtype)
            if device.type == "cpu" else None,
            gpu_memory_utilization=config.gpu_memory_share,
            max_num_seqs=config.max_streams,
            max_model_len=config.max_len,
            enforce_eager=device.type == "cpu",  # CPU: no graphs; compiling costs minutes
            seed=config.seed,
        ))
        driver = VllmLMDriver(lm, engine, config)
        driver._export_dir = folder
        driver.open()
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    log.info("cosyvoice LM on vLLM (%s, %s): %d streams of %d positions", device.type,
             _DTYPE_NAMES[dtype], config.max_streams, config.max_len)
    return driver


def driver_config(options: CosyVoiceBackendConfig, resolved: Resolved,
                  ras: RasConfig) -> VllmDriverConfig:
    """From the backend's options (`max_len`, `seed`, `vllm_gpu_memory_share`) and its slots."""
    return VllmDriverConfig(max_streams=resolved.num_streams, max_len=options.max_len, ras=ras,
                            seed=options.seed, gpu_memory_share=options.vllm_gpu_memory_share)


def sampling_seed(r: LMStart, base_seed: int) -> int | None:
    """vLLM's per-request seed: only where the request asked for determinism, and never for
    greedy decoding (a seeded row takes vLLM's per-row sampling path, off its fused kernel)."""
    if r.is_greedy or not r.is_seeded:
        return None
    return (stream_seed(r.key, base_seed) if r.seed is None else r.seed) & 0x7FFFFFFF


def create_vllm_driver(lm: SpeechLM, options: CosyVoiceBackendConfig, resolved: Resolved,
                       ras: RasConfig, device: torch.device) -> VllmLMDriver:
    return load_vllm_driver(lm, driver_config(options, resolved, ras), device)
