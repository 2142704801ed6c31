"""The flow estimator as ONNX (against torch), the CUDA-graph bucket padding, the TensorRT plumbing.

Tolerance: 1e-4 absolute, on estimator outputs of magnitude 2-4 and on mel.
Both sides compute in float32 with different kernels (onnxruntime fuses and
reorders the matmuls, layer norms and softmax), so they differ by float32
rounding, not by any change of function: measured 3e-5 at worst (U-Net), 2e-6
(DiT). 1e-4 is also what upstream's own code meets against the fixture
(its README), and a real error (a wrong mask, a dropped term) is orders of
magnitude larger.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu_flow_estimator
from engine.backends.cosyvoice.buckets import row_buckets
from engine.backends.cosyvoice.flow_runtime.choose import accelerate_flow, choose_runtime
from engine.backends.cosyvoice.flow_runtime.estimator_graphs import (
    GraphedEstimator,
    frame_buckets,
    pad_inputs,
)
from engine.backends.cosyvoice.flow_runtime.estimator_onnx import (
    INPUT_NAMES,
    OnnxEstimator,
    example_inputs,
    export_estimators,
    onnx_paths,
    use_estimator,
)
from engine.backends.cosyvoice.flow_runtime.estimator_trt import (
    ContextPool,
    TrtProfile,
    engine_file_name,
    file_digest,
)
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.flow import FlowModel, FlowRow, build_flow
from tests.support.cosyvoice_parity import (
    assert_close_report,
    fixture_dir,
    one_torch_thread,  # noqa: F401 (autouse)
)

ATOL = 1e-4
# (CFG rows, mel frames): odd, tiny, and longer than the export's 64
SHAPES = [(2, 60), (6, 37), (1, 131), (4, 2)]


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def exported(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[FlowModel, Any]:
    """The fixture's flow, its estimator exported in both attention modes, and the onnxruntime
    runner."""
    model_dir = load_model_dir(fixture_dir(request.param))
    flow = build_flow(model_dir)
    folder = tmp_path_factory.mktemp(f"onnx_v{request.param}")
    export_estimators(flow.decoder.estimator, folder)
    return flow, OnnxEstimator(onnx_paths(folder), num_threads=1)


@pytest.mark.parametrize("streaming", [True, False], ids=["chunked", "full"])
def test_onnx_estimator_matches_torch_at_every_batch_size_and_length(
        exported: Any, streaming: bool) -> None:
    flow, runner = exported
    assert tuple(i.name for i in runner.sessions[streaming].get_inputs()) == INPUT_NAMES
    for rows, frames in SHAPES:
        inputs = example_inputs(rows, frames, seed=rows * frames, num_padded=1 if frames > 2 else 0)
        with torch.inference_mode():
            want = flow.decoder.estimator(*inputs, streaming)
        got = runner(*inputs, streaming)
        assert got.shape == (rows, 80, frames)
        assert_close_report(f"estimator_v{flow.version}.onnx[{rows}x{frames}, "
                            f"streaming={streaming}]",
                            got, want, ATOL)


def test_the_flow_with_the_onnx_estimator_gives_the_torch_flows_mel(exported: Any) -> None:
    """Ten Euler steps with CFG through onnxruntime, on a ragged batch: the mel within 1e-4."""
    flow, runner = exported
    ref = torch.load(fixture_dir(flow.version) / "reference.pt", weights_only=True)
    tokens = torch.cat([ref["prompt_speech_token"][0], ref["flow_token"][0]])
    rows = [FlowRow(tokens, ref["prompt_feat"][0], ref["embedding"][0], 3,
                    torch.arange(2 * (tokens.shape[0] - 3))),
            FlowRow(tokens[:33], ref["prompt_feat"][0, :30], -ref["embedding"][0], 0,
                    torch.arange(20, 86))]
    for streaming in (True, False):
        want = flow.infer(rows, streaming=streaming)
        torch_estimator = use_estimator(flow, runner)
        try:
            got = flow.infer(rows, streaming=streaming)
        finally:
            use_estimator(flow, torch_estimator)
        for i in range(len(rows)):
            assert_close_report(f"flow_v{flow.version}.onnx_mel[{i}] streaming={streaming}", got[i],
                                want[i], ATOL)


def test_onnx_estimator_refuses_a_mode_it_has_no_graph_for(exported: Any) -> None:
    _, runner = exported
    only_chunked = OnnxEstimator({True: runner.paths[True]}, num_threads=1)
    with pytest.raises(ValueError, match="expected an exported offline graph"):
        only_chunked(*example_inputs(2, 8), False)


def test_onnx_paths_names_the_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="estimator_streaming.onnx"):
        onnx_paths(tmp_path)


def test_use_estimator_refuses_what_is_not_a_flow() -> None:
    with pytest.raises(TypeError, match="expected a FlowModel"):
        use_estimator(torch.nn.Linear(2, 2), torch.nn.Identity())


# -- CUDA graphs: bucketing and padding (the capture itself needs a GPU:
# bench/gpu_flow_estimator.py) --


def test_row_buckets_are_powers_of_two_to_64_then_multiples_of_32_ending_at_the_maximum() -> None:
    # issue 19 item 3
    assert row_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert row_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert row_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert frame_buckets(200, 64) == [64, 128, 192, 200]


def test_padding_rows_get_a_full_mask_and_padding_frames_none() -> None:
    x, mask, *_ = pad_inputs(example_inputs(3, 10, num_padded=1), rows=4, frames=16)
    assert x.shape == (4, 80, 16) and mask.shape == (4, 1, 16)
    assert mask[0, 0].tolist() == [1.0] * 5 + [0.0] * 11  # its own padding, then the bucket's
    assert mask[1, 0].tolist() == [1.0] * 10 + [0.0] * 6
    assert mask[3, 0].tolist() == [1.0] * 16  # a padding row: never an all-masked softmax
    assert float(x[:, :, 10:].abs().sum()) == 0.0


@pytest.mark.parametrize("version", [2, 3])
def test_the_bucketed_static_path_equals_the_plain_estimator(version: int) -> None:
    """Rows and frames padded up to their buckets change no valid output (the graph path, run
    eagerly)."""
    estimator = build_flow(load_model_dir(fixture_dir(version))).decoder.estimator
    static = GraphedEstimator(estimator, max_rows=8, max_frames=96, frame_step=32, use_graphs=False)
    for streaming in (True, False):
        for rows, frames in [(3, 37), (6, 70), (1, 5)]:
            inputs = example_inputs(rows, frames, seed=frames, num_padded=1)
            with torch.inference_mode():
                want = estimator(*inputs, streaming)
            got = static(*inputs, streaming)
            assert_close_report(f"estimator_v{version}.static[{rows}x{frames}]", got, want, 1e-5)
    assert sorted(static.static) == [(s, r, f) for s in (False, True)
                                     for r, f in [(1, 32), (4, 64), (8, 96)]]
    assert static.num_fallbacks == 0


def test_more_rows_than_the_largest_bucket_split_and_more_frames_run_the_plain_estimator() -> None:
    """Issue 19 item 2: a shape limit never fails a call (it used to raise in TensorRT, and rows
    went eager)."""
    estimator = build_flow(load_model_dir(fixture_dir(3))).decoder.estimator
    static = GraphedEstimator(estimator, max_rows=2, max_frames=16, use_graphs=False)
    rows = example_inputs(5, 8, seed=1)
    with torch.inference_mode():
        assert_close_report("estimator.split", static(*rows, True), estimator(*rows, True), 1e-5)
    assert static.num_fallbacks == 0 and sorted(static.static) == [(True, 1, 16), (True, 2, 16)]
    frames = example_inputs(2, 40, seed=2)
    with torch.inference_mode():
        assert_close_report("estimator.fallback", static(*frames, True), estimator(*frames, True),
                            0.0)
    assert static.num_fallbacks == 1


def test_cuda_graphs_need_a_cuda_estimator() -> None:
    estimator = build_flow(load_model_dir(fixture_dir(3))).decoder.estimator
    with pytest.raises(ValueError, match="expected the estimator on a CUDA device"):
        GraphedEstimator(estimator)


# -- TensorRT: everything but the engine itself (no GPU here) --


def test_trt_profile_gives_each_input_its_min_opt_max_shape() -> None:
    profile = TrtProfile(min_rows=2, opt_rows=8, max_rows=16, min_frames=4, opt_frames=100,
                         max_frames=300)
    assert profile.shapes("x") == ((2, 80, 4), (8, 80, 100), (16, 80, 300))
    assert profile.shapes("mask") == ((2, 1, 4), (8, 1, 100), (16, 1, 300))
    assert profile.shapes("t") == ((2,), (8,), (16,))
    assert profile.shapes("spks") == ((2, 80), (8, 80), (16, 80))
    assert profile.accepts(16, 300) and not profile.accepts(1, 100) and not profile.accepts(8, 301)
    with pytest.raises(ValueError, match="expected one of"):
        profile.shapes("noise")


def test_trt_profile_rejects_bounds_out_of_order() -> None:
    with pytest.raises(ValueError, match="min_rows <= opt_rows <= max_rows"):
        TrtProfile(min_rows=4, opt_rows=2)
    with pytest.raises(ValueError, match="min_frames <= opt_frames <= max_frames"):
        TrtProfile(opt_frames=2000)


def test_the_engine_cache_key_changes_with_each_thing_that_changes_the_engine() -> None:
    base = ("abc123" * 4, "NVIDIA H200", (9, 0), "10.9.0", TrtProfile(), "fp16")
    name = engine_file_name(*base)
    assert name.endswith(".plan") and "NVIDIA-H200-sm90" in name and "/" not in name
    variants = [("ffff" * 6,) + base[1:], base[:1] + ("NVIDIA A100-SXM4-80GB",) + base[2:],
                base[:2] + ((8, 0),) + base[3:], base[:3] + ("10.10.0",) + base[4:],
                base[:4] + (TrtProfile(max_rows=128),) + base[5:], base[:5] + ("bf16",)]
    names = {engine_file_name(*v) for v in variants}
    assert len(names) == len(variants) and name not in names
    with pytest.raises(ValueError, match="expected precision"):
        engine_file_name(*base[:5], "int4")


def test_the_onnx_digest_covers_its_external_data_file(tmp_path: Path) -> None:
    graph = tmp_path / "e.onnx"
    graph.write_bytes(b"graph")
    alone = file_digest(graph)
    (tmp_path / "e.onnx.data").write_bytes(b"weights")
    with_data = file_digest(graph)
    (tmp_path / "e.onnx.data").write_bytes(b"other weights")
    assert len({alone, with_data, file_digest(graph)}) == 3


def test_the_context_pool_lets_as_many_calls_run_at_once_as_it_has_contexts() -> None:
    """Two contexts, two threads: both hold one at the same time (a single shared context would
    deadlock the barrier), a third caller waits and times out, and every context comes back."""
    pool = ContextPool(["ctx0", "ctx1"])
    both_in = threading.Barrier(3, timeout=10)
    held: list[str] = []

    def call() -> None:
        with pool.borrow(timeout=10) as ctx:
            held.append(ctx)
            both_in.wait()  # released only when both calls hold a context at once
            both_in.wait()

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    both_in.wait()
    assert sorted(held) == ["ctx0", "ctx1"] and pool.num_free() == 0
    with pytest.raises(TimeoutError, match="free execution context"), pool.borrow(timeout=0.05):
        pass
    both_in.wait()
    for t in threads:
        t.join()
    assert pool.num_free() == 2
    with pytest.raises(ValueError, match="at least one"):
        ContextPool([])


@pytest.mark.parametrize(("requested", "device", "has_trt", "chosen"), [
    ("auto", "cuda", True, "tensorrt"), ("auto", "cuda", False, "cuda_graphs"),
    ("auto", "cpu", True, "torch"),
    ("torch", "cuda", True, "torch"), ("cuda_graphs", "cuda", True, "cuda_graphs")])
def test_auto_picks_tensorrt_then_cuda_graphs_then_torch(requested: str, device: str, has_trt: bool,
                                                         chosen: str) -> None:
    assert choose_runtime(requested, device, has_trt) == chosen


def test_asking_for_a_runtime_the_machine_lacks_says_what_is_missing() -> None:
    with pytest.raises(ValueError, match="expected the tensorrt package"):
        choose_runtime("tensorrt", "cuda", False)
    with pytest.raises(ValueError,
                       match="expected a CUDA device for the cuda_graphs estimator, got cpu"):
        choose_runtime("cuda_graphs", "cpu", True)
    with pytest.raises(ValueError, match="expected a flow estimator runtime"):
        choose_runtime("onnx", "cuda", True)


def test_accelerate_flow_on_the_cpu_keeps_the_torch_estimator() -> None:
    flow = build_flow(load_model_dir(fixture_dir(3)))
    before = flow.decoder.estimator
    assert accelerate_flow(flow) == "torch"
    assert flow.decoder.estimator is before


def test_the_gpu_benchmark_runs_every_mode_in_its_cpu_smoke_mode(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        result = gpu_flow_estimator.main(["--smoke", "--json", str(tmp_path / "flow.json")])
    finally:
        torch.set_num_threads(before)
    assert result["errors"] == {}
    assert [(r["mode"], r["streams"]) for r in result["rows"]] == [
        (m, n) for m in ("eager", "static", "onnxruntime") for n in (1, 2)]
    assert all(r["ms"] > 0 and r["rel_rms_vs_eager"] < 1e-4 for r in result["rows"])
    assert [c["mode"] for c in result["concurrency"]] == ["eager", "static"]
    assert "| 2 | 4 |" in capsys.readouterr().out
    assert (tmp_path / "flow.json").is_file()


def test_the_benchmark_skips_tensorrt_when_its_time_budget_is_spent() -> None:
    args = argparse.Namespace(cache_dir="bench/out/trt-cache")
    with pytest.raises(TimeoutError, match="rerun with the cache"):
        gpu_flow_estimator.prepare_engine_within(args, 2, 0.0)
