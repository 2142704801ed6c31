"""CosyVoice model directories: version detection, the yaml read as data, loader errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine.backends.cosyvoice.hyperyaml import YamlRefError, load_hyperyaml
from engine.backends.cosyvoice.model_dir import detect_version, load_model_dir
from engine.backends.cosyvoice.models.speech_lm_load import load_speech_lm
from engine.errors import ModelLoadError
from tests.support.cosyvoice_parity import copy_model_dir, fixture_dir
from tests.support.cosyvoice_random_checkpoint import (
    QWEN2_TINY,
    random_speech_lm,
    write_random_model_dir,
)


@pytest.mark.parametrize("version", [2, 3])
def test_official_layout_loads_with_its_version_and_hyperparameters(version: int) -> None:
    model_dir = load_model_dir(fixture_dir(version))
    assert model_dir.version == version
    assert model_dir.path == fixture_dir(version)
    llm = model_dir.hparams["llm"]
    assert llm["_target"].endswith("Qwen2LM" if version == 2 else "CosyVoice3LM")
    assert llm["speech_token_size"] == 6561
    assert llm["llm_input_size"] == 32  # resolved from !ref <llm_input_size>
    assert llm["sampling"] == {
        "_kind": "name",
        "_target": "cosyvoice.utils.common.ras_sampling",
        "top_p": 0.8,
        "top_k": 25,
        "win_size": 10,
        "tau_r": 0.1,
    }
    assert llm["llm"]["pretrain_path"] == str(fixture_dir(version) / "CosyVoice-BlankEN")
    assert model_dir.hparams["sample_rate"] == 24000
    assert model_dir.qwen_config()["num_key_value_heads"] == 2
    assert model_dir.speech_tokenizer_path.name == f"speech_tokenizer_v{version}.onnx"


def test_ref_arithmetic_is_computed_in_the_v3_dit_chunk_size() -> None:
    estimator = load_model_dir(fixture_dir(3)).hparams["flow"]["decoder"]["estimator"]
    assert estimator["static_chunk_size"] == 25 * 2  # !ref <chunk_size> * <token_mel_ratio>


def test_yaml_tags_become_data_and_run_no_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    doc = load_hyperyaml(
        f"""
a: 3
b: !ref <a>
c: !ref (<a> + 1) * <b> // 2
path: !ref <root>/file.txt
root: /models
eps: 1e-5
seed: !apply:os.system ["touch {marker}"]
obj: !new:pkg.Cls
    size: !ref <a>
    inner: !name:pkg.fn
