"""What one step of a plan costs, piece by piece: each pipeline action's compute and exposed communication, the
stage-to-stage transfers, the data-parallel reduction and gathers, the optimizer, and how a CPU host's cores are
shared — the inputs twin/step/pipeline.py simulates. Pure functions of a StepContext: the plan placed on its cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from plan.cluster import Cluster
from plan.rank_grid import RankGrid
from plan.schema import Plan
from twin.step import schedules
from twin.step.collectives import InNetwork, collective_time
from twin.step.compute import Device, PassCost, Shape, embedding_cost, head_cost, layer_cost
from twin.step.fabric import Fabric, GroupSpan
from twin.step.host import HostSharing
from twin.step.memory import layer_params, stage_layer_ranges, stage_params
from twin.step.pipeline import ActionCost

NORM_REDUCTION_BYTES = 8
"""The global gradient norm is one fp64 all-reduce over the whole job each step (Megatron and torchtitan clip by
the global norm)."""

ADAM_BYTES_PER_PARAM = 28
"""Bytes an Adam step moves per local parameter: reads fp32 master, m, v (12) and the bf16 gradient (2), writes
master, m, v (12) and the bf16 weight (2) (Rajbhandari et al. 2020 state layout)."""


@dataclass(frozen=True)
class PredictOptions:
    """Switches for what-if and closed-form checks."""

    free_comm: bool = False
    """Every collective and send takes no time (isolates compute and the pipeline's own bubble)."""
    stragglers: bool = True
    """Apply the cluster's per-rank step-time variation (the slowest of N ranks)."""
    algorithm: str | None = None
    """Force one collective algorithm where it applies (ring, tree, hierarchical, nvls, sharp)."""
    relocated: tuple[tuple[int, int], ...] = ()
    """Job nodes running elsewhere in the cluster, as (job node, cluster node): a replacement from outside the job's
    rail group."""


@dataclass(frozen=True)
class StepContext:
    """A plan placed on its cluster: the fabric, the rank grid, the device a rank sees, the options."""

    plan: Plan
    cluster: Cluster
    fabric: Fabric
    grid: RankGrid
    device: Device
    net: InNetwork
    options: PredictOptions

    @property
    def comm_bytes(self) -> int:
        """Bytes per element of activation traffic: fp8 where the plan trains in fp8 (DeepSeek-V3 §3.3 sends
        dispatch and activations in fp8); gradients stay bf16."""
        return {"fp8": 1, "fp32": 4}.get(self.plan.training.dtype, 2)

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the data-parallel gradient reduction (training.reduce_dtype)."""
        return 4 if self.plan.training.reduce_dtype == "fp32" else 2

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the weights the ZeRO gathers move: fp32 where the plan trains in fp32, else bf16."""
        return 4 if self.plan.training.dtype == "fp32" else 2

    def span(self, *axes: str) -> GroupSpan:
        return self.fabric.span(self.grid.group_of(0, *axes))

    def time(self, op: str, nbytes: float, span: GroupSpan) -> float:
        if self.options.free_comm:
            return 0.0
        return collective_time(op, nbytes, span, self.net, self._algorithm(op)).seconds  # type: ignore[arg-type]

    def _algorithm(self, op: str) -> str | None:
        forced = self.options.algorithm
        return forced if forced and op == "all_reduce" else None


def step_context(plan: Plan, cluster: Cluster, options: PredictOptions) -> StepContext:
    """The context every cost function below takes."""
    lay = plan.layout
    node = cluster.node
    nvls = node.intra.bandwidth_GBps * 1e9 * node.nvls_efficiency if node.nvls and node.nvls_efficiency else None
    return StepContext(
        plan=plan,
        cluster=cluster,
        fabric=Fabric(cluster, dict(options.relocated)),
        grid=RankGrid.from_layout(lay),
        device=Device.of(
            cluster,
            plan.training.dtype,
            min(lay.world_size, node.gpus),
            share_cores=cluster.accelerator.kind != "cpu",  # CPU hosts: shared in the simulation (twin/step/host.py)
            sharded=lay.tp > 1,
        ),
        net=InNetwork(nvls_link_Bps=nvls, sharp=cluster.fabric.sharp),
        options=options,
    )


def layer_comm(ctx: StepContext, cost: PassCost, moe: bool, paired: bool = False) -> dict[str, tuple[float, float]]:
    """Exposed (forward, backward) seconds of one layer's TP, CP and EP communication for one microbatch.
    `paired`: the action runs in an overlapped forward-backward pair (DualPipe), whose compute hides its
    expert-parallel all-to-all."""
    m, lay = ctx.plan.model, ctx.plan.layout
    tokens = lay.microbatch_size * m.seq_len // lay.cp
    stream = tokens * m.hidden * ctx.comm_bytes
    out = {"tp": (0.0, 0.0), "cp": (0.0, 0.0), "ep": (0.0, 0.0)}
    if lay.tp > 1:  # Megatron: two all-gathers and two reduce-scatters (SP), or two all-reduces, each way
        tp = ctx.span("tp")
        per_pass = (
            2 * ctx.time("all_gather", stream, tp) + 2 * ctx.time("reduce_scatter", stream, tp)
            if lay.sequence_parallel
            else 2 * ctx.time("all_reduce", stream, tp)
        )
        # unfused projections: Q, K, V (and gate, up) each all-reduce their input gradient in the backward
        extra = 0 if lay.fused_projections else (2 + (1 if m.glu else 0)) * ctx.time("all_reduce", stream, tp)
        out["tp"] = (per_pass, per_pass + extra)
    if lay.cp > 1:
        out["cp"] = cp_comm(ctx, cost, tokens)
    if moe and lay.ep > 1:  # dispatch and combine all-to-alls of top_k copies of each token, each way
        moved = tokens * m.top_k * m.hidden * ctx.comm_bytes
        a2a = 2 * ctx.time("all_to_all", moved, ctx.span("ep"))
        if paired:  # DualPipe overlaps it with the paired microbatch's compute
            out["ep"] = (max(0.0, a2a - cost.forward_s), max(0.0, a2a - cost.backward_input_s))
        else:
            out["ep"] = (a2a, a2a)
    return out


def cp_comm(ctx: StepContext, cost: PassCost, tokens: int) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of one layer's context-parallel exchange of K and V.

    ring (Megatron-Core's p2p): K and V pass around the cp ranks, one block of attention hiding each step (the
    backward's 2.5x longer blocks hide twice the traffic). all-gather (Llama 3 §3.3.2, the executor): every rank
    gathers the whole sequence's K and V before its attention and reduce-scatters their gradients after it,
    exposed."""
    m, lay = ctx.plan.model, ctx.plan.layout
    kv = 2 * tokens * m.n_kv_heads * m.d_head / lay.tp * ctx.comm_bytes
    if lay.cp_algorithm == "all-gather":
        gathered = kv * lay.cp
        span = ctx.span("cp")
        return ctx.time("all_gather", gathered, span), ctx.time("reduce_scatter", gathered, span)
    ring = (lay.cp - 1) * ctx.time("p2p", kv, ctx.span("cp"))
    attention = cost.attention_s
    return max(0.0, ring - attention), max(0.0, 2 * ring - 2.5 * attention)


def edge_tp(ctx: StepContext, stage: int) -> tuple[float, float]:
    """(forward, backward) seconds of the TP collectives outside the layers for one microbatch: the vocab-parallel
    embedding sums its partial outputs (an all-reduce; a reduce-scatter onto sequence shards under SP), and the
    column-parallel head's replicated input gathers its gradient in backward (an all-reduce; under SP an
    all-gather forward and a reduce-scatter backward)."""
    m, lay = ctx.plan.model, ctx.plan.layout
    stream = lay.microbatch_size * m.seq_len // lay.cp * m.hidden * ctx.comm_bytes
    tp = ctx.span("tp")
    fwd = bwd = 0.0
    if stage == 0:
        fwd += ctx.time("reduce_scatter" if lay.sequence_parallel else "all_reduce", stream, tp)
    if stage == lay.num_stages - 1:
        fwd += ctx.time("all_gather", stream, tp) if lay.sequence_parallel else 0.0
        bwd += ctx.time("reduce_scatter" if lay.sequence_parallel else "all_reduce", stream, tp)
    return fwd, bwd


def zero3_layer_exposed(ctx: StepContext, layer: int, cost: PassCost) -> tuple[float, float]:
    """FSDP without pipelining: each layer's weights are gathered before use and its gradients reduce-scattered,
    prefetched one layer ahead, so only what outlasts the layer's compute shows."""
    p = layer_params(ctx.plan, layer)
    dp = ctx.span("dp")
    gather = ctx.time("all_gather", ctx.param_bytes * (p.dense + p.expert), dp)
    scatter = ctx.time("reduce_scatter", ctx.grad_bytes * (p.dense + p.expert), dp)
    backward = cost.backward_input_s + cost.backward_weight_s
    return max(0.0, gather - cost.forward_s), max(0.0, gather + scatter - backward)


def shape_of(ctx: StepContext) -> Shape:
    lay, m = ctx.plan.layout, ctx.plan.model
    return Shape(lay.microbatch_size * m.seq_len // lay.cp, lay.tp, lay.sequence_parallel, lay.fused_projections)


def layer_costs(ctx: StepContext) -> dict[bool, PassCost]:
    """One microbatch's compute of a dense layer (False) and, for MoE models, of an MoE layer (True)."""
    lay, m = ctx.plan.layout, ctx.plan.model
    kinds = (False, True) if m.is_moe else (False,)
    return {
        moe: layer_cost(m, shape_of(ctx), ctx.device, moe, lay.recompute, lay.microbatch_size, m.seq_len // lay.cp)
        for moe in kinds
    }


def stage_costs(
    ctx: StepContext, kinds: dict[bool, PassCost], paired: bool = False
) -> dict[tuple[str, int], ActionCost]:
    """The cost of F, B (and W) of every model stage for one microbatch; with `paired`, as one half of an
    overlapped forward-backward pair (see layer_comm)."""
    plan, lay, m = ctx.plan, ctx.plan.layout, ctx.plan.model
    shape = shape_of(ctx)
    comms = {moe: layer_comm(ctx, cost, moe, paired) for moe, cost in kinds.items()}
    split = schedules.splits_weight_grad(lay.schedule)
    edges = {s: edge_tp(ctx, s) for s in range(lay.num_stages)} if lay.tp > 1 else {}
    costs: dict[tuple[str, int], ActionCost] = {}
    for stage, layers in enumerate(stage_layer_ranges(plan)):
        f, b, w = (dict.fromkeys(("compute", "recompute", "tp", "cp", "ep", "dp"), 0.0) for _ in range(3))
        extras = ([embedding_cost(m, shape, ctx.device)] if stage == 0 else []) + (
            [head_cost(m, shape, ctx.device)] if stage == lay.num_stages - 1 else []
        )
        for layer in layers:
            moe = m.is_moe and layer >= m.dense_layers
            cost, comm = kinds[moe], comms[moe]
            f["compute"] += cost.forward_s
            b["compute"] += cost.backward_input_s
            (w if split else b)["compute"] += cost.backward_weight_s
            b["recompute"] += cost.recompute_s
            for axis in ("tp", "cp", "ep"):
                f[axis] += comm[axis][0]
                b[axis] += comm[axis][1] + (comm[axis][0] if lay.recompute == "full" else 0.0)
            if lay.zero == 3 and lay.pp == 1:
                fwd, bwd = zero3_layer_exposed(ctx, layer, cost)
                f["dp"], b["dp"] = f["dp"] + fwd, b["dp"] + bwd
        if lay.tp > 1:
            f["tp"], b["tp"] = f["tp"] + edges[stage][0], b["tp"] + edges[stage][1]
        for extra in extras:
            f["compute"] += extra.forward_s
            b["compute"] += extra.backward_input_s
            (w if split else b)["compute"] += extra.backward_weight_s
        costs[("F", stage)] = ActionCost(**f)
        costs[("B", stage)] = ActionCost(**b)
        if split:
            costs[("W", stage)] = ActionCost(**w)
    return costs


def p2p_costs(ctx: StepContext) -> dict[tuple[int, int], float]:
    """Seconds to send one microbatch's activation (or its gradient) across each stage boundary."""
    lay, m = ctx.plan.layout, ctx.plan.model
    if lay.pp == 1:
        return {}
    pp_ranks = ctx.grid.group_of(0, "pp")
    tokens = lay.microbatch_size * m.seq_len // lay.cp
    nbytes = tokens * m.hidden * ctx.comm_bytes / (lay.tp if lay.sequence_parallel else 1)
    out = {}
    for stage in range(lay.num_stages - 1):
        a = pp_ranks[schedules.stage_rank(lay.schedule, lay.pp, stage)]
        b = pp_ranks[schedules.stage_rank(lay.schedule, lay.pp, stage + 1)]
        seconds = ctx.time("p2p", nbytes, ctx.fabric.span([a, b])) if a != b else 0.0
        out[(stage, stage + 1)] = out[(stage + 1, stage)] = seconds
    return out


def dp_costs(ctx: StepContext) -> tuple[dict[int, float], dict[int, float], float]:
    """Per stage: gradient reduction seconds (overlapped with the final backward) and ZeRO-3 gather seconds
    (pipelined FSDP); and the ZeRO-1/2 parameter all-gather after the optimizer."""
    plan, lay = ctx.plan, ctx.plan.layout
    reduce_s: dict[int, float] = {}
    gather_s: dict[int, float] = {}
    if lay.dp == 1 or (lay.zero == 3 and lay.pp == 1):
        return reduce_s, gather_s, 0.0
    dp, edp = ctx.span("dp"), ctx.span("edp")
    op = "all_reduce" if lay.zero == 0 else "reduce_scatter"
    param_gather = 0.0
    g, w = ctx.grad_bytes, ctx.param_bytes
    for stage in range(lay.num_stages):
        p = stage_params(plan, stage)
        reduce_s[stage] = ctx.time(op, g * p.dense, dp) + ctx.time(op, g * p.expert, edp)
        gather = ctx.time("all_gather", w * p.dense, dp) + ctx.time("all_gather", w * p.expert, edp)
        if lay.zero == 3:
            gather_s[stage] = gather
        elif lay.zero in (1, 2) and schedules.stage_rank(lay.schedule, lay.pp, stage) == 0:
            param_gather += gather
    return reduce_s, gather_s, param_gather


def host_sharing(ctx: StepContext) -> HostSharing | None:
    """On a CPU cluster: the node's cores, and how many of a node's ranks each simulated pipeline rank stands for
    (the ranks of node 0 by the rank grid: its pipeline ranks share its cores)."""
    cluster, lay = ctx.cluster, ctx.plan.layout
    if cluster.accelerator.kind != "cpu":
        return None
    per_node = min(lay.world_size, cluster.node.gpus)
    stages_on_node = len({ctx.grid.coords(r).pp for r in range(per_node)})
    cores = cluster.node.effective_cores or cluster.node.cpu_cores
    return HostSharing(
        cores=cores,
        weight=per_node / stages_on_node,
        ranks_per_pool=stages_on_node,
        physical_cores=cluster.node.cpu_cores,
        wakeup_s=cluster.node.wakeup_latency_us * 1e-6,
        blocked_stretch=max(1.0, per_node / cluster.node.cpu_cores),
    )


ADAM_DTENSOR_OPS = 8
"""Ops torch's single-tensor AdamW runs on a DTensor parameter, each paying the sharded per-op cost: two mul_, lerp_,
addcmul_, sqrt, div, add_ and addcdiv_ (its step counter is a plain tensor). Counted with a TorchDispatchMode over
one optimizer step of cpu-tiny under TP 2 (torch 2.13): 240 ops for its 30 sharded parameters."""


def param_tensors(ctx: StepContext, stage: int, sharded_only: bool = False) -> int:
    """Parameter tensors of one model stage: per layer Q, K, V, O, the MLP's two or three and two norm gains;
    the embedding on the first stage, the final norm and head on the last. With `sharded_only`, those that are
    DTensors: every one under FSDP (ZeRO 1-3 over more than one replica), else the tensor-parallel matrices."""
    m, lay = ctx.plan.model, ctx.plan.layout
    layers = len(stage_layer_ranges(ctx.plan)[stage])
    first, last = stage == 0, stage == lay.num_stages - 1
    if sharded_only and not (lay.zero >= 1 and lay.dp * lay.cp > 1):
        if lay.tp == 1:
            return 0
        return layers * (4 + (3 if m.glu else 2)) + int(first) + int(last)
    return layers * (4 + (3 if m.glu else 2) + 2) + int(first) + 2 * int(last)


def optimizer_s(ctx: StepContext) -> dict[int, float]:
    """Seconds of the Adam step on each pipeline rank: memory-bound over the parameters it updates — its ZeRO
    shard from stage 1 on (dense over dp, experts over dp / ep), all of its parameters without ZeRO — plus the
    optimizer's per-tensor ops (the job-wide gradient-norm all-reduce before it is the pipeline's barrier_s)."""
    lay, eff = ctx.plan.layout, ctx.cluster.compute
    sharded_s = eff.sharded_kernel_overhead_us * 1e-6
    out = {}
    for rank in range(lay.pp):
        stages = [s for s in range(lay.num_stages) if schedules.stage_rank(lay.schedule, lay.pp, s) == rank]
        params = [stage_params(ctx.plan, s) for s in stages]
        if lay.zero >= 1:
            local = sum(p.dense / lay.dp + p.expert / (lay.dp // lay.ep) for p in params)
        else:
            local = sum(p.dense + p.expert for p in params)
        tensor_ops = eff.optimizer_kernels_per_tensor * sum(param_tensors(ctx, s) for s in stages)
        dtensor_ops = ADAM_DTENSOR_OPS * sum(param_tensors(ctx, s, sharded_only=True) for s in stages)
        host = tensor_ops * ctx.device.kernel_s + dtensor_ops * sharded_s
        out[rank] = ctx.device.memory_s(ADAM_BYTES_PER_PARAM * local, 4) + host
    return out


def independent_ranks(ctx: StepContext) -> int:
    """Ranks whose step-time noise is independent, for the straggler skew: every accelerator; on a CPU cluster
    with more ranks on a node than cores, the node's cores. The OS scheduler is work-conserving, so what one
    co-located rank loses of the node's cores another gains, and the node finishes its work no later; the
    processor sharing in the pipeline simulation already holds what that sharing costs."""
    lay, cluster = ctx.plan.layout, ctx.cluster
    if cluster.accelerator.kind != "cpu":
        return lay.world_size
    nodes = -(-lay.world_size // cluster.node.gpus)
    per_node = min(lay.world_size, cluster.node.gpus)
    return nodes * min(per_node, cluster.node.cpu_cores)
