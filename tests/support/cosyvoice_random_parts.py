"""The rest of a random-weight model directory: flow and HiFT, tokenizer files, ONNX stand-ins.

`random_checkpoint.write_random_model_dir(..., full=True)` calls these so that a
directory written for CI holds every file an official one does and the real
loading code runs on all of it:

- the yaml's `flow`, `hift` and `feat_extractor` sections, at the official
  sizes ("real") or at the upstream fixture's tiny sizes ("tiny"), and
  `flow.pt` / `hift.pt` state dicts made by voxgate's own modules (so keys and
  shapes are what `build_flow` / `build_hift` load strict);
- `CosyVoice-BlankEN/vocab.json`, `merges.txt`, `tokenizer_config.json`: a
  byte-level BPE with the 256 single-byte tokens at their Qwen2 ids, no
  merges, and Qwen2's and CosyVoice's special tokens declared at their ids;
- `campplus.onnx` and `speech_tokenizer_v{2,3}.onnx`: tiny graphs with the
  input and output layout the frontend feeds (campplus: fbank [1, T, 80] ->
  embedding [1, 192]; tokenizer: Whisper mel [1, 128, T] and its length ->
  tokens [1, T / 4] at 25 per second, as the real one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.backends.cosyvoice.frontend.tokens import (
    SPECIAL_TOKENS_V2,
    SPECIAL_TOKENS_V3,
    added_token_id,
)
from engine.backends.cosyvoice.model_dir import QWEN_DIR, ModelDir
from tests.support.wav import write_pcm16_wav

SIZES = ("tiny", "real")

# Sizes of the official yamls and of the upstream fixture's tiny ones (its README).
_V3_SIZES = {"real": {"pl": 1024, "dim": 1024, "depth": 22, "heads": 16, "dim_head": 64,
                      "hift": 512},
             "tiny": {"pl": 64, "dim": 64, "depth": 2, "heads": 4, "dim_head": 16, "hift": 32}}
_V2_SIZES = {"real": {"units": 2048, "blocks": 6, "channels": 256, "head_dim": 64, "n_blocks": 4,
                      "mid": 12, "heads": 8, "hift": 512},
             "tiny": {"units": 256, "blocks": 1, "channels": 32, "head_dim": 16, "n_blocks": 1,
                      "mid": 2, "heads": 2, "hift": 32}}

_CFM = """\
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
"""

_FLOW_V3 = """
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {pl}
        pre_lookahead_len: 3
{cfm}        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dim}
            depth: {depth}
            heads: {heads}
            dim_head: {dim_head}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>
