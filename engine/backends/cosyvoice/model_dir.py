"""An official CosyVoice 2/3 model directory, as users download it.

Layout (FunAudioLLM/CosyVoice2-0.5B, Fun-CosyVoice3-0.5B):

    cosyvoice2.yaml | cosyvoice3.yaml   hyperparameters (HyperPyYAML, read as data)
    llm.pt  flow.pt  hift.pt            state dicts
    CosyVoice-BlankEN/                  Qwen2 config.json (+ tokenizer files)
    campplus.onnx                       speaker embedding (optional here)
    speech_tokenizer_v2.onnx | _v3      reference-audio tokens (optional here)

The version is the yaml's name; the LM class the yaml names must agree with it.
Every problem is a ModelLoadError that says which file and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.backends.cosyvoice.hyperyaml import YamlRefError, load_hyperyaml_file
from engine.errors import ModelLoadError

QWEN_DIR = "CosyVoice-BlankEN"
# The LM class each version's yaml must name (upstream cosyvoice/llm/llm.py).
LLM_CLASSES = {2: "Qwen2LM", 3: "CosyVoice3LM"}
# The languages each version speaks, every voice of it (cross-lingual cloning), as the
# upstream README lists them: 2 zh, en, ja, ko and Chinese dialects (Cantonese); 3 adds
# de, es, fr, it, ru (its "9 common languages", with 18+ Chinese dialects).
LANGUAGES = {2: ("zh", "en", "ja", "ko", "yue"),
             3: ("zh", "en", "ja", "ko", "yue", "de", "es", "fr", "it", "ru")}
REQUIRED_FILES = ("llm.pt", "flow.pt", "hift.pt")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")


@dataclass(slots=True)
class ModelDir:
    """A checked model directory: its version, its hyperparameters as plain data, its files.

    `hparams` is the whole yaml with tags turned into dicts (`_kind`, `_target`,
    then the arguments), e.g. `hparams["flow"]["decoder"]["estimator"]["dim"]`.
    """

    path: Path
    version: int
    hparams: dict[str, Any] = field(repr=False)

    def __post_init__(self) -> None:
        if self.version not in (2, 3):
            raise ModelLoadError(f"expected CosyVoice version 2 or 3, got {self.version}")

    @property
    def yaml_path(self) -> Path:
        return self.path / f"cosyvoice{self.version}.yaml"

    @property
    def qwen_path(self) -> Path:
        return self.path / QWEN_DIR

    @property
    def campplus_path(self) -> Path:
        return self.path / "campplus.onnx"

    @property
    def speech_tokenizer_path(self) -> Path:
        return self.path / f"speech_tokenizer_v{self.version}.onnx"

    @property
    def has_tokenizer_files(self) -> bool:
        return any((self.qwen_path / name).is_file() for name in TOKENIZER_FILES)

    def file(self, name: str) -> Path:
        """The path of a file that must exist, or a ModelLoadError naming it."""
        path = self.path / name
        if not path.is_file():
            raise ModelLoadError(f"{self.path}: expected file {name}, got none")
        return path

    def optional_file(self, name: str) -> Path | None:
        path = self.path / name
        return path if path.is_file() else None

    def qwen_config(self) -> dict[str, Any]:
        """The Qwen2 body's config.json (hidden size, layers, heads, rope, eps)."""
        path = self.qwen_path / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{self.path}: expected file {QWEN_DIR}/config.json, got none")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: expected JSON, got unreadable text ({exc})") from exc
        if not isinstance(config, dict):
            raise ModelLoadError(f"{path}: expected a JSON object, got {type(config).__name__}")
        return config

    def section(self, key: str) -> dict[str, Any]:
        """A top-level yaml section such as "llm", "flow" or "hift", which must be a mapping."""
        value = self.hparams.get(key)
        if not isinstance(value, dict):
            raise ModelLoadError(
                f"{self.yaml_path.name}: expected a mapping under {key!r}, got "
                f"{type(value).__name__}"
            )
        return value

    def load_checkpoint(self, name: str) -> dict[str, Any]:
        """A state dict file (llm.pt, flow.pt, hift.pt) loaded on the CPU, tensors only."""
        import torch

        path = self.file(name)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several kinds for a corrupt file
            raise ModelLoadError(
                f"{path}: expected a torch state dict, got an unreadable file ({exc})"
            ) from exc
        if not isinstance(state, dict):
            raise ModelLoadError(f"{path}: expected a state dict, got {type(state).__name__}")
        return state


def detect_version(path: Path) -> int:
    """2 or 3 from the yaml the directory holds; CosyVoice 1 and unknown layouts are errors."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"expected a CosyVoice model directory, got {path} (not a directory)")
    found = [v for v in (2, 3) if (path / f"cosyvoice{v}.yaml").is_file()]
    if len(found) == 1:
        return found[0]
    if len(found) == 2:
        raise ModelLoadError(
            f"{path}: expected one of cosyvoice2.yaml or cosyvoice3.yaml, got both"
        )
    if (path / "cosyvoice.yaml").is_file():
        raise ModelLoadError(
            f"{path}: expected a CosyVoice 2 or 3 directory, got CosyVoice 1 (cosyvoice.yaml)"
        )
    raise ModelLoadError(f"{path}: expected cosyvoice2.yaml or cosyvoice3.yaml, got neither")


def load_model_dir(
    path: str | Path,
    expected_version: int | None = None,
    required_files: tuple[str, ...] = REQUIRED_FILES,
) -> ModelDir:
    """Check an official model directory and read its hyperparameters; loads no weights.

    Raises ModelLoadError for a missing directory or file, an unreadable yaml, a
    version other than `expected_version`, or a yaml whose LM class belongs to
    the other version. `required_files` narrows the weight files that must
    exist (e.g. ("llm.pt",) for an LM-only benchmark directory).
    """
    path = Path(path)
    version = detect_version(path)
    if expected_version is not None and version != expected_version:
        raise ModelLoadError(
            f"{path}: expected a CosyVoice {expected_version} directory, got CosyVoice {version}"
        )
    yaml_path = path / f"cosyvoice{version}.yaml"
    try:
        hparams = load_hyperyaml_file(yaml_path, {"qwen_pretrain_path": str(path / QWEN_DIR)})
    except (OSError, ValueError, YamlRefError) as exc:
        raise ModelLoadError(
            f"{yaml_path}: expected HyperPyYAML, got an unreadable file ({exc})"
        ) from exc
    except Exception as exc:  # yaml.YAMLError and friends
        raise ModelLoadError(
            f"{yaml_path}: expected HyperPyYAML, got a parse error ({exc})"
        ) from exc
    model_dir = ModelDir(path=path, version=version, hparams=hparams)
    llm = model_dir.section("llm")
    llm_class = str(llm.get("_target", "")).rsplit(".", 1)[-1]
    if llm_class != LLM_CLASSES[version]:
        raise ModelLoadError(
            f"{yaml_path.name}: expected LM class {LLM_CLASSES[version]} for CosyVoice {version}, "
            f"got {llm_class or 'none'}"
        )
    for name in required_files:
        model_dir.file(name)
    model_dir.qwen_config()
    return model_dir
