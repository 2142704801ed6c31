"""What vLLM's speech logits processor does each step, without vLLM: head bias, min-length
mask and repetition-aware sampling (RAS) for a batch of rows.

vLLM hands the processor each request's output tokens as a Python list; the
mask, the RAS window and the RAS parameters must reach the device. Building
tensors from lists every step (one per row, plus index and parameter
tensors) costs a host allocation and a copy each, at every decode step of
every stream. Here one host buffer (pinned where the device wants it) is
allocated once; each step fills its rows in place through a numpy view and
goes to a device buffer, also allocated once, in ONE non-blocking copy.
Rows then apply their mask and RAS with `torch.where`, so no index tensor
and no host sync is made. Reusing the host buffer is safe: vLLM reads the
sampled tokens back (a sync) before the next step's processors run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# host/device buffer columns: masked, is_ras, top_p, top_k, threshold, then the window
_MASKED, _IS_RAS, _TOP_P, _TOP_K, _THRESHOLD, _WINDOW = range(6)


def ras_logits(
    logits: torch.Tensor,
    history: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    threshold: torch.Tensor,
) -> torch.Tensor:
    """Log-probabilities of upstream's RAS outcome, per row.

    logits [B, V] (float32, already masked); history [B, W] last tokens, -1
    padded; top_p [B]; top_k [B] int; threshold [B] = win_size x tau_r.

    Upstream draws s from the nucleus p_n (top-p within top-k of p = softmax);
    if s occurs >= threshold times in the window (s in R) it forbids s and
    draws from p. So the outcome t has probability
        q(t) = p_n(t) [t not in R] + p(t) sum_{s in R, s != t} p_n(s) / (1 - p(s)).
    """
    b, v = logits.shape
    p = logits.softmax(dim=-1)  # [B, V]
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=p.device)[None]
    keep = ((sorted_p.cumsum(dim=-1) - sorted_p) < top_p[:, None]) & (rank < top_k[:, None])
    keep[:, 0] = True
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    p_n = torch.zeros_like(p).scatter_(1, order, kept / kept.sum(dim=-1, keepdim=True))  # [B, V]
    counts = torch.zeros(b, v + 1, device=p.device)
    slots = torch.where(history < 0, v, history).long()  # -1 -> a spill column
    counts.scatter_add_(1, slots, torch.ones_like(slots, dtype=counts.dtype))
    repeated = counts[:, :v] >= threshold[:, None]  # [B, V]: R
    w = torch.where(repeated, p_n / (1.0 - p).clamp_min(1e-12), torch.zeros_like(p))
    q = torch.where(repeated, torch.zeros_like(p), p_n) + p * (w.sum(dim=-1, keepdim=True) - w)
    degenerate = q.sum(dim=-1, keepdim=True) <= 0  # p one-hot on a repeated token: keep p
    return torch.where(degenerate, logits, q.log())



@dataclass(slots=True)
class RowState:
    min_tokens: int
    ras: tuple[float, int, int, float] | None  # top_p, top_k, win_size, tau_r
    output: list[int]  # vLLM's live list of this request's output tokens


class SpeechLogits:
    """The per-step work of the speech logits processor over rows {batch index: RowState}."""

    def __init__(self, mask_index: int, bias: torch.Tensor | None, device: torch.device,
                 max_rows: int = 256, max_window: int = 16, pin_memory: bool = False) -> None:
        self.mask_index = mask_index
        self.bias = None if bias is None else bias.to(device)  # [V] float32
        self.device = device
        self.pin_memory = pin_memory
        self._allocate(max_rows, max_window)

    def _allocate(self, rows: int, window: int) -> None:
        width = _WINDOW + window
        self._host = torch.empty(rows, width, dtype=torch.float32, pin_memory=self.pin_memory)
        self._view = self._host.numpy()
        self._dev = torch.empty(rows, width, dtype=torch.float32, device=self.device)
        self.window = window

    def apply(self, logits: torch.Tensor, rows: dict[int, RowState]) -> torch.Tensor:
        """logits [B, V] float32 (vLLM's, modified in place where it can) -> the processed
        logits."""
        if self.bias is not None:
            logits += self.bias
        if not rows:
            return logits
        b = logits.shape[0]
        window = max((s.ras[2] for s in rows.values() if s.ras is not None), default=1)
        if b > self._host.shape[0] or window > self.window:
            self._allocate(max(b, self._host.shape[0]), max(window, self.window))
        view = self._view[:b]
        view[:, :_WINDOW] = (0.0, 0.0, 1.0, 1.0, np.inf)  # rows without state: untouched
        view[:, _WINDOW:] = -1.0
        for i, s in rows.items():
            view[i, _MASKED] = len(s.output) < s.min_tokens
            if s.ras is not None:
                top_p, top_k, win, tau_r = s.ras
                view[i, _IS_RAS:_WINDOW] = (1.0, top_p, top_k, win * tau_r)
                recent = s.output[-win:]
                if recent:
                    view[i, _WINDOW + self.window - len(recent):] = recent
        dev = self._dev[:b]
        dev.copy_(self._host[:b], non_blocking=True)
        masked = dev[:, _MASKED] > 0
        column = logits[:, self.mask_index]
        logits[:, self.mask_index] = torch.where(masked, torch.full_like(column, float("-inf")),
                                                 column)
        if not any(s.ras is not None for s in rows.values()):
            return logits
        ras = ras_logits(logits, dev[:, _WINDOW:].long(), dev[:, _TOP_P], dev[:, _TOP_K].long(),
                         dev[:, _THRESHOLD])
        return torch.where(dev[:, _IS_RAS:_IS_RAS + 1] > 0, ras, logits)
