"""Write the cosyvoice backend's default reference voice: piper's built-in voice saying one
sentence.

    python -m tools.make_cosyvoice_reference

The WAV ships in the wheel (engine/backends/cosyvoice/assets/) so that loading
CosyVoice never starts piper. Run once; rerun only to change the sentence or
the piper voice. Noise-free synthesis (noise scales 0), so the file is the
same on every run; 16-bit PCM at piper's own rate, mono.
"""

from __future__ import annotations

import argparse
import wave
from pathlib import Path

import numpy as np

from engine.backends.cosyvoice.loader import PIPER_VOICE_ID, REFERENCE_PATH, REFERENCE_TEXT
from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.types import RequestId, SamplingParams, SynthesisRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REFERENCE_PATH)
    args = parser.parse_args()
    piper = PiperBackend(PiperBackendConfig(num_threads=1, max_batch_size=1))
    piper.load()
    request = SynthesisRequest(RequestId("cosyvoice-reference"), REFERENCE_TEXT, PIPER_VOICE_ID,
                               params=SamplingParams(noise_scale=0.0, noise_w_scale=0.0))
    (result,) = piper.step([piper.prepare(request)])
    if result.error is not None:
        raise SystemExit(f"piper failed on the reference sentence: {result.error}")
    pcm = np.round(np.clip(np.asarray(result.pcm, np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(args.out), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(piper.sample_rate)
        out.writeframes(pcm.tobytes())
    print(f"{args.out}: {len(pcm) / piper.sample_rate:.2f} s at {piper.sample_rate} Hz, "
          f"{args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
