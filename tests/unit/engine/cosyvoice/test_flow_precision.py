"""A bf16 flow keeps what must stay float32: the time embedding's argument, the rotary frequencies
and the solver's time."""

from __future__ import annotations

import torch
from torch import nn

from engine.backends.cosyvoice.models.flow import CFM
from engine.backends.cosyvoice.models.flow_dit import RotaryEmbedding, TimeEmbed, sinus_embedding


def test_the_flow_time_embedding_is_formed_in_float32_and_cast_after_the_sinusoid() -> None:
    embed = TimeEmbed(64).to(torch.bfloat16)
    seen: list[torch.Tensor] = []
    embed.time_mlp[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    t = torch.tensor([0.6137, 0.9951])
    embed(t)
    want = sinus_embedding(t, 256).to(torch.bfloat16)  # float32 argument, then the cast
    rounded = sinus_embedding(t.to(torch.bfloat16), 256).to(torch.bfloat16)  # what bf16 t gave
    assert torch.equal(seen[0], want) and not torch.equal(want, rounded)


def test_the_dit_rotary_frequencies_and_the_solvers_time_stay_float32_in_a_bf16_flow() -> None:
    rotary = RotaryEmbedding(64).to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, RotaryEmbedding(64).inv_freq)
    times: list[torch.Tensor] = []

    class Recorder(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                    spks: torch.Tensor, cond: torch.Tensor, streaming: bool) -> torch.Tensor:
            times.append(t)
            return torch.zeros_like(x)

    cfm = CFM(Recorder(), 10, 0.7, cosine=True)
    z, mu = torch.zeros(1, 80, 4), torch.zeros(1, 80, 4, dtype=torch.bfloat16)
    cfm(z, torch.ones(1, 1, 4, dtype=torch.bfloat16), mu, torch.zeros(1, 80, dtype=torch.bfloat16),
        torch.zeros(1, 80, 4, dtype=torch.bfloat16), True)
    assert {t.dtype for t in times} == {torch.float32}
