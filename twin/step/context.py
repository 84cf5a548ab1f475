"""A plan placed on its cluster and run under its stack: the fabric, the rank grid, the device a rank sees, the
options — what every cost function of a step takes."""

from __future__ import annotations

from dataclasses import dataclass

from plan import loader
from plan.cluster import Cluster
from plan.rank_grid import RankGrid
from plan.schema import Plan
from plan.stack import Stack
from twin.step.collectives import InNetwork, collective_time
from twin.step.compute import Device, act_bytes
from twin.step.fabric import Fabric, GroupSpan
from twin.step.kept import Kept
from twin.step.kernels import Shape, expert_split
from twin.step.memory import weight_bytes

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class PredictOptions:
    """Switches for what-if and closed-form checks."""

    free_comm: bool = False
    """Every collective and send takes no time (isolates compute and the pipeline's own bubble)."""
    stragglers: bool = True
    """Apply the cluster's per-rank step-time variation (the slowest of N ranks)."""
    algorithm: str | None = None
    """Force one collective algorithm where it applies (ring, tree, hierarchical, nvls, sharp)."""
    every_microbatch: bool = False
    """Simulate every microbatch of the step; by default a long step is three short ones extended past their
    steady state (twin/step/steady.py), the same figures, but a timeline of the shortest (traces ask for all)."""
    relocated: tuple[tuple[int, int], ...] = ()
    """Job nodes running elsewhere in the cluster, as (job node, cluster node): a replacement from outside the job's
    rail group."""


@dataclass(frozen=True)
class StepContext:
    """A plan placed on its cluster under its stack."""

    plan: Plan
    cluster: Cluster
    stack: Stack
    fabric: Fabric
    grid: RankGrid
    device: Device
    net: InNetwork
    options: PredictOptions

    @property
    def comm_bytes(self) -> int:
        """Bytes per element of activation traffic between GEMMs (pipeline sends, context-parallel K and V,
        tensor-parallel reductions): fp32's 4 in fp32, 1 under fp8 where the stack keeps activations in fp8
        (Stack.fp8_activations), else 16 bits. The tensor-parallel gathers of GEMM inputs (`gather_bytes`) and an MoE
        layer's dispatch and combine (`ep_bytes`) have their own widths."""
        dtype = self.plan.training.dtype
        if dtype == "fp8":
            return 1 if self.stack.fp8_activations else 2
        return 4 if dtype == "fp32" else 2

    @property
    def gather_bytes(self) -> int:
        """Bytes per element of a tensor-parallel all-gather of a GEMM's input or output gradient: 1 under fp8 (the
        stack casts before it gathers), else comm_bytes."""
        return 1 if self.plan.training.dtype == "fp8" else self.comm_bytes

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of the forward reduce-scatter of a row-parallel output: 1 under fp8 where the stack
        reduces in fp8 (Stack.fp8_reduce_scatter), else comm_bytes."""
        return 1 if self.plan.training.dtype == "fp8" and self.stack.fp8_reduce_scatter else self.comm_bytes

    @property
    def ep_bytes(self) -> tuple[int, int]:
        """Bytes per element of an MoE layer's dispatch and combine: 16 bits under fp8 (the tokens are the layer's
        bf16 hidden states) but an fp8 dispatch where the stack sends one (Stack.fp8_dispatch), else comm_bytes."""
        if self.plan.training.dtype == "fp8":
            return (1 if self.stack.fp8_dispatch else 2), 2
        return self.comm_bytes, self.comm_bytes

    @property
    def grad_bytes(self) -> int:
        return grad_reduce_bytes(self.plan, self.stack)

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the weights the ZeRO gathers move (memory.weight_bytes)."""
        return weight_bytes(self.plan, self.stack)

    @property
    def dp_overlap(self) -> float:
        """Share of the gradient reduction bucketed under the last backward: none where the stack reduces after the
        pipeline flush, else the cluster profile's (1 on GPU clusters; measured for the executor on CPU hosts)."""
        if self.stack.dp_overlap_for(self.plan.layout.pp) == "none":
            return 0.0
        return self.cluster.compute.dp_overlap_fraction

    def span(self, *axes: str) -> GroupSpan:
        return self.fabric.group_span(self.grid, axes)

    def replica_spans(self) -> tuple[GroupSpan, GroupSpan]:
        """The ranks that hold the same dense weights (dp · cp, Layout.weight_replicas) and the same routed experts
        ((dp / ep) · cp, or the folded experts' edp, Layout.expert_replicas): the groups gradients reduce and ZeRO
        shards over."""
        return self.span("dp", "cp"), self.span("edp") if self.grid.folded else self.span("edp", "cp")

    def time(self, op: str, nbytes: float, span: GroupSpan) -> float:
        if self.options.free_comm:
            return 0.0
        return collective_time(op, nbytes, span, self.net, self._algorithm(op)).seconds  # type: ignore[arg-type]

    def _algorithm(self, op: str) -> str | None:
        forced = self.options.algorithm
        return forced if forced and op == "all_reduce" else None


