"""Tiny random CosyVoice model directories for backend tests, written once per test session.

`tiny_model_dir(base, version)` writes (once under `base`) a directory in the
official layout with every file the backend loads: yaml, tokenizer files,
llm.pt / flow.pt / hift.pt at tiny sizes and the ONNX stand-ins
(random_checkpoint.write_random_model_dir). `reference_wav` writes a short
voiced, harmonic signal to clone as the default voice: cloning piper's voice
at every load would cost seconds per test module.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.cosyvoice_random_parts import voiced_signal as voiced
from tests.support.cosyvoice_random_parts import write_reference_wav

REFERENCE_TEXT = "Hello there."

__all__ = ["REFERENCE_TEXT", "reference_wav", "tiny_model_dir", "voiced"]


def tiny_model_dir(base: Path, version: int) -> Path:
    from tests.support.cosyvoice_random_checkpoint import write_random_model_dir

    path = base / f"cosyvoice-tiny-v{version}"
    if not (path / f"speech_tokenizer_v{version}.onnx").is_file():
        write_random_model_dir(path, version, seed=version, flow_size="tiny", with_frontend=True)
    return path


def reference_wav(base: Path) -> Path:
    path = base / "reference.wav"
    return path if path.is_file() else write_reference_wav(path)


def tiny_options(base: Path, version: int = 3) -> dict[str, str]:
    """Backend options for the tiny model: greedy (reproducible), byte tokens, a synthetic
    reference."""
    return {"model_dir": str(tiny_model_dir(base, version)), "tokenizer": "bytes",
            "sampling": "greedy",
            "num_threads": "1", "default_voice_audio": str(reference_wav(base)),
            "default_voice_text": REFERENCE_TEXT}


_BACKENDS: dict[Path, object] = {}


def tiny_backend(base: Path) -> object:
    """One loaded v3 backend per session (tests share it; each releases what it starts)."""
    if base not in _BACKENDS:
        from engine.backends import create_backend

        backend = create_backend("cosyvoice", **tiny_options(base), max_batch_size=4)
        backend.load()
        _BACKENDS[base] = backend
    return _BACKENDS[base]
