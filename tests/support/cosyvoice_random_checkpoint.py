"""Write a CosyVoice model directory with random weights, in the official layout.

For tests and benchmarks that need a fresh checkpoint of some size (the real
Qwen2-0.5B shape, or tiny) without any download: the yaml, the Qwen2
`config.json` and an `llm.pt` whose keys and shapes are exactly those of an
official file, made by voxgate's own `SpeechLM`; with `flow_size` and
`with_frontend` also the flow, the vocoder, tokenizer files and ONNX
stand-ins (cosyvoice_random_parts.py), so the whole backend loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.backends.cosyvoice.model_dir import QWEN_DIR, load_model_dir
from engine.backends.cosyvoice.models.qwen2 import Qwen2Config
from engine.backends.cosyvoice.models.speech_lm import SpeechLM
from tests.support.cosyvoice_random_parts import (
    flow_hift_yaml,
    random_flow_hift_state,
    write_onnx_standins,
    write_tokenizer_files,
)

# CosyVoice-BlankEN as published (Qwen2-0.5B) and a tiny stand-in of the same kind.
QWEN2_05B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32768,
}
QWEN2_TINY: dict[str, Any] = {
    **QWEN2_05B,
    "hidden_size": 32,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}

LLM_YAML = """\
# written by voxgate's random_checkpoint (random weights)
sample_rate: 24000
llm_input_size: {hidden}
llm_output_size: {hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.{llm_class}
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1
"""


def random_speech_lm(
    version: int, qwen: dict[str, Any], seed: int = 0, device: torch.device | str = "cpu"
) -> SpeechLM:
    """A SpeechLM with seeded random weights (torch's default initializers)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            lm = SpeechLM(version, Qwen2Config.from_dict({"model_type": "qwen2", **qwen}))
    lm.body.reset_rope(device)
    return lm.eval()


def write_random_model_dir(
    path: str | Path,
    version: int,
    qwen: dict[str, Any] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
    extra_yaml: str = "",
    extra_files: dict[str, dict[str, torch.Tensor]] | None = None,
    flow_size: str | None = None,
    with_frontend: bool = False,
    device: torch.device | str = "cpu",
) -> Path:
    """Write `cosyvoice{version}.yaml`, `CosyVoice-BlankEN/config.json` and `llm.pt` under `path`.

    Weights are stored in `dtype` (float16 keeps tiny files small, like the
    upstream fixture). `extra_files` maps file names (e.g. "flow.pt") to state
    dicts written beside. `flow_size` ("tiny" or "real") adds the flow and
    HiFT sections and `flow.pt` / `hift.pt`; `with_frontend` adds tokenizer
    files and the ONNX stand-ins (cosyvoice_random_parts.py): together, a directory
    the whole backend loads. `device` is where the random LM weights are made
    (a GPU makes the 0.5B LM in seconds). Returns the directory.
    """
    if version not in (2, 3):
        raise ValueError(f"expected version 2 or 3, got {version}")
    qwen = dict(QWEN2_TINY if qwen is None else qwen)
    root = Path(path)
    (root / QWEN_DIR).mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        **qwen,
    }
    (root / QWEN_DIR / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    llm_class = "Qwen2LM" if version == 2 else "CosyVoice3LM"
    yaml_text = LLM_YAML.format(hidden=qwen["hidden_size"], llm_class=llm_class)
    if flow_size is not None:
        yaml_text += flow_hift_yaml(version, flow_size)
    (root / f"cosyvoice{version}.yaml").write_text(yaml_text + extra_yaml, encoding="utf-8")
    lm = random_speech_lm(version, qwen, seed, device)
    state = {k: v.to("cpu", dtype) for k, v in lm.state_dict().items()}
    del lm
    torch.save(state, root / "llm.pt")
    files = dict(extra_files or {})
    if flow_size is not None:
        model_dir = load_model_dir(root, required_files=("llm.pt",))
        files = {**random_flow_hift_state(model_dir, seed, dtype), **files}  # CPU: a few seconds
    for name, file_state in files.items():
        torch.save(file_state, root / name)
    if with_frontend:
        write_tokenizer_files(root, version)
        write_onnx_standins(root, version, seed)
    return root
