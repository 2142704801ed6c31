"""Loading the speech LM from an official model directory: `llm.pt` into `SpeechLM`, strictly.

The yaml's LM section must agree with the Qwen2 config (input and output sizes
are the body's hidden size); every tensor is checked by name and shape before
loading, so a checkpoint of the other version or size is named, not half-loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.backends.cosyvoice.model_dir import ModelDir
from engine.backends.cosyvoice.models.qwen2 import Qwen2Config
from engine.backends.cosyvoice.models.speech_lm import SpeechLM
from engine.errors import ModelLoadError


def _check_state_dict(module: SpeechLM, state: dict[str, Any], source: str) -> None:
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    if missing:
        raise ModelLoadError(
            f"{source}: expected tensor {missing[0]} ({len(missing)} missing), got none"
        )
    if unexpected:
        raise ModelLoadError(
            f"{source}: expected only the tensors of the CosyVoice {module.spec.version} LM, "
            f"got unexpected {unexpected[0]} ({len(unexpected)} in all; a checkpoint of the other "
            "version?)"
        )
    for key, shape in want.items():
        if got[key] != shape:
            raise ModelLoadError(
                f"{source}: expected {key} of shape {list(shape)}, got {list(got[key])}"
            )


def load_speech_lm(
    model_dir: ModelDir,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    drop_text_head: bool = True,
) -> SpeechLM:
    """Build the LM from the directory's yaml and Qwen2 config and load `llm.pt` strictly.

    `drop_text_head` frees the Qwen2 text `lm_head` after loading (the speech
    LM never reads it; it is 136M parameters at 0.5B size).
    """
    llm = model_dir.section("llm")
    qwen = Qwen2Config.from_dict(model_dir.qwen_config())
    for name in ("llm_input_size", "llm_output_size"):
        if int(llm.get(name, qwen.hidden_size)) != qwen.hidden_size:
            raise ModelLoadError(
                f"{model_dir.yaml_path.name}: expected llm.{name} = Qwen2 hidden_size "
                f"{qwen.hidden_size}, got {llm.get(name)}"
            )
    speech_token_size = int(llm.get("speech_token_size", 6561))
    with torch.device("meta"):
        lm = SpeechLM(model_dir.version, qwen, speech_token_size)
    state = model_dir.load_checkpoint("llm.pt")
    _check_state_dict(lm, state, str(model_dir.path / "llm.pt"))
    try:
        lm.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # already checked; kept for anything torch adds
        raise ModelLoadError(f"{model_dir.path / 'llm.pt'}: {exc}") from exc
    if drop_text_head:
        lm.body.lm_head.weight = nn.Parameter(torch.empty(0, qwen.hidden_size), requires_grad=False)
    lm = lm.to(device=device, dtype=dtype)
    lm.body.reset_rope(device)  # float32 tables whatever the weights' dtype
    lm.requires_grad_(False)
    return lm.eval()
