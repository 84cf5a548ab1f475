"""The plan's layout on real ranks: one DeviceMesh from the shared rank grid, tensor + sequence parallel with
DTensor, data parallel (gradient all-reduce or FSDP2), context parallel attention, and the global gradient norm.

Data parallel by ZeRO stage:
- 0: every rank keeps whole replicas; after the last microbatch one flat all-reduce averages the gradients
  over the dp·cp group (DDP's arithmetic; DDP itself rejects DTensor parameters, and a separate all-reduce shows
  its exposed time as comm_dp).
- 1 and 2: FSDP2 `fully_shard` with `reshard_after_forward=False`: parameters stay gathered between forward and
  backward, gradients are reduce-scattered and the optimizer state is sharded — ZeRO-2, which also delivers
  ZeRO-1's saving (FSDP2 has no mode that all-reduces gradients but shards only the optimizer state).
- 3: FSDP2 with `reshard_after_forward=True` — except with pipeline parallelism, where it stays False: the
  zero-bubble schedules give wrong gradients with resharding on (seen on torch 2.13), and every schedule would
  re-gather each stage's weights once per microbatch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from executor.commtime import CommTimer
from executor.context_parallel import AllGatherAttention
from executor.mlp import FeedForward
from executor.model import GPT
from plan.rank_grid import Coords, RankGrid
from plan.schema import Plan

MESH_DIMS = ("pp", "dp", "cp", "tp")  # outermost first, as DeviceMesh dims


class LayoutError(ValueError):
    """A layout the plan allows but this executor cannot run yet, with what to change."""


def check_supported(plan: Plan) -> None:
    """Reject what the executor does not implement, before any process group exists."""
    m, lay = plan.model, plan.layout
    if m.is_moe and lay.cp > 1:
        raise LayoutError(
            "layout.cp: the executor routes MoE tokens per sequence and does not yet share a sequence's routing "
            "statistics over cp ranks; set cp: 1 for an MoE model"
        )
    if m.is_moe and lay.tp > 1 and lay.sequence_parallel:
        raise LayoutError(
            "layout.sequence_parallel: the executor's MoE layers run on the whole sequence of each tp rank; set "
            "sequence_parallel: false for an MoE model under tp"
        )
    if lay.ep > 1 and lay.zero > 0:
        raise LayoutError(
            "layout.zero: the executor shards weights with FSDP over dp, which would mix different experts under "
            "ep > 1; set zero: 0 with expert parallelism"
        )
    if lay.tp > m.n_kv_heads:
        raise LayoutError(
            f"layout.tp: {lay.tp} exceeds model.kv_heads={m.n_kv_heads}; the executor splits kv heads and does not "
            "replicate them yet; lower tp to at most kv_heads"
        )
    if m.tied_embeddings and (lay.pp > 1 or lay.tp > 1):
        raise LayoutError(
            "model.tied_embeddings: the executor ties the embedding and output head only with pp=1 and tp=1; "
            "set tied_embeddings: false or pp=tp=1"
        )
    if 0 in plan.stage_layer_counts:
        raise LayoutError(
            "layout.stage_layers / edge_stage_trim: a stage without layers (an embedding- or head-only chunk) is a "
            "twin-only layout for now; give every stage at least one layer"
        )
    seq_local = m.seq_len // lay.cp
    if lay.sequence_parallel and seq_local % lay.tp:
        raise LayoutError(f"layout.sequence_parallel: local sequence {seq_local} is not divisible by tp={lay.tp}")


@dataclass
class Topology:
    """This rank's place in the layout: its coordinates, the mesh and the process groups along each axis."""

    plan: Plan
    rank: int
    mesh: DeviceMesh
    grid: RankGrid

    @classmethod
    def build(cls, plan: Plan, device_type: str) -> Topology:
        grid = RankGrid.from_layout(plan.layout)
        ranks = torch.tensor(np.ascontiguousarray(grid.mesh(MESH_DIMS)))
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS)
        return cls(plan=plan, rank=dist.get_rank(), mesh=mesh, grid=grid)

    @cached_property
    def coords(self) -> Coords:
        return self.grid.coords(self.rank)

    def size(self, axis: str) -> int:
        return int(self.mesh[axis].size())

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh.get_group(axis)

    @cached_property
    def replica_mesh(self) -> DeviceMesh | None:
        """The dp·cp ranks that hold copies (or shards) of the same weights; None when there is only one."""
        dp, cp = self.size("dp"), self.size("cp")
        if dp > 1 and cp > 1:
            return self.mesh["dp", "cp"]._flatten("dp_cp")
        if dp > 1 or cp > 1:
            return self.mesh["dp" if dp > 1 else "cp"]
        return None

    @property
    def expert_parallel(self) -> bool:
        """Routed experts split over ep > 1 ranks: the same on every rank, so it may gate a collective."""
        return self.plan.model.is_moe and self.plan.layout.ep > 1

    @cached_property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The ranks that share one MoE layer's experts (None without expert parallelism)."""
        return _own_group(self.grid.groups("ep"), self.rank) if self.expert_parallel else None

    @cached_property
    def expert_replica_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold copies of this rank's experts (edp·cp); None where only this one does, or without
        expert parallelism (the experts are then replicated like dense weights)."""
        rows = self.grid.groups("edp", "cp")
        return _own_group(rows, self.rank) if self.expert_parallel and rows.shape[1] > 1 else None

    def expert_ids(self) -> range:
        """The routed experts this rank holds: its slice of the experts along ep."""
        per_rank = self.plan.model.experts // self.plan.layout.ep
        return range(self.coords.ep * per_rank, (self.coords.ep + 1) * per_rank)

    @cached_property
    def comm(self) -> CommTimer:
        """The step's exposed-communication timer, knowing which of this rank's groups spans which axis."""
        axes = {str(self.group(axis).group_name): axis for axis in MESH_DIMS if self.size(axis) > 1}
        replica = str(self.replica_mesh.get_group().group_name) if self.replica_mesh is not None else None
        return CommTimer(axes, replica)


def _own_group(rows: np.ndarray, rank: int) -> dist.ProcessGroup:
    """This rank's group among `rows`: every rank creates every group, in the same order, as new_group requires."""
    mine = None
    for row in rows:
        group = dist.new_group(row.tolist())
        if rank in row:
            mine = group
    assert mine is not None
    return mine


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Megatron-style TP over `tp_mesh` (Shoeybi et al. 2019), with Megatron SP when asked (Korthikanti 2022).

    Q/K/V and the MLP's up projections split column-wise, the output projections row-wise, so each layer
    needs one all-reduce forward and one backward (or a reduce-scatter and all-gather pair with SP, whose norms
    then run on a sequence shard). The embedding splits over the vocabulary; the head gathers its logits.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        if sequence_parallel:
            top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)  # type: ignore[arg-type]
    for block in model.blocks():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if isinstance(block.feed_forward, FeedForward):  # an MoE MLP runs whole on each tp rank (check_supported)
            plan["feed_forward.w1"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
            if block.feed_forward.w3 is not None:
                plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            for name in ("attention", "feed_forward"):
                plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]