"""

_FLOW_V2 = """
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        attention_heads: 8
        linear_units: {units}
        num_blocks: {blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: 512
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
{cfm}        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{channels}]
            dropout: 0.0
            attention_head_dim: {head_dim}
            n_blocks: {n_blocks}
            num_mid_blocks: {mid}
            num_heads: {heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>
"""

_HIFT = """
hift: !new:cosyvoice.hifigan.generator.{generator}
    in_channels: 80
    base_channels: {hift}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
{look_right}    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.{f0}
        num_class: 1
        in_channels: 80
        cond_channels: {hift}

feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: {fmax}
    center: False
"""


def flow_hift_yaml(version: int, size: str) -> str:
    """The yaml sections of the flow, the vocoder and the prompt mel, at `size`."""
    if size not in SIZES:
        raise ValueError(f"expected size one of {SIZES}, got {size!r}")
    if version == 3:
        flow = _FLOW_V3.format(cfm=_CFM, **_V3_SIZES[size])
        hift = _HIFT.format(generator="CausalHiFTGenerator", f0="CausalConvRNNF0Predictor",
                            look_right="    conv_pre_look_right: 4\n", fmax="null",
                            hift=_V3_SIZES[size]["hift"])
    elif version == 2:
        flow = _FLOW_V2.format(cfm=_CFM, **_V2_SIZES[size])
        hift = _HIFT.format(generator="HiFTGenerator", f0="ConvRNNF0Predictor", look_right="",
                            fmax=8000, hift=_V2_SIZES[size]["hift"])
    else:
        raise ValueError(f"expected version 2 or 3, got {version}")
    return flow + hift


def random_flow_hift_state(
        model_dir: ModelDir, seed: int, dtype: torch.dtype,
        device: torch.device | str = "cpu") -> dict[str, dict[str, torch.Tensor]]:
    """`flow.pt` and `hift.pt` state dicts with seeded random weights, from the directory's yaml."""
    from engine.backends.cosyvoice.models.flow import FlowModel
    from engine.backends.cosyvoice.models.hift import HiFT, HiFTConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            flow = FlowModel(model_dir.version, model_dir.section("flow"))
            hift = HiFT(HiFTConfig.from_hparams(model_dir.section("hift"), model_dir.version))
    return {
        "flow.pt": {k: v.to("cpu", dtype) for k, v in flow.state_dict().items()},
        # float64/complex buffers stay as they are; weights are stored in `dtype`
        "hift.pt": {k: (v.to("cpu", dtype) if v.is_floating_point() else v.cpu())
                    for k, v in hift.state_dict().items()},
    }


def write_tokenizer_files(root: Path, version: int) -> None:
    """A byte-level BPE in Qwen2's file layout: 256 byte tokens at their ids, no merges."""
    from engine.backends.cosyvoice.frontend.frontend import QWEN_SPECIALS, byte_to_unicode

    table = byte_to_unicode()
    order = sorted(range(256), key=lambda b: (ord(table[b]) >= 256, ord(table[b])))
    vocab = {table[b]: i for i, b in enumerate(order)}
    qwen = root / QWEN_DIR
    (qwen / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (qwen / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    specials = dict(QWEN_SPECIALS)
    for token in SPECIAL_TOKENS_V2 if version == 2 else SPECIAL_TOKENS_V3:
        if token not in specials:
            specials[token] = added_token_id(token, version)
    config: dict[str, Any] = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 32768,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "errors": "replace",
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for t, i in sorted(specials.items(), key=lambda kv: kv[1])
        },
    }
    (qwen / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False),
                                                encoding="utf-8")


def write_onnx_standins(root: Path, version: int, seed: int = 0) -> None:
    """campplus.onnx and speech_tokenizer_v{version}.onnx: tiny graphs, official input layout."""
    import onnx
    from onnx import TensorProto, helper

    def save(graph: Any, name: str) -> None:
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.save(model, str(root / name))

    weight = np.random.default_rng(seed).standard_normal((80, 192)).astype(np.float32) / 8
    # campplus: the time-mean of the fbank through a fixed random projection
    save(helper.make_graph(
        [helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1], keepdims=0),
         helper.make_node("MatMul", ["mean", "w"], ["output"])],
        "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, None, 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
        [helper.make_tensor("w", TensorProto.FLOAT, [80, 192], weight.reshape(-1).tolist())],
    ), "campplus.onnx")
    # speech tokenizer: average 4 Whisper frames (100 -> 25 per second), the loudest bin is the
    # token
    pool = np.full((128, 1, 4), 0.25, dtype=np.float32)
    save(helper.make_graph(
        [helper.make_node("Conv", ["feats", "pool"], ["pooled"], group=128, kernel_shape=[4],
                          strides=[4]),
         helper.make_node("ArgMax", ["pooled"], ["indices"], axis=1, keepdims=0)],
        "speech_tokenizer_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, None]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, None])],
        [helper.make_tensor("pool", TensorProto.FLOAT, [128, 1, 4], pool.reshape(-1).tolist())],
    ), f"speech_tokenizer_v{version}.onnx")


def voiced_signal(seconds: float, rate: int, f0: float = 140.0) -> np.ndarray:
    """A vowel-like stand-in for reference speech: harmonics of a gliding f0 under a syllable
    envelope."""
    t = np.arange(int(seconds * rate)) / rate
    pitch = f0 * (1 + 0.1 * np.sin(2 * np.pi * 0.7 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    wav = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t) ** 2
    return (0.25 * wav * envelope).astype(np.float32)


def write_reference_wav(path: Path, seconds: float = 1.6, rate: int = 16000) -> Path:
    """`voiced_signal` as a 16-bit mono WAV: a default voice to clone for random model
    directories."""
    write_pcm16_wav(path, np.clip(voiced_signal(seconds, rate) * 32767, -32768,
                                  32767).astype("<i2"), rate)
    return path
