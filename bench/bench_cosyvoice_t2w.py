"""What bounding the flow's recomputed history saves and costs.

The figures and why: docs/cosyvoice-design.md, "Bounded history". Cost: mel
frames the flow estimator runs over per chunk, from the chunk schedule alone
(no model). Fidelity: the upstream tiny fixture's 240 greedy LM tokens
streamed with upstream's hops, full recomputation against bounded history,
deterministic vocoder source; relative RMS of the differences. The fixtures
are the upstream-made ones kept beside the repository, never copied in
(`--fixtures`, by default where the parity tests read them:
tests/support/cosyvoice_parity.FIXTURES).

    python -m bench.bench_cosyvoice_t2w [--fixtures DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine.backends.cosyvoice.model_dir import load_model_dir
from engine.backends.cosyvoice.models.flow import build_flow
from engine.backends.cosyvoice.models.hift import build_hift
from engine.backends.cosyvoice.t2w.streams import FlowPrompt, T2WConfig, TokenToWave, schedule
from tests.support.cosyvoice_parity import FIXTURES

HISTORIES: list[int | None] = [None, 100, 50, 25]


def cost_table() -> None:
    print("| prompt | answer | " + " | ".join(f"history {h} total / last" for h in HISTORIES)
          + " |")
    for prompt_len, answer in ((20, 240), (20, 1500), (150, 1500)):
        cells = []
        for history in HISTORIES:
            frames = [2 * (prompt_len + end - start)
                      for start, _, end in schedule(prompt_len, answer,
                                                    T2WConfig(max_history_tokens=history))]
            cells.append(f"{sum(frames)} / {frames[-1]}")
        print(f"| {prompt_len} | {answer} | " + " | ".join(cells) + " |")


def stream(t2w: TokenToWave, prompt: FlowPrompt,
           tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t2w.add_stream("a", prompt)
    t2w.feed("a", tokens)
    t2w.finish("a")
    chunks = []
    while t2w.has_stream("a"):
        chunks += t2w.run(["a"])
    return torch.cat([c.mel for c in chunks], dim=1), torch.cat([c.audio for c in chunks])


def fidelity_table(fixtures: Path) -> None:
    print("| version | history | mel rel. RMS | audio rel. RMS | frames changed |")
    for version in (2, 3):
        model_dir = load_model_dir(fixtures / f"cosyvoice{version}")
        ref = torch.load(model_dir.path / "reference.pt", weights_only=True)
        flow, hift = build_flow(model_dir), build_hift(model_dir)
        hift.cfg.noise_scale = 0.0
        prompt = FlowPrompt(ref["prompt_speech_token"][0], ref["prompt_feat"][0],
                            ref["embedding"][0])
        tokens = ref["lm_greedy_tokens"][ref["lm_greedy_tokens"] < 6561]
        runs = {h: stream(TokenToWave(flow, hift,
                                      T2WConfig(first_hop_tokens=None, max_history_tokens=h)),
                          prompt, tokens) for h in HISTORIES}
        full_mel, full_wav = runs[None]
        for history in HISTORIES[1:]:
            mel, wav = runs[history]
            d_mel, d_wav = mel - full_mel, wav - full_wav
            rel_mel = float(d_mel.pow(2).mean().sqrt() / full_mel.std())
            rel_wav = float(d_wav.pow(2).mean().sqrt() / full_wav.pow(2).mean().sqrt())
            changed = int((d_mel.abs().amax(0) > 1e-4).sum())
            print(f"| {version} | {history} | {rel_mel:.2%} | {rel_wav:.2%} | "
                  f"{changed}/{mel.shape[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixtures", type=Path, default=FIXTURES,
                        help="the upstream-made tiny fixtures (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cost_table()
    fidelity_table(args.fixtures)


if __name__ == "__main__":
    main()
