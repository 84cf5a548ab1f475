"""What one step of a plan costs, piece by piece: each pipeline action's compute and exposed communication, the
stage-to-stage transfers, the data-parallel reduction and gathers, the optimizer, and how a CPU host's cores are
shared — the inputs twin/step/pipeline.py simulates. Pure functions of a StepContext: the plan placed on its cluster.
"""

from __future__ import annotations

import math

from plan.schema import ModelSpec
from twin.step import schedules
from twin.step.comm_costs import edge_tp, layer_comm, zero3_layer_exposed
from twin.step.compute import DTENSOR_OPS_BACKWARD, DTENSOR_OPS_FORWARD, Device
from twin.step.context import StepContext, shape_of
from twin.step.ends import embedding_cost, head_cost
from twin.step.host import HostSharing, shares_cores
from twin.step.kernels import PassCost, Shape, layer_cost
from twin.step.memory import stage_layer_ranges, stage_params
from twin.step.pipeline_data import ActionCost

NORM_REDUCTION_BYTES = 8
"""The global gradient norm is one fp64 all-reduce over the whole job each step (Megatron and torchtitan clip by
the global norm)."""

ADAM_BYTES_PER_PARAM = 28
"""Bytes an Adam step moves per local parameter: reads fp32 master, m, v (12) and the bf16 gradient (2), writes
master, m, v (12) and the bf16 weight (2) (Rajbhandari et al. 2020 state layout)."""


def layer_costs(ctx: StepContext) -> dict[bool, PassCost]:
    """One microbatch's compute of a dense layer (False) and, for MoE models, of an MoE layer (True)."""
    m = ctx.plan.model
    kinds = (False, True) if m.is_moe else (False,)
    return {moe: layer_cost(m, shape_of(ctx), ctx.device, ctx.stack, moe, ctx.plan.layout.recompute) for moe in kinds}


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
    dispatch_s = ctx.stack.dispatch_us * 1e-6
    last = lay.num_stages - 1
    for stage, held in enumerate(stage_layer_ranges(plan)):
        f, b, w = (dict.fromkeys(("compute", "recompute", "tp", "cp", "ep", "dp"), 0.0) for _ in range(3))
        kernels = {"F": 0, "B": 0}
        moe_layers = 0
        head = head_cost(m, shape, ctx.device, ctx.stack)
        extras = (
            [embedding_cost(m, shape, ctx.device, ctx.grad_bytes, ctx.stack.grad_accumulation_upcast)]
            if stage == 0
            else []
        ) + ([head] if stage == last else [])
        layers = list(held)
        if stage == last and m.mtp_layers:  # multi-token prediction: a layer, a projection and the head again each
            layers += range(m.layers, m.layers + m.mtp_layers)
            extras += [mtp_projection_cost(m, shape, ctx.device), head] * m.mtp_layers
        for layer in layers:
            moe = m.is_moe_layer(layer)
            moe_layers += moe
            cost, comm = kinds[moe], comms[moe]
            f["compute"] += cost.forward_s
            b["compute"] += cost.backward_input_s
            (w if split else b)["compute"] += cost.backward_weight_s
            b["recompute"] += cost.recompute_s
            kernels["F"] += cost.kernels[0]
            kernels["B"] += cost.kernels[1] + (cost.kernels[0] if lay.recompute == "full" else 0)
            for axis in ("tp", "cp", "ep"):
                f[axis] += comm[axis][0]
                b[axis] += comm[axis][1] + (comm[axis][0] if lay.recompute == "full" else 0.0)
            if lay.zero == 3 and lay.pp == 1:
                fwd, bwd = zero3_layer_exposed(ctx, layer, cost)
                f["dp"], b["dp"] = f["dp"] + fwd, b["dp"] + bwd
        if lay.tp > 1:
            f["tp"], b["tp"] = f["tp"] + edges[stage][0], b["tp"] + edges[stage][1]
        amax = amax_reduction_s(ctx, len(layers)) + current_amax_s(ctx, len(layers), moe_layers)
        f["dp"], b["dp"] = f["dp"] + amax, b["dp"] + amax
        for extra in extras:
            f["compute"] += extra.forward_s
            b["compute"] += extra.backward_input_s
            (w if split else b)["compute"] += extra.backward_weight_s
            kernels["F"], kernels["B"] = kernels["F"] + extra.kernels[0], kernels["B"] + extra.kernels[1]
        # the host issues every kernel in eager mode: an action is no faster than its kernels' dispatch
        f["compute"] = max(f["compute"], kernels["F"] * dispatch_s)
        backward = b["compute"] + b["recompute"] + w["compute"]  # B and W together issue the backward's kernels
        b["compute"] += max(0.0, kernels["B"] * dispatch_s - backward)
        costs[("F", stage)] = ActionCost(**f)
        costs[("B", stage)] = ActionCost(**b)
        if split:
            costs[("W", stage)] = ActionCost(**w)
    return costs


