"""The GPU path's faults (issue 19), each shown fixed as far as a CPU, the meta device and the tiny
checkpoints allow. Where a part needs a GPU (a CUDA graph capture, TensorRT itself) it is replaced
by a stand-in that records what was asked of it; the test says so.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomllib
import torch
from torch import nn

from engine.backend import BackendRequest
from engine.backends import create_backend
from engine.backends.cosyvoice.backend import CosyState, CosyVoiceBackend
from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.flow_runtime import choose
from engine.backends.cosyvoice.flow_runtime.estimator_graphs import GraphedEstimator
from engine.backends.cosyvoice.frontend.voice_prompts import flow_prompt_of, plain_prompt
from engine.backends.cosyvoice.lm.graphs import StaticDecoder
from engine.backends.cosyvoice.lm.runner import SpeechLMRunner
from engine.backends.cosyvoice.loader import choose_attention, flow_limits
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.flow import CFM, FlowRow, build_flow
from engine.backends.cosyvoice.models.flow_dit import RotaryEmbedding, TimeEmbed, sinus_embedding
from engine.backends.cosyvoice.models.qwen2 import Qwen2Config
from engine.backends.cosyvoice.models.source_noise import NoiseCounter
from engine.backends.cosyvoice.models.speech_lm import SpeechLM
from engine.backends.cosyvoice.t2w.streams import FlowPrompt, T2WConfig, max_chunk_frames, schedule
from engine.backends.cosyvoice.t2w.vocoder import V2VocoderState
from engine.backends.cosyvoice.t2w.worker import WaveChunk, chunks_to_host
from engine.types import RequestId, SynthesisRequest
from tests.support.cosyvoice_parity import (
    fixture_dir,
    one_torch_thread,  # noqa: F401 (autouse)
)
from tests.support.cosyvoice_random_checkpoint import QWEN2_TINY
from tests.support.cosyvoice_tiny import REFERENCE_TEXT, reference_wav, tiny_model_dir
from tests.support.server import REPO

_ids = itertools.count()


def tiny_flow() -> Any:
    return build_flow(load_model_dir(fixture_dir(3)))


# -- 1. TensorRT ---------------------------------------------------------------------------------


def test_auto_falls_back_to_cuda_graphs_with_one_warning_line_when_tensorrt_fails(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # stand-in: TensorRT "imports" here, then fails as a missing libnvinfer would
    def broken(*args: Any, **kwargs: Any) -> None:
        raise ImportError("libnvinfer.so.10: cannot open shared object file\nmore detail")

    monkeypatch.setattr(choose, "trt_available", lambda: True)
    monkeypatch.setattr(choose, "install_tensorrt", broken)
    flow = tiny_flow()
    with caplog.at_level(logging.WARNING, logger="voxgate.engine"):
        assert choose.accelerate_flow(flow, "auto", device_type="cuda") == "cuda_graphs"
    assert isinstance(flow.decoder.estimator, GraphedEstimator)
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "TensorRT failed (ImportError: libnvinfer.so.10" in record.getMessage()
    assert "\n" not in record.getMessage()  # one line
    with pytest.raises(ImportError):  # asked for by name: its failure is the caller's
        choose.accelerate_flow(tiny_flow(), "tensorrt", device_type="cuda")


def test_only_the_streaming_engine_is_exported_and_built_with_one_context(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[str, Any]] = []

    def export(estimator: nn.Module, path: Path, streaming: bool) -> Path:
        calls.append(("export", streaming))
        return path

    def engine(onnx_path: Path, *args: Any) -> Path:
        calls.append(("build", onnx_path.name))
        return tmp_path / "engine.plan"

    class FakeTrt(nn.Module):  # stand-in: TensorRT's runtime needs a GPU
        def __init__(self, path: Path, profile: Any, fallback: nn.Module, contexts: int, device: Any) -> None:
            super().__init__()
            calls.append(("contexts", contexts))

    monkeypatch.setattr(choose, "export_estimator", export)
    monkeypatch.setattr(choose, "cached_engine", engine)
    monkeypatch.setattr(choose, "TrtEstimator", FakeTrt)
    monkeypatch.setattr(choose, "trt_available", lambda: True)
    flow = tiny_flow()
    assert choose.accelerate_flow(flow, "tensorrt", cache_dir=tmp_path, device_type="cuda") == "tensorrt"
    assert calls == [("export", True), ("build", "estimator_streaming.onnx"), ("contexts", 1)]


def test_the_gpu_extra_pins_tensorrt_10_and_installs_one_onnxruntime() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    gpu = project["optional-dependencies"]["gpu"]
    trt = [r for r in gpu if r.startswith("tensorrt")]
    assert len(trt) == 1 and re.match(r"tensorrt(-cu13)?==10\.\d+", trt[0]), trt  # 11 removed BuilderFlag.FP16
    runtimes = [r for r in [*project["dependencies"], *gpu] if r.startswith("onnxruntime")]
    assert len(runtimes) == 1, runtimes  # onnxruntime and onnxruntime-gpu are one module: they collide


# -- 2. Shape limits ------------------------------------------------------------------------------


def test_the_flow_prompt_is_bounded_and_the_frame_limit_follows_from_it() -> None:
    with pytest.raises(ValueError, match="at most 750 prompt tokens"):
        FlowPrompt(torch.zeros(751, dtype=torch.long), torch.zeros(10, 80), torch.zeros(192))
    config = T2WConfig()
    limit = max_chunk_frames(config)
    assert limit == 2 * (750 + 124 + 34 + 3)
    for prompt in (1, 20, 149, 750):  # every row the schedule makes fits, whatever the prompt
        for history_start, start, end in schedule(prompt, 3000, config):
            assert 2 * (prompt + end + 3 - history_start) <= limit
    rows, frames = flow_limits(CosyVoiceBackendConfig(model_dir=Path("m"), device="cpu"), config, 25, 3)
    assert frames == 1856 and frames % 64 == 0 and rows == 2 * 16
    assert max_chunk_frames(T2WConfig(max_history_tokens=None)) is None  # unbounded: eager past the graphs


# -- 3. CUDA graphs captured at load --------------------------------------------------------------


class _RecordedGraph:  # stand-in for torch.cuda.CUDAGraph: replays the recorded body eagerly
    def __init__(self, body: Any) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


def test_every_lm_bucket_is_captured_at_load_and_serving_never_captures() -> None:
    lm = SpeechLM(2, Qwen2Config.from_dict({"model_type": "qwen2", **QWEN2_TINY})).eval()
    lm.body.reset_rope("cpu")
    runner = SpeechLMRunner(lm, 100, 512, decode_mode="static", kv_bucket=256)
    static = runner.static
    assert isinstance(static, StaticDecoder)
    assert static.batch_buckets == [1, 2, 4, 8, 16, 32, 64, 96, 100]  # multiples of 32 above 64
    captured: list[tuple[int, int]] = []

    def capture(b: int, kv: int) -> None:
        captured.append((b, kv))
        static.graphs[(b, kv)] = _RecordedGraph(lambda: static._body(b, kv))  # type: ignore[assignment]

    static.use_graphs = True
    static.capture = capture  # type: ignore[method-assign]
    assert static.capture_all() == 9 * 2
    assert sorted(captured) == [(b, kv) for b in static.batch_buckets for kv in (256, 512)]
    streams = [runner.add_request([1, 2, 3], seed=i) for i in range(70)]
    for _ in range(3):
        runner.step(streams[:5])
        runner.step(streams)
    assert len(captured) == 18 and static.num_eager == 0


def recording_captures(graphed: GraphedEstimator) -> list[tuple[bool, int, int]]:
    """Stand-in for CUDA (none here): graph mode on, each capture records its bucket's static path."""
    captured: list[tuple[bool, int, int]] = []

    def capture(bucket: tuple[bool, int, int], like: torch.Tensor) -> None:
        captured.append(bucket)
        graphed._static_for(bucket, like)
        graphed.graphs[bucket] = _RecordedGraph(lambda: graphed.outputs.__setitem__(
            bucket, graphed._run_static(bucket)))

    graphed.use_graphs = True
    graphed.capture = capture  # type: ignore[method-assign]
    return captured


