"""How much context the piper windows need: errors against the whole segment (joe).

    python -m bench.bench_piper_context [--sentences 150] [--flow 8,12,16,24,32] [--decoder 8,10,12]

For each sentence of the bundled load-test corpus the front part runs once
(the server's default sampling: noise on), then the flow over the whole
segment and the decoder over its whole latent: the reference. Against it:

1. The flow on a slice with `F` frames of context (`window_flow_context_frames`):
   the largest difference in the latent frames the backend keeps from that
   slice, for the first slice (the default first window of one talking session
   and its decoder context) and a middle one (frames 40-76). The kept
   frames feed later windows too, so they must equal the whole flow's; the
   first window's own audio hides most of the error (printed beside it: what
   `window_first_flow_context_frames` rests on).
2. The decoder on that first window with `C` frames of context on its right
   (`window_context_frames`), over the exact latent: the audio's largest
   difference (the tests allow 1e-3).

No timing: this is what the window plan's context sizes rest on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_piper_limit import corpus_sentences
from engine.backends.piper.backend import PiperBackend
from engine.backends.piper.config import PiperBackendConfig
from engine.backends.piper.loader import LoadedVoice
from engine.backends.piper.windows import decode_window, flow_slice
from engine.types import RequestId, SynthesisRequest

DEFAULTS = PiperBackendConfig()
FIRST_WINDOW = DEFAULTS.window_lone_first_frames
FIRST_CONTEXT = DEFAULTS.window_context_frames
FIRST_END = FIRST_WINDOW + FIRST_CONTEXT
SLICES = {f"first slice (frames 0-{FIRST_END})": (0, FIRST_END),
          "middle slice (frames 40-76)": (40, 76)}


def reference(backend: PiperBackend, voice: LoadedVoice, text: str,
              index: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, int]:
    """The segment's flow feeds, its whole latent [1, C, T], whole audio [T * hop] and frame
    count."""
    item = backend.prepare(SynthesisRequest(RequestId(f"c{index}"), text, "joe"))
    state = item.state
    backend.release(item)  # only its ids and scales are read here
    outputs, durations = voice.run_front(np.array([state.ids], dtype=np.int64),
                                         np.array([len(state.ids)], dtype=np.int64),
                                         np.array(state.scales, dtype=np.float32), None)
    total = int(np.rint(durations[0]).sum())
    padded = next(iter(outputs.values())).shape[2]
    prior = flow_slice(voice.flow_feeds(outputs, None), 0, total, padded)
    latent = voice.run_flow(prior)
    return prior, latent, voice.run_decoder(latent, None).reshape(-1), total


def row(name: str, errors: list[float]) -> str:
    return (f"| {name} | {max(errors):.1e} | {np.percentile(errors, 99):.1e} | "
            f"{np.median(errors):.1e} | {len(errors)} |")


def run(num_sentences: int, flow_contexts: list[int], decoder_contexts: list[int]) -> None:
    backend = PiperBackend(DEFAULTS)
    backend.load()
    voice = backend.get_voice("joe")
    if not voice.has_flow:
        raise SystemExit("the joe voice's flow was not cut out: nothing to measure")
    hop = voice.config.hop_length

    def decode(latent: np.ndarray) -> np.ndarray:
        return voice.run_decoder(latent, None)

    texts = corpus_sentences(seed=1)[:num_sentences]
    latent_errors: dict[tuple[str, int], list[float]] = {}
    audio_errors: dict[tuple[str, int], list[float]] = {}
    for index, text in enumerate(texts):
        prior, latent, whole, total = reference(backend, voice, text, index)
        for context in flow_contexts:
            for name, (start, end) in SLICES.items():
                if end + context > total:
                    continue  # too short to tell a slice from the whole
                lo = max(0, start - context)
                flow = voice.run_flow(flow_slice(prior, lo, end + context, total))
                part = flow[:, :, start - lo: end - lo]
                latent_errors.setdefault((name, context), []).append(
                    float(np.abs(part - latent[:, :, start:end]).max()))
                if start == 0:  # the first window, decoded as the backend does
                    audio = decode_window(decode, part, 0, FIRST_WINDOW, FIRST_CONTEXT, hop)
                    key = ("first window's audio, flow context", context)
                    audio_errors.setdefault(key, []).append(
                        float(np.abs(audio - whole[: FIRST_WINDOW * hop]).max()))
        for context in decoder_contexts:
            if FIRST_WINDOW + context > total:
                continue
            audio = decode_window(decode, latent, 0, FIRST_WINDOW, context, hop)
            audio_errors.setdefault(("first window's audio, decoder context", context), []).append(
                float(np.abs(audio - whole[: FIRST_WINDOW * hop]).max()))
    print(
        f"{len(texts)} corpus sentences, joe, noise on; largest difference from the whole segment")
    print()
    print("| what | context frames | max | p99 | median | n |")
    print("|---|---:|---:|---:|---:|---:|")
    for (name, context), errors in sorted(latent_errors.items()):
        print(row(f"latent kept, {name} | {context}", errors))
    for (name, context), errors in sorted(audio_errors.items()):
        print(row(f"{name} | {context}", errors))


def parse_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated frame counts >= 0, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sentences", type=int, default=150)
    parser.add_argument("--flow", type=parse_ints, default=[8, 12, 16, 24, 32])
    parser.add_argument("--decoder", type=parse_ints, default=[8, 10, 12])
    args = parser.parse_args()
    if args.sentences < 1:
        parser.error("--sentences must be >= 1")
    run(args.sentences, args.flow, args.decoder)


if __name__ == "__main__":
    main()
