"""After the backward: gradients made whole, averaged over their replicas, their global norm, and the clip.

The norm and the clip are torch's own (`get_total_norm`, `clip_grads_with_norm_`, as torchtitan uses them): each
device mesh's DTensor gradients give a norm whose `full_tensor()` sums the shards' partial norms over that mesh;
plain gradients are whole on every rank that holds them. What no mesh covers is summed by hand, as torchtitan
does for pipeline stages: the routed experts' squares over the ep group (each rank holds other experts), then
everything over the pp group (each rank holds other stages).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from executor.commtime import CommTimer


def reduce_partial_gradients(params: list[torch.nn.Parameter]) -> None:
    """Turn gradients that DTensor left as partial sums into the placement of their parameter.

    With sequence parallelism the norm weights are replicated but each tp rank sees only its sequence shard, so
    their gradients come back as Partial(sum) DTensors; the gradient norm and the optimizer need the sum.
    """
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and isinstance(p, DTensor) and any(pl.is_partial() for pl in grad.placements):
            p.grad = grad.redistribute(grad.device_mesh, p.placements)  # the step's CommTimer sees this as tp


def all_reduce_gradients(
    params: list[torch.nn.Parameter],
    group: dist.ProcessGroup | None,
    comm: CommTimer,
    over: int | None = None,
    dtype: torch.dtype = torch.float32,
    axis: str = "dp",
) -> None:
    """Sum gradients over a replica group with one flat all-reduce in `dtype` (the plan's reduce dtype under mixed
    precision) and divide by `over` (default: the group's size, an average — ZeRO 0). Expert weights pass their
    expert-replica group (or None, held once) and the dp·cp size: each expert's gradient already sums the tokens
    of its whole expert-parallel group. An MoE layer's weights under sequence parallelism pass the tp group, over
    1: each tp rank's gradient sums only the tokens of its shard. The step's timer books it under `axis`."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads]).to(dtype)
    if group is not None:
        with comm.span(axis):  # "dp" (the default) even where the replica group is the cp group
            dist.all_reduce(flat, group=group)
    flat /= over or dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def global_grad_norm(
    params: list[torch.nn.Parameter],
    experts: set[int],
    ep_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    device: torch.device,
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, the same on every rank (float64, on `device`).

    `experts` holds the ids of this rank's routed-expert parameters, spread over `ep_group`; `pp_group` links the
    ranks that hold the other pipeline stages (None: one stage, or one rank).
    """
    dense = [p.grad for p in params if p.grad is not None and id(p) not in experts]
    spread = [p.grad for p in params if p.grad is not None and id(p) in experts]
    square = _square_norm(dense, device)
    if spread:
        part = _square_norm(spread, device)
        if ep_group is not None:
            dist.all_reduce(part, group=ep_group)
        square = square + part
    if pp_group is not None:
        dist.all_reduce(square, group=pp_group)
    return square.sqrt()


def _by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by device mesh, plain tensors apart: torch's foreach kernels take no mixed list."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def _square_norm(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Squared norm of `grads`, whole over each device mesh they are sharded on (float64 to sum across groups)."""
    square = torch.zeros((), dtype=torch.float64, device=device)
    for group in _by_mesh(grads):
        norm = get_total_norm(group, 2.0, error_if_nonfinite=False, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the partial norms of the shards, summed over the mesh
        square += norm.double().square()
    return square


def clip_gradients(params: list[torch.nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients so their global norm is at most `max_norm` (0 disables clipping)."""
    if max_norm <= 0:
        return
    for group in _by_mesh(p for p in params if p.grad is not None):
        clip_grads_with_norm_(group, max_norm, norm.float(), foreach=True)