def mtp_projection_cost(m: ModelSpec, shape: Shape, device: Device) -> PassCost:
    """A multi-token-prediction module's 2h → h projection of the joined embedding and hidden state (Megatron-Core's
    eh_proj, column-parallel over tp: multi_token_prediction.py), as a GEMM forward and its two backward GEMMs."""
    tokens, h, n = float(shape.tokens), float(m.hidden), m.hidden / shape.tp
    fwd = device.linear_s(tokens, n, 2 * h, DTENSOR_OPS_FORWARD)
    dgrad = device.linear_s(tokens, 2 * h, n, DTENSOR_OPS_BACKWARD / 2)
    wgrad = device.linear_s(2 * h, n, tokens, DTENSOR_OPS_BACKWARD / 2)
    gemm = 2.0 * tokens * n * 2 * h
    return PassCost(
        fwd, dgrad, wgrad, 0.0, gemm, 2 * gemm, 0.0, gemm_s=(dgrad, wgrad), forward_gemm_s=fwd, kernels=(1, 2)
    )


AMAX_BYTES_PER_LAYER = 4 * 3 * 4
"""fp32 amaxes one layer's fp8 GEMMs reduce each way: 4 GEMMs, at most 3 scaled tensors each (Transformer Engine
1.x's fp8 meta: input, weight and output forward; output and input gradients backward)."""


def amax_reduction_s(ctx: StepContext, layers: int) -> float:
    """Seconds of one model chunk's amax all-reduce for one microbatch, each way (Stack.fp8_amax_reduction): a
    latency-bound collective over the replica's tp, cp and dp ranks, exposed on the compute stream."""
    if ctx.plan.training.dtype != "fp8" or not ctx.stack.fp8_amax_reduction or layers == 0:
        return 0.0
    group = ctx.span("tp", "cp", "dp")
    return ctx.time("all_reduce", AMAX_BYTES_PER_LAYER * layers, group)


CURRENT_AMAX_BYTES = 4
"""One fp32 amax: what a current-scaled cast all-reduces over the tensor-parallel group before it casts."""


def current_amax_s(ctx: StepContext, layers: int, moe_layers: int = 0) -> float:
    """Seconds of the amax all-reduces current fp8 scaling adds to `layers` layers for one microbatch, each way
    (Stack.fp8_scaling "current"): under sequence parallelism a column-parallel GEMM's input and a row-parallel
    GEMM's output gradient are gathered over the tp ranks, so all of them must cast with one scale, and Transformer
    Engine 2.x all-reduces the amax over the tp group and waits for it before the cast (module/linear.py
    _customize_quantizers_float8_current_scaling, quantizer.cpp quantize_impl: `allreduce(...)->wait()`): forward
    the qkv and fc1 inputs, backward the proj and fc2 output gradients. An MoE layer's experts run Megatron-Core's
    grouped GEMMs, outside that tp gather: its attention block's two remain."""
    lay = ctx.plan.layout
    current = ctx.plan.training.dtype == "fp8" and ctx.stack.fp8_scaling == "current"
    if not current or lay.tp == 1 or not lay.sequence_parallel or layers == 0:
        return 0.0
    reductions = 2 * layers - moe_layers  # per layer: the attention block's, and the dense MLP's
    return reductions * ctx.time("all_reduce", CURRENT_AMAX_BYTES, ctx.span("tp"))


def host_sharing(ctx: StepContext) -> HostSharing | None:
    """On a CPU cluster: the node's cores, and how many of a node's ranks each simulated pipeline rank stands for
    (the ranks of node 0 by the rank grid: its pipeline ranks share its cores)."""
    cluster, lay = ctx.cluster, ctx.plan.layout
    if not shares_cores(cluster):
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
    if sharded_only and not (lay.zero >= 1 and lay.weight_replicas > 1):
        if lay.tp == 1:
            return 0
        return layers * (4 + (3 if m.glu else 2)) + int(first) + int(last)
    return layers * (4 + (3 if m.glu else 2) + 2) + int(first) + 2 * int(last)


def optimizer_s(ctx: StepContext) -> dict[int, float]:
    """Seconds of the Adam step on each pipeline rank: memory-bound over the parameters it updates — its ZeRO
    shard from stage 1 on (dense over dp·cp, experts over dp / ep · cp), all of its parameters without ZeRO — plus the
    optimizer's per-tensor ops (the job-wide gradient-norm all-reduce before it is the pipeline's barrier_s), and
    the stack's passes over the whole gradient buffer (Stack.grad_buffer_passes: on the compute stream, exposed)."""
    lay, eff = ctx.plan.layout, ctx.cluster.compute
    sharded_s = eff.sharded_kernel_overhead_us * 1e-6
    out = {}
    for rank, stages in enumerate(schedules.rank_stages(lay.schedule, lay.pp, lay.num_stages)):
        params = [stage_params(ctx.plan, s) for s in stages]
        if lay.zero >= 1:
            local = sum(p.dense / lay.weight_replicas + p.expert / lay.expert_replicas for p in params)
        else:
            local = sum(p.dense + p.expert for p in params)
        tensor_ops = eff.optimizer_kernels_per_tensor * sum(param_tensors(ctx, s) for s in stages)
        dtensor_ops = ADAM_DTENSOR_OPS * sum(param_tensors(ctx, s, sharded_only=True) for s in stages)
        host = tensor_ops * ctx.device.kernel_s + dtensor_ops * sharded_s
        passes = ctx.stack.grad_buffer_passes
        held = sum(p.dense + p.expert for p in params)
        buffer = ctx.device.memory_s(passes * ctx.grad_bytes * held, math.ceil(passes)) if passes else 0.0
        out[rank] = ctx.device.memory_s(ADAM_BYTES_PER_PARAM * local, 4) + host + buffer
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
