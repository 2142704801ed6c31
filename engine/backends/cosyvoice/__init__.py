"""CosyVoice 2 and 3 (FunAudioLLM) in plain torch: model directory, frontend, speech LM,
flow matching and the HiFT vocoder.

Only this package imports torch; `load_model_dir` needs none (it reads the yaml
as data), so callers may import it without loading a model.
"""

from __future__ import annotations

from engine.backends.cosyvoice.model_dir import ModelDir, detect_version, load_model_dir

__all__ = ["ModelDir", "detect_version", "load_model_dir"]
