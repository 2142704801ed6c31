"""Export the CosyVoice speech LM as a folder that vLLM loads as a stock Qwen2 model.

vLLM serves the LM with prompt embeddings: the prompt row
`[sos, text, task, prompt speech]` (SpeechLM.prompt_embeds) goes in as
embeddings, and every token vLLM samples is fed back through the model's
`embed_tokens`. So the folder is a Qwen2ForCausalLM whose vocabulary is the
*speech* vocabulary (upstream's `export_cosyvoice2_vllm` does the same):

    model.embed_tokens.weight  = speech_embedding.weight   [V, D]
    model.layers.*, model.norm = the Qwen2 body             (unchanged)
    lm_head.weight             = llm_decoder.weight         [V, D]
    config.json                  the body's Qwen2 config, vocab_size = V,
                                 untied head, no bos/eos

V is 6561 + 3 (CosyVoice 2) or 6561 + 200 (CosyVoice 3).

CosyVoice 2's head has a bias and vLLM's Qwen2 head has none. Upstream
registers its own model class (a Qwen2 with a biased head) in vLLM's
ModelRegistry; that registration must then happen in vLLM's engine process
too, which a spawned process does not inherit. Here the bias goes to
`voxgate/lm_head_bias.safetensors` and the speech logits processor (vllm_lm.py), which
vLLM imports by name in its engine process, adds it to the logits. The sum is
the same float32 addition, so greedy tokens are unchanged.

`voxgate_speech_lm.json` records what that processor and the caller need: the
version, the stop ids and the index upstream masks before the minimum length.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.backends.cosyvoice.models.speech_lm import SpeechLM

META_FILE = "voxgate_speech_lm.json"
# In a subfolder: vLLM loads every *.safetensors at the top level as model weights.
BIAS_FILE = "voxgate/lm_head_bias.safetensors"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1
# vLLM's CPU attention kernels take only these head sizes (vLLM 0.32,
# CPUAttentionBackend.get_supported_head_sizes); GPU backends take more.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def qwen2_config(
    lm: SpeechLM, dtype: torch.dtype, max_model_len: int | None = None
) -> dict[str, Any]:
    """The HF config.json of the exported model (speech vocabulary, untied head)."""
    body = lm.body.config  # Qwen2Config of models/qwen2.py
    max_pos = int(body.max_position_embeddings if max_model_len is None else max_model_len)
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": lm.spec.num_rows,
        "hidden_size": body.hidden_size,
        "intermediate_size": body.intermediate_size,
        "num_hidden_layers": body.num_hidden_layers,
        "num_attention_heads": body.num_attention_heads,
        "num_key_value_heads": body.num_key_value_heads,
        "hidden_act": "silu",
        "rms_norm_eps": body.rms_norm_eps,
        "rope_theta": body.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max_pos,
        "max_window_layers": body.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def speech_lm_meta(lm: SpeechLM) -> dict[str, Any]:
    """What the logits processor and the caller read back from the folder."""
    spec = lm.spec
    return {
        "format": FORMAT_VERSION,
        "version": spec.version,
        "speech_token_size": spec.speech_token_size,
        "vocab_size": spec.num_rows,
        "stop_token_ids": list(range(spec.speech_token_size, spec.num_rows)),
        "min_length_mask_index": spec.min_length_mask_index,
        "has_head_bias": lm.llm_decoder.bias is not None,
        "hidden_size": lm.body.config.hidden_size,
        "head_dim": lm.body.config.head_dim,
    }


def export_state(lm: SpeechLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Qwen2ForCausalLM keys -> contiguous tensors of `dtype` (the text embedding and head are
    dropped)."""
    state: dict[str, torch.Tensor] = {}
    for key, value in lm.body.model.state_dict().items():
        if key == "embed_tokens.weight":
            continue  # the text vocabulary: prompts arrive as embeddings
        state[f"model.{key}"] = value
    state["model.embed_tokens.weight"] = lm.speech_embedding.weight  # [V, D]
    state["lm_head.weight"] = lm.llm_decoder.weight  # [V, D]
    return {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in state.items()}


def export_for_vllm(
    lm: SpeechLM,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_model_len: int | None = None,
) -> Path:
    """Write the folder vLLM loads (`AsyncEngineArgs(model=out_dir)`) and return its path.

    Written to a temporary sibling first and renamed into place, so a folder
    that exists is complete. An existing `out_dir` is replaced.
    """
    from safetensors.torch import save_file

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"expected dtype float32, bfloat16 or float16, got {dtype}")
    if lm.body.config.num_attention_heads * lm.body.config.head_dim != lm.body.config.hidden_size:
        raise ValueError("expected hidden_size = heads x head_dim (vLLM's Qwen2 derives head_dim)")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(export_state(lm, dtype), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if lm.llm_decoder.bias is not None:
            bias = (
                lm.llm_decoder.bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
            )  # [V]
            (tmp / BIAS_FILE).parent.mkdir()
            save_file({"bias": bias}, str(tmp / BIAS_FILE))
        config = qwen2_config(lm, dtype, max_model_len)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / META_FILE).write_text(
            json.dumps(speech_lm_meta(lm), indent=2) + "\n", encoding="utf-8"
        )
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_meta(folder: str | Path) -> dict[str, Any]:
    """The exported folder's `voxgate_speech_lm.json`, checked."""
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise ValueError(f"expected {path} (a folder written by export_for_vllm), got none")
    meta = json.loads(path.read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"expected {META_FILE} format {FORMAT_VERSION}, got {meta.get('format')}")
    return dict(meta)


def read_head_bias(folder: str | Path) -> torch.Tensor | None:
    """The speech head's bias [V] in float32, or None (CosyVoice 3 has none)."""
    if not read_meta(folder)["has_head_bias"]:
        return None
    from safetensors.torch import load_file

    bias: torch.Tensor = load_file(str(Path(folder) / BIAS_FILE))["bias"]
    return bias