def apply_context_parallel(model: GPT, topo: Topology) -> None:
    """Swap every layer's attention for all-gather attention over the cp group, with true RoPE positions."""
    attention = AllGatherAttention(topo.group("cp"), topo.comm)
    for block in model.blocks():
        block.attention.core = attention
        block.attention.positions = attention.positions


def apply_fsdp(model: GPT, mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """FSDP2 per layer, then the rest (embedding, norm, head) as the root unit."""
    for block in model.blocks():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def reshard_after_forward(plan: Plan) -> bool:
    return plan.layout.zero == 3 and plan.layout.pp == 1


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
    params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, comm: CommTimer, over: int | None = None
) -> None:
    """Sum gradients over a replica group with one flat all-reduce and divide by `over` (default: the group's
    size, an average — ZeRO 0). Expert weights pass their expert-replica group (or None, held once) and the dp·cp
    size: each expert's gradient already sums the tokens of its whole expert-parallel group."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        with comm.span("dp"):  # dp even where the replica group is the cp group
            dist.all_reduce(flat, group=group)
    flat /= over or dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def local_grad_square_sum(
    params: list[torch.nn.Parameter], holders: int, spread: Mapping[int, int] | None = None
) -> torch.Tensor:
    """This rank's share of the squared global gradient norm.

    Every parameter of a stage is held by `holders` = dp·cp·tp ranks, as whole copies or as shards; a DTensor
    sharded over mesh dims of total size n has holders/n copies of each shard, and an expert spread over ep ranks
    (`spread`: id of the parameter -> ep) holders/ep copies. Dividing each local square sum by its copy count
    makes the sum over all ranks the exact squared norm, whatever the sharding.
    """
    terms = []
    spread = spread or {}
    for p in params:
        if p.grad is None:
            continue
        grad, shards = p.grad, spread.get(id(p), 1)
        if isinstance(grad, DTensor):
            shards = math.prod(grad.device_mesh.size(i) for i, pl in enumerate(grad.placements) if _is_shard(pl))
            grad = grad.to_local()
        norm = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32).double()  # stays on the device
        terms.append(norm.square() / (holders / shards))
    return torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.float64)


def _is_shard(placement: Placement) -> bool:
    # FSDP2 over a TP-sharded dim uses _StridedShard, which is neither `is_shard()` nor a Shard subclass.
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def clip_gradients(params: list[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale gradients so their global norm is at most `max_norm` (0 disables clipping)."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return
    coef = max_norm / (norm + 1e-6)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