def grad_reduce_bytes(plan: Plan, stack: Stack) -> int:
    """Bytes per element of the data-parallel gradient reduction: the plan's reduce dtype, else the stack's, else
    the compute dtype's (16 bits under fp8)."""
    tr = plan.training
    return max(2, DTYPE_BYTES[tr.grad_reduce_dtype or stack.grad_reduce_dtype or tr.dtype])


def step_context(
    plan: Plan, cluster: Cluster, options: PredictOptions, stack: Stack | None = None, fabric: Fabric | None = None
) -> StepContext:
    """The context every cost function takes; the plan's own stack unless one is given, and a fabric of its own
    unless one of `cluster` with `options`' relocations is given (a search shares one, and its span cache)."""
    lay = plan.layout
    node = cluster.node
    stack = stack or loader.plan_stack(plan)
    nvls = node.intra.bandwidth_GBps * 1e9 * node.nvls_efficiency if node.nvls and node.nvls_efficiency else None
    return StepContext(
        plan=plan,
        cluster=cluster,
        stack=stack,
        fabric=fabric or fabric_of(cluster, options.relocated),
        grid=RankGrid.from_layout(lay),
        device=Device.of(
            cluster,
            plan.training.dtype,
            min(lay.world_size, node.gpus),
            share_cores=cluster.accelerator.kind != "cpu",  # CPU hosts: shared in the simulation (twin/step/host.py)
            sharded=lay.tp > 1,
            attention_kernel=stack.attention_kernel,
            fp8_scaling=stack.fp8_scaling,
        ),
        net=InNetwork(nvls_link_Bps=nvls, sharp=cluster.fabric.sharp),
        options=options,
    )


_FABRICS: Kept[tuple[Cluster, Fabric]] = Kept(entries=8)


def fabric_of(cluster: Cluster, relocated: tuple[tuple[int, int], ...]) -> Fabric:
    """The fabric of `cluster` with `relocated` nodes, kept by the cluster's identity (the loader hands one object
    per cluster file and overrides), so that predictions of one cluster share its spans: at pp 64 working out the
    128 stage-to-stage links' spans again was a sixth of a prediction."""
    key = (id(cluster), relocated)
    hit = _FABRICS.get(key)
    if hit is not None and hit[0] is cluster:
        return hit[1]
    return _FABRICS.put(key, (cluster, Fabric(cluster, dict(relocated))))[1]


def shape_of(ctx: StepContext) -> Shape:
    """One microbatch of one layer on one rank."""
    lay, m = ctx.plan.layout, ctx.plan.model
    return Shape(
        tokens=lay.microbatch_size * m.seq_len // lay.cp,
        tp=lay.tp,
        sequence_parallel=lay.sequence_parallel,
        fused_projections=lay.fused_projections,
        microbatch=lay.microbatch_size,
        seq_kv=m.seq_len,
        experts_local=max(1, m.experts // lay.ep) if m.is_moe else 1,
        expert_tp=expert_split(lay, ctx.stack),
        act_bytes=act_bytes(ctx.plan.training.dtype),
        grad_bytes=ctx.grad_bytes,
    )
