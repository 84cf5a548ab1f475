"""Context parallelism on any backend: load-balanced sequence chunks and all-gather attention.

PyTorch's `context_parallel` has no sharding strategy for CPU attention, so this is our own. The sequence is cut
into 2·cp equal chunks and cp rank r keeps chunks r and 2·cp−1−r, so that under a causal mask every rank holds
one early (cheap) and one late (expensive) chunk and the work is even (Megatron-Core's load-balanced CP; Liu et
al. 2023 ring attention discuss the same imbalance). Each rank all-gathers the keys and values of the whole
sequence and attends its local queries to them with a mask built from true positions. All-gather attention moves
(cp−1)/cp of the K/V per layer, like a ring, but without the overlap; on loopback gloo that is the simpler choice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from executor.commtime import CommTimer


def local_positions(seq_local: int, cp_rank: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of the tokens a cp rank holds, for a local sequence of `seq_local` = seq / cp tokens."""
    chunk = seq_local // 2
    early = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    late_start = (2 * cp - 1 - cp_rank) * chunk
    late = torch.arange(late_start, late_start + chunk, device=device)
    return torch.cat((early, late))


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """The cp rank's load-balanced share of x [batch, seq, ...] along the sequence."""
    if cp == 1:
        return x
    return x[:, local_positions(x.shape[1] // cp, cp_rank, cp, x.device)]


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 3 of a stacked [2, batch, heads, seq, dim] K/V; backward sums and keeps our slice."""

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, group: dist.ProcessGroup, comm: CommTimer) -> torch.Tensor:
        ctx.group, ctx.comm = group, comm
        size = dist.get_world_size(group)
        ctx.rank, ctx.size = dist.get_rank(group), size
        kv = kv.contiguous()
        parts = [torch.empty_like(kv) for _ in range(size)]
        with comm.span("cp"):
            dist.all_gather(parts, kv, group=group)
        return torch.cat(parts, dim=3)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Every rank's queries used our keys: the gradient of our slice is the sum over ranks of theirs.
        grad = grad.contiguous()
        with ctx.comm.span("cp"):
            dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=3)[ctx.rank], None, None


class AllGatherAttention:
    """Causal attention for one cp rank's load-balanced queries against the whole sequence's keys and values."""

    def __init__(self, group: dist.ProcessGroup, comm: CommTimer) -> None:
        self.group, self.comm = group, comm
        self.cp, self.cp_rank = dist.get_world_size(group), dist.get_rank(group)

    def positions(self, seq_local: int, device: torch.device) -> torch.Tensor:
        return local_positions(seq_local, self.cp_rank, self.cp, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq_local = q.shape[2]
        kv = _GatherSequence.apply(torch.stack((k, v)), self.group, self.comm)
        q_pos = self.positions(seq_local, q.device)
        k_pos = torch.cat([local_positions(seq_local, r, self.cp, q.device) for r in range(self.cp)])
        mask = q_pos[:, None] >= k_pos[None, :]
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