whole: !ref <obj>
item: !ref <obj[size]>
"""
    )
    assert not marker.exists()
    assert doc["b"] == 3 and doc["c"] == 6
    assert doc["path"] == "/models/file.txt"
    assert doc["eps"] == pytest.approx(1e-5)
    assert doc["seed"] == {"_kind": "apply", "_target": "os.system", "_args": [f"touch {marker}"]}
    assert doc["obj"] == {
        "_kind": "new",
        "_target": "pkg.Cls",
        "size": 3,
        "inner": {"_kind": "name", "_target": "pkg.fn"},
    }
    assert doc["whole"] == doc["obj"] and doc["item"] == 3


def test_yaml_overrides_replace_keys_before_references_resolve() -> None:
    doc = load_hyperyaml("p: ''\nq: !ref <p>/x\n", {"p": "/dir"})
    assert doc["q"] == "/dir/x"


@pytest.mark.parametrize("text", ["a: !ref <missing>\n", "a: !ref <b>\nb: !ref <a>\n"])
def test_yaml_reference_to_nothing_or_itself_is_an_error(text: str) -> None:
    with pytest.raises(YamlRefError):
        load_hyperyaml(text)


def test_missing_directory_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model_dir(tmp_path / "nothing")


def test_directory_without_yaml_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError, match="expected cosyvoice2.yaml or cosyvoice3.yaml, got neither"
    ):
        detect_version(tmp_path)


def test_cosyvoice1_directory_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "cosyvoice.yaml").write_text("a: 1\n")
    with pytest.raises(ModelLoadError, match="CosyVoice 1"):
        load_model_dir(tmp_path)


def test_directory_with_both_yamls_is_ambiguous(tmp_path: Path) -> None:
    model = copy_model_dir(2, tmp_path / "m")
    shutil.copy(fixture_dir(3) / "cosyvoice3.yaml", model / "cosyvoice3.yaml")
    with pytest.raises(ModelLoadError, match="got both"):
        load_model_dir(model)


def test_wrong_expected_version_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="expected a CosyVoice 3 directory, got CosyVoice 2"):
        load_model_dir(fixture_dir(2), expected_version=3)


def test_yaml_naming_the_other_versions_lm_is_a_model_load_error(tmp_path: Path) -> None:
    model = copy_model_dir(2, tmp_path / "m")
    (model / "cosyvoice2.yaml").rename(model / "cosyvoice3.yaml")
    with pytest.raises(
        ModelLoadError, match="expected LM class CosyVoice3LM for CosyVoice 3, got Qwen2LM"
    ):
        load_model_dir(model)


@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt", "CosyVoice-BlankEN/config.json"])
def test_missing_file_is_named_in_the_error(tmp_path: Path, name: str) -> None:
    model = copy_model_dir(3, tmp_path / "m")
    (model / name).unlink()
    with pytest.raises(ModelLoadError, match=f"expected file {name}, got none"):
        load_model_dir(model)


def test_unparsable_yaml_is_a_model_load_error(tmp_path: Path) -> None:
    model = copy_model_dir(2, tmp_path / "m")
    (model / "cosyvoice2.yaml").write_text("llm: [unclosed\n")
    with pytest.raises(ModelLoadError, match="cosyvoice2.yaml"):
        load_model_dir(model)


def _rewrite_llm(model: Path, edit: object) -> None:
    state = torch.load(model / "llm.pt", weights_only=True)
    edit(state)  # type: ignore[operator]
    (model / "llm.pt").unlink()
    torch.save(state, model / "llm.pt")


def test_shape_mismatch_in_llm_names_the_tensor_and_both_shapes(tmp_path: Path) -> None:
    model = copy_model_dir(3, tmp_path / "m")
    _rewrite_llm(model, lambda s: s.update({"speech_embedding.weight": torch.zeros(6564, 32)}))
    with pytest.raises(
        ModelLoadError,
        match=r"expected speech_embedding.weight of shape \[6761, 32\], got \[6564, 32\]",
    ):
        load_speech_lm(load_model_dir(model))


def test_missing_tensor_in_llm_is_named(tmp_path: Path) -> None:
    model = copy_model_dir(2, tmp_path / "m")
    _rewrite_llm(model, lambda s: s.pop("llm_decoder.bias"))
    with pytest.raises(ModelLoadError, match="expected tensor llm_decoder.bias"):
        load_speech_lm(load_model_dir(model))


def test_v2_weights_under_a_v3_yaml_are_refused(tmp_path: Path) -> None:
    model = copy_model_dir(3, tmp_path / "m")
    (model / "llm.pt").unlink()
    (model / "llm.pt").symlink_to(fixture_dir(2) / "llm.pt")
    with pytest.raises(ModelLoadError, match="llm.pt"):
        load_speech_lm(load_model_dir(model))


def test_corrupt_checkpoint_is_a_model_load_error(tmp_path: Path) -> None:
    model = copy_model_dir(2, tmp_path / "m")
    (model / "llm.pt").unlink()
    (model / "llm.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="unreadable"):
        load_speech_lm(load_model_dir(model))


@pytest.mark.parametrize("version", [2, 3])
def test_random_checkpoint_has_the_official_keys_and_shapes_and_loads(
    tmp_path: Path, version: int
) -> None:
    model = write_random_model_dir(tmp_path / "m", version, seed=3)
    official = torch.load(fixture_dir(version) / "llm.pt", weights_only=True)
    written = torch.load(model / "llm.pt", weights_only=True)
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in official.items()}
    with pytest.raises(ModelLoadError, match="expected file flow.pt"):
        load_model_dir(model)
    model_dir = load_model_dir(model, expected_version=version, required_files=("llm.pt",))
    lm = load_speech_lm(model_dir)
    want = random_speech_lm(version, QWEN2_TINY, seed=3)
    got_weight = lm.speech_embedding.weight
    assert torch.equal(got_weight, want.speech_embedding.weight.half().float())
