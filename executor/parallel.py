"""The plan's layout on real ranks: one DeviceMesh from the shared rank grid, tensor + sequence parallel with
DTensor, data parallel (gradient all-reduce or FSDP2) and context parallel attention. What happens to the
gradients after the backward is executor.gradients.

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
Under mixed precision FSDP2's policy gathers bf16 parameters and reduces in the plan's reduce dtype; ZeRO 0
autocasts to bf16 and all-reduces in the reduce dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from executor.commtime import CommTimer
from executor.context_parallel import AllGatherAttention, local_positions
from executor.mlp import FeedForward
from executor.model import GPT
from executor.moe import MoE, SequenceShare
from plan.rank_grid import Coords, RankGrid
from plan.schema import Plan

MESH_DIMS = ("pp", "dp", "cp", "tp")  # outermost first, as DeviceMesh dims


class LayoutError(ValueError):
    """A layout the plan allows but this executor cannot run yet, with what to change."""


def check_supported(plan: Plan) -> None:
    """Reject what the executor does not implement, before any process group exists."""
    m, lay = plan.model, plan.layout
    if lay.schedule_runs > 1:
        raise LayoutError(
            f"layout.schedule_runs: {lay.schedule_runs}: running the pipeline schedule several times a step (gradient "
            "accumulation outside it) is a twin-only layout; the executor runs every microbatch in one schedule "
            "(set schedule_runs: 1)"
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
    if m.mtp_layers:
        raise LayoutError("model.mtp_layers: multi-token prediction is a twin-only model for now; set mtp_layers: 0")
    if m.sliding_window is not None:
        raise LayoutError(
            "model.sliding_window: the executor's attention attends over the whole sequence; drop sliding_window "
            "(and full_attention_every) to run the model, or keep it for the twin"
        )
    if m.is_mla:
        raise LayoutError(
            "model.kv_lora_rank: multi-head latent attention is a twin-only model for now; the executor's layers "
            "project keys and values from the hidden state (drop kv_lora_rank, q_lora_rank and rope_head_dim)"
        )
    if lay.expert_tp is not None:
        raise LayoutError(
            f"layout.expert_tp: {lay.expert_tp}: folded experts (Megatron-Core's expert tensor parallelism over "
            "tp·cp·dp) are a twin-only layout; unset expert_tp so the executor keeps ep inside dp"
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

    @cached_property
    def sequence_share(self) -> SequenceShare | None:
        """The ranks holding parts of the same sequences at an MoE layer: cp, and tp under sequence parallelism
        (each tp rank then routes its own shard); None where every rank holds whole sequences. Built on every
        rank of an MoE plan (new_group is collective)."""
        lay = self.plan.layout
        sp = lay.tp > 1 and lay.sequence_parallel
        axes = [a for a, split in (("cp", lay.cp > 1), ("tp", sp)) if split]
        if not self.plan.model.is_moe or not axes:
            return None
        group = _own_group(self.grid.groups(*axes), self.rank)
        return SequenceShare(group, axes[0], lay.tp if sp else 1, self.sequence_positions)

    def sequence_positions(self, seq: int) -> torch.Tensor:
        """Positions along the whole sequence of the `seq` tokens per sequence this rank holds at an MoE layer:
        its cp rank's load-balanced chunks (executor/context_parallel.py), then under sequence parallelism its tp
        rank's contiguous slice of them (DTensor's Shard(1))."""
        lay, c = self.plan.layout, self.coords
        tp = lay.tp if lay.sequence_parallel else 1
        held = seq * tp
        cp_part = local_positions(held, c.cp, lay.cp) if lay.cp > 1 else torch.arange(held)
        rank = c.tp if tp > 1 else 0
        return cp_part[rank * seq : (rank + 1) * seq]

    @cached_property
    def expert_mesh(self) -> DeviceMesh:
        """The edp·cp ranks that hold this rank's experts, as a mesh FSDP2 shards the experts over (ZeRO > 0 with
        expert parallelism; one rank where each expert is held once)."""
        dims = ("pp", "edp", "ep", "cp", "tp")
        ranks = torch.tensor(np.ascontiguousarray(self.grid.mesh(dims)))
        mesh = DeviceMesh(self.mesh.device_type, ranks, mesh_dim_names=dims)
        return mesh["edp", "cp"]._flatten("edp_cp") if self.size("cp") > 1 else mesh["edp"]

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
    then run on a sequence shard). The embedding splits over the vocabulary, and so do the head's logits: the loss
    reads them sharded under `loss_parallel()` (Trainer), never gathering a [tokens, vocab] tensor.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
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
        if isinstance(block.feed_forward, FeedForward):  # an MoE MLP runs whole on each tp rank
            plan["feed_forward.w1"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
            if block.feed_forward.w3 is not None:
                plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            dense = isinstance(block.feed_forward, FeedForward)  # an MoE routes its own shard (SequenceShare)
            plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate() if dense else Shard(1),),
                use_local_output=not dense,
            )  # fmt: skip
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]


def apply_context_parallel(model: GPT, topo: Topology) -> None:
    """Swap every layer's attention for all-gather attention over the cp group, with true RoPE positions."""
    attention = AllGatherAttention(topo.group("cp"), topo.comm)
    for block in model.blocks():
        block.attention.core = attention
        block.attention.positions = attention.positions


def apply_fsdp(
    model: GPT, mesh: DeviceMesh, reshard_after_forward: bool, policy: MixedPrecisionPolicy, topo: Topology
) -> None:
    """FSDP2 per layer, then the rest (embedding, norm, head) as the root unit, all under one precision policy.

    Under expert parallelism each MoE layer's routed experts are one unit of their own, sharded over the ranks
    that hold the same experts (`Topology.expert_mesh`), as torchtitan shards them. Its reduce-scatter averages
    over those edp·cp ranks; the Trainer divides by ep after it (an expert's gradient already sums the tokens of
    its whole ep group; FSDP2's own divide factor needs PREMUL_SUM, which gloo lacks).
    """
    expert_mesh = topo.expert_mesh if topo.expert_parallel else None  # on every rank: building it is collective
    for block in model.blocks():
        if expert_mesh is not None and isinstance(block.feed_forward, MoE):
            experts = list(block.feed_forward.experts.values())
            fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)


def reshard_after_forward(plan: Plan) -> bool:
    return plan.layout.zero == 3 and plan.layout.pp == 1