def test_every_flow_bucket_is_captured_at_load_and_a_call_never_captures() -> None:
    estimator = tiny_flow().decoder.estimator
    graphed = GraphedEstimator(estimator, max_rows=100, max_frames=128, use_graphs=False)
    assert graphed.rows == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    captured = recording_captures(graphed)
    assert graphed.capture_all(torch.zeros(1), streaming=True) == 9 * 2
    inputs = tuple(torch.randn(70, 80, 50) if i in (0, 2, 5) else a
                   for i, a in enumerate((None, torch.ones(70, 1, 50), None, torch.rand(70),
                                          torch.randn(70, 80), None)))
    with torch.inference_mode():
        got = graphed(*inputs, True)
        want = estimator(*inputs, True)
    assert len(captured) == 18 and graphed.num_eager == 0
    assert torch.allclose(got, want, atol=1e-5)


def test_only_flow_buckets_where_a_graph_pays_are_captured_and_larger_calls_run_unpadded() -> None:
    estimator = tiny_flow().decoder.estimator
    graphed = GraphedEstimator(estimator, max_rows=100, max_frames=128, use_graphs=False,
                               max_graph_row_frames=16 * 64)
    captured = recording_captures(graphed)
    # rows 1-8 at both frame buckets (64, 128), rows 16 at 64 frames only
    assert graphed.capture_all(torch.zeros(1), streaming=True) == 4 * 2 + 1
    assert max(rows * frames for _, rows, frames in captured) <= 16 * 64

    def call(rows: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = (torch.randn(rows, 80, frames), torch.ones(rows, 1, frames), torch.randn(rows, 80, frames),
                  torch.rand(rows), torch.randn(rows, 80), torch.randn(rows, 80, frames))
        with torch.inference_mode():
            return graphed(*inputs, True), estimator(*inputs, True)

    got, want = call(3, 50)  # a graph bucket: replayed
    assert graphed.num_plain == 0 and torch.allclose(got, want, atol=1e-5)
    got, want = call(20, 100)  # 32 rows x 128 frames past the limit: the plain estimator, no padding
    assert graphed.num_plain == 1 and graphed.num_eager == 0 and torch.equal(got, want)
    assert len(captured) == 9  # and no call captured


def test_the_default_limits_capture_119_flow_graphs_not_377() -> None:
    config = CosyVoiceBackendConfig(model_dir=Path("m"), device="cpu", max_batch_size=256, max_streams=256,
                                    max_flow_streams=128)
    rows, frames = flow_limits(config, T2WConfig(first_hop_tokens=config.first_hop_tokens,
                                                 max_history_tokens=config.max_history_tokens), 25, 3)
    assert (rows, frames) == (256, 1856)
    estimator = tiny_flow().decoder.estimator
    for limit, count in ((0, 377), (config.max_flow_graph_row_frames, 119)):
        graphed = GraphedEstimator(estimator, rows, frames, use_graphs=False, max_graph_row_frames=limit)
        assert sum(graphed.has_graph_size((True, r, f)) for r in graphed.rows for f in graphed.frames) == count
    with pytest.raises(ValueError, match="max_flow_graph_row_frames must be >= 0"):
        CosyVoiceBackendConfig(model_dir=Path("m"), max_flow_graph_row_frames=-1)


# -- 4 and 5. The flow thread and the CPU executor -------------------------------------------------


def make_backend(base: Path, **options: object) -> CosyVoiceBackend:
    options = {"tokenizer": "bytes", "sampling": "greedy", "max_batch_size": 4, "num_threads": 1,
               "default_voice_audio": str(reference_wav(base)), "default_voice_text": REFERENCE_TEXT,
               **options}
    backend = create_backend("cosyvoice", model_dir=str(tiny_model_dir(base, 3)), **options)
    assert isinstance(backend, CosyVoiceBackend)
    backend.load()
    return backend


def prepare(backend: CosyVoiceBackend, text: str, deadline: float = 0.0) -> BackendRequest:
    return backend.prepare(SynthesisRequest(RequestId(f"fix-{next(_ids)}"), text, "default", deadline))


def speak(backend: CosyVoiceBackend, items: list[BackendRequest]) -> dict[str, tuple[list[int], np.ndarray]]:
    pcm: dict[str, list[np.ndarray]] = {item.request_id: [] for item in items}
    out, live = {}, list(items)
    for _ in range(3000):
        if not live:
            return out
        for item, result in zip(list(live), backend.step(live), strict=True):
            assert result.error is None, result.error
            pcm[item.request_id].append(result.pcm)
            if result.is_finished:
                assert isinstance(item.state, CosyState)
                out[item.request_id] = (list(item.state.tokens), np.concatenate(pcm[item.request_id]))
                backend.release(item)
                live.remove(item)
    raise AssertionError("expected every request to finish")


def test_flow_on_its_own_thread_speaks_what_the_serial_path_speaks(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp()
    serial, threaded = make_backend(base, flow_thread="off"), make_backend(base, flow_thread="on")
    assert serial.flow_worker is None and threaded.flow_worker is not None
    texts = ("Hello world.", "Hi.", "A somewhat longer sentence, to make several chunks.")
    serial_items = [prepare(serial, t) for t in texts]
    threaded_items = [prepare(threaded, t) for t in texts]
    want, got = speak(serial, serial_items), speak(threaded, threaded_items)
    for a, b in zip(threaded_items, serial_items, strict=True):
        (tokens, pcm), (want_tokens, want_pcm) = got[a.request_id], want[b.request_id]
        assert tokens == want_tokens and len(pcm) == len(want_pcm) > 0
        np.testing.assert_allclose(pcm, want_pcm, atol=1e-4)  # batch company differs: float noise
    threaded.close()


def test_flow_rows_per_step_are_capped_the_earliest_due_stream_first(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = make_backend(tmp_path_factory.getbasetemp(), max_flow_streams=1, flow_thread="off")
    assert backend.model is not None
    t2w = backend.model.t2w
    batches: list[list[str]] = []
    run = t2w.run
    monkeypatch.setattr(t2w, "run", lambda ids: batches.append(list(ids)) or run(ids))
    late, early = prepare(backend, "Hello world.", deadline=9.0), prepare(backend, "Hello world.", deadline=1.0)
    got = speak(backend, [late, early])
    assert batches and all(len(b) == 1 for b in batches)
    assert batches[0] == [str(early.request_id)]  # both ready at once: the more starved goes first
    assert len(got[late.request_id][1]) == len(got[early.request_id][1])


def test_prepare_hands_the_text_frontend_to_the_backends_cpu_executor(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = make_backend(tmp_path_factory.getbasetemp())
    assert backend.model is not None
    frontend = backend.model.frontend
    release, threads = threading.Event(), []
    lm_input = frontend.lm_input

    def slow(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        release.wait(30)
        return lm_input(*args)

    monkeypatch.setattr(frontend, "lm_input", slow)
    item = prepare(backend, "Hello world.")  # returns while the frontend still waits
    assert isinstance(item.state, CosyState) and not item.state.is_input_ready
    release.set()
    tokens, pcm = speak(backend, [item])[item.request_id]
    assert threads and threads[0].startswith("voxgate-cosyvoice-cpu") and tokens and len(pcm)


# -- 6. Host traffic -------------------------------------------------------------------------------


def test_voice_prompt_tensors_are_made_on_the_models_device_once() -> None:
    flow = flow_prompt_of(plain_prompt(3), "meta")
    assert {t.device.type for t in (flow.tokens, flow.mel, flow.embedding)} == {"meta"}


def test_the_flow_batch_reads_nothing_back_from_the_device() -> None:
    # On the meta device any read-back (.item(), int(tensor), a Python loop over a device tensor)
    # raises, as it would stall the GPU; the old infer read lengths back per row.
    flow = tiny_flow().to("meta")
    rows = [FlowRow(torch.arange(n) % 50, torch.zeros(2 * p, 80, device="meta"), torch.zeros(192, device="meta"),
                    3, torch.arange(2 * (n - 3))) for n, p in ((40, 10), (25, 5))]
    mels = flow.infer(rows, streaming=True)
    assert [tuple(m.shape) for m in mels] == [(80, 74), (80, 44)]


def test_one_step_brings_every_chunks_audio_to_the_host_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []
    original = torch.Tensor.cpu

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copies.append(self.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting)
    chunks = [WaveChunk(f"s{i}", torch.full((100 * (i + 1),), float(i)), i == 2, 5, torch.zeros(80, 10))
              for i in range(3)]
    host = chunks_to_host(chunks)
    assert len(copies) == 1 and [len(c.pcm) for c in host] == [100, 200, 300]
    assert [float(c.pcm[0]) for c in host] == [0.0, 1.0, 2.0] and host[2].is_final


def test_cosyvoice_2s_source_noise_is_counter_based_on_the_device() -> None:
    state = V2VocoderState.new(7)  # was a CPU torch.Generator: randn on the host, then a copy per chunk
    assert isinstance(state.noise, NoiseCounter)
    assert state.noise.normal((1, 4800, 9), torch.device("meta")).device.type == "meta"
    whole = NoiseCounter(7).normal((2, 5000), torch.device("cpu"))
    chunked = NoiseCounter(7)
    parts = torch.cat([chunked.normal((1, 5000), torch.device("cpu")), chunked.normal((1, 5000), torch.device("cpu"))])
    assert torch.equal(whole, parts)  # a pure function of (seed, counter): chunking changes nothing
    assert abs(float(whole.mean())) < 0.05 and abs(float(whole.std()) - 1.0) < 0.05
    assert not torch.equal(whole, NoiseCounter(8).normal((2, 5000), torch.device("cpu")))


# -- 7. Precision ----------------------------------------------------------------------------------


def test_the_flow_time_embedding_is_formed_in_float32_and_cast_after_the_sinusoid() -> None:
    embed = TimeEmbed(64).to(torch.bfloat16)
    seen: list[torch.Tensor] = []
    embed.time_mlp[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    t = torch.tensor([0.6137, 0.9951])
    embed(t)
    want = sinus_embedding(t, 256).to(torch.bfloat16)  # float32 argument, then the cast
    rounded = sinus_embedding(t.to(torch.bfloat16), 256).to(torch.bfloat16)  # what bf16 t gave
    assert torch.equal(seen[0], want) and not torch.equal(want, rounded)


def test_the_dit_rotary_frequencies_and_the_solvers_time_stay_float32_in_a_bf16_flow() -> None:
    rotary = RotaryEmbedding(64).to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, RotaryEmbedding(64).inv_freq)
    times: list[torch.Tensor] = []

    class Recorder(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                    spks: torch.Tensor, cond: torch.Tensor, streaming: bool) -> torch.Tensor:
            times.append(t)
            return torch.zeros_like(x)

    cfm = CFM(Recorder(), 10, 0.7, cosine=True)
    z, mu = torch.zeros(1, 80, 4), torch.zeros(1, 80, 4, dtype=torch.bfloat16)
    cfm(z, torch.ones(1, 1, 4, dtype=torch.bfloat16), mu, torch.zeros(1, 80, dtype=torch.bfloat16),
        torch.zeros(1, 80, 4, dtype=torch.bfloat16), True)
    assert {t.dtype for t in times} == {torch.float32}


# -- 8. Defaults sized for the device ----------------------------------------------------------------


def test_batch_caps_default_to_gpu_sizes_on_a_gpu_and_small_ones_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = CosyVoiceBackendConfig(model_dir=Path("m"), device="cpu")
    assert (cpu.batch_size, cpu.num_streams, cpu.flow_streams, cpu.uses_flow_thread) == (8, 16, 16, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # stand-in: no GPU here
    gpu = CosyVoiceBackendConfig(model_dir=Path("m"))
    assert (gpu.batch_size, gpu.num_streams, gpu.flow_streams, gpu.uses_flow_thread) == (256, 512, 128, True)
    assert CosyVoiceBackendConfig(model_dir=Path("m"), max_batch_size=4).num_streams == 8  # asked: kept


# -- 11. bench/gpu_all.sh ---------------------------------------------------------------------------


def test_the_one_device_call_gives_the_flow_bench_a_budget_inside_its_timeout() -> None:
    script = (REPO / "bench" / "gpu_all.sh").read_text(encoding="utf-8")
    flow_s = int(re.search(r"FLOW_S=(\d+)", script).group(1))  # type: ignore[union-attr]
    assert "run gpu_flow_estimator $FLOW_S --budget-s $((FLOW_S - 30))" in script and flow_s > 60


def test_a_256_stream_pipeline_keeps_every_flow_call_within_the_graphs_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # stand-in: no GPU here
    config = CosyVoiceBackendConfig(model_dir=Path("m"), max_batch_size=256, max_streams=256)  # the bench's
    rows, frames = flow_limits(config, T2WConfig(), 25, 3)
    assert config.flow_streams == 128 and rows == 256  # 2 CFG rows per stream: every call fits a graph
    assert frames >= 2 * (150 + 75 + 15)  # the serving sizes the flow bench now measures (480 frames)


# -- 12. Attention without per-shape cuDNN plans --------------------------------------------------


@pytest.fixture
def cudnn_sdp_flag() -> Any:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cudnn_attention_is_off_on_a_gpu_unless_asked_and_the_cpu_is_left_alone(
        cudnn_sdp_flag: Any, caplog: pytest.LogCaptureFixture) -> None:
    # torch's switch is a process-wide flag that a CPU build keeps too: the choice is visible here
    torch.backends.cuda.enable_cudnn_sdp(True)
    choose_attention(torch.device("cpu"), False)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with caplog.at_level(logging.INFO, logger="voxgate.engine"):
        choose_attention(torch.device("cuda"), False)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert "cuDNN kernels off" in caplog.text
    choose_attention(torch.device("cuda"), True)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert CosyVoiceBackendConfig().cudnn_attention is False
    assert CosyVoiceBackendConfig.from_options({"cudnn_attention": "on"}, {}).cudnn_attention is True


def test_the_loader_chooses_the_attention_before_anything_runs(
        monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    from engine.backends.cosyvoice import loader
    from tests.support.cosyvoice_tiny import tiny_options

    events: list[object] = []
    monkeypatch.setattr(loader, "choose_attention", lambda device, cudnn: events.append((device.type, cudnn)))
    real_load_lm = loader.load_speech_lm
    monkeypatch.setattr(loader, "load_speech_lm", lambda *a, **k: (events.append("lm"), real_load_lm(*a, **k))[1])
    config = CosyVoiceBackendConfig.from_options({**tiny_options(tmp_path_factory.getbasetemp()),
                                                  "cudnn_attention": "yes"}, {})
    loader.load_model(config)
    assert events == [("cpu", True), "lm"]  # chosen once, before the first model is built
