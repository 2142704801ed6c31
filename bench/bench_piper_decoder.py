"""The piper decoder's forms on one thread, timed side by side in one process (joe).

    python -m bench.bench_piper_decoder [--rounds 30] [--frames 17,34,58,72,148]

Each form decodes the same random latent of each length (a window with its
context: a lone first window 7 + 10 frames, up to a long one 128 + 2 x 10),
the forms taking turns call by call so that the host's noise falls on all
alike:

- 1-D: the decoder as cut from the voice's graph;
- 2-D: `graphs.split.decoder_as_2d` (the loader's form before the blocked rewrite);
- blocked: `graphs.blocked.blocked_decoder` over the 2-D form (the loader's
  form where it converts).

Sessions as the backend opens them (`loader.open_session`, one thread,
no spinning). Prints the minimum and median ms per call, the share of the
2-D form's median, and the largest difference from the 1-D form's audio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.piper.graphs.blocked import blocked_decoder
from engine.backends.piper.graphs.split import decoder_as_2d, latent_channels, split_voice
from engine.backends.piper.loader import default_voice_files, open_session, read_patched_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--frames", default="17,34,58,72,148")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    split = split_voice(read_patched_model(default_voice_files()))
    if split is None:
        sys.exit("joe's graph did not split at its decoder")
    channels = latent_channels(split.decoder, split.latent_name)
    lifted = decoder_as_2d(split.decoder)
    if channels is None or lifted is None:
        sys.exit("joe's decoder did not convert to 2-D")
    blocked = blocked_decoder(lifted, channels)
    if blocked is None:
        sys.exit("onnxruntime blocks nothing on this machine (no NCHWc kernels)")
    forms = {"1-D": open_session(1, split.decoder), "2-D": open_session(1, lifted),
             "blocked": open_session(1, blocked)}
    rng = np.random.default_rng(args.seed)
    print(f"joe's decoder, 1 thread, {args.rounds} calls per form and length, forms taking turns")
    print("| frames | form | min ms | median ms | median / 2-D | max abs difference from 1-D |")
    print("|---:|---|---:|---:|---:|---:|")
    for frames in (int(part) for part in args.frames.split(",")):
        latent = rng.standard_normal((1, channels, frames)).astype(np.float32)  # [1, C, T]
        feeds = {split.latent_name: latent}
        outputs = {name: np.asarray(session.run(None, feeds)[0]).reshape(-1)
                   for name, session in forms.items()}
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, session in forms.items():
                start = time.perf_counter()
                session.run(None, feeds)
                times[name].append(1000 * (time.perf_counter() - start))
        base = float(np.median(times["2-D"]))
        for name, values in times.items():
            difference = float(np.abs(outputs[name] - outputs["1-D"]).max())
            print(f"| {frames} | {name} | {min(values):.1f} | {np.median(values):.1f} | "
                  f"{np.median(values) / base:.0%} | {difference:.1e} |")


if __name__ == "__main__":
    main()
