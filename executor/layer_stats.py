"""Per-layer gradient and activation norms, taken every k steps (LayerStatsRecord)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from executor.model import GPT


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@contextmanager
def activation_probe(parts: list[GPT], enabled: bool = True) -> Iterator[dict[str, float]]:
    """Record the RMS of each layer's output (this rank's shard) while the block runs; hooks removed after."""
    norms: dict[str, float] = {}
    handles = []
    if not enabled:
        yield norms
        return

    def hook(name: str) -> Any:
        def record(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            out = _local(output).detach().float()
            norms[name] = float(out.pow(2).mean().sqrt()) if out.numel() else 0.0

        return record

    for part in parts:
        for idx, block in part.layers.items():
            handles.append(block.register_forward_hook(hook(f"layers.{idx}")))
    try:
        yield norms
    finally:
        for h in handles:
            h.remove()


def gradient_norms(parts: list[GPT]) -> dict[str, float]:
    """L2 norm of each parameter's gradient on this rank (its local shard under TP or FSDP)."""
    out = {}
    for part in parts:
        for name, p in part.named_parameters():
            if p.grad is not None:
                out[name] = float(_local(p.grad).detach().float().norm())
    return out
