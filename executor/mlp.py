"""The transformer's MLP, dense or one expert of a mixture: SwiGLU (Shazeer 2020) when gated, otherwise a
two-matrix GELU MLP. Its weights are named w1 (gate or up), w2 (down) and w3 (up), as torchtitan's Llama names them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """An MLP of inner width `ffn` (a shared expert: the shared experts' widths side by side)."""

    def __init__(self, hidden: int, ffn: int, glu: bool) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False) if glu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))
