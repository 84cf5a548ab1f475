"""What a step's communication costs and how much of it the stack hides: tensor-parallel collectives per layer,
context- and expert-parallel exchanges, the stage-to-stage transfers, the data-parallel reduction and gathers.
Pure functions of a StepContext (twin/step/context.py).

Tensor parallelism per layer (Shoeybi et al. 2019; Korthikanti et al. 2022 §4.2.2): without sequence parallelism
an all-reduce after each of the two blocks forward and one before each backward; with it, an all-gather before and
a reduce-scatter after each block forward, and backward the gradient's all-gather, the saved input's all-gather
for the weight gradient and the input gradient's reduce-scatter. What is exposed depends on the stack:
none hides nothing (Megatron-LM 2021); `backward` overlaps the backward's input all-gather with the input-gradient
GEMMs and the reduce-scatter with the weight-gradient GEMMs (Megatron-LM 2022); `userbuffers` (Transformer
Engine) cuts each collective into chunks pipelined with its GEMM, so one chunk and whatever outlasts the GEMMs
stays exposed, and the GEMMs lose the SMs the collectives run on while they overlap.
"""

from __future__ import annotations

from plan.accelerator import DispatchKernel
from twin.step import schedules
from twin.step.collectives import all_to_all_time, node_forwarded_share, node_forwarded_time
from twin.step.context import DTYPE_BYTES, StepContext, shape_of
from twin.step.kernels import PassCost, mlp_tp, routed_load, routing_shard, sm_margin
from twin.step.memory import layer_params, stage_params


def overlapped(comm: float, compute: float, chunks: float) -> float:
    """Exposed seconds of `comm` pipelined in `chunks` with `compute`: the first chunk, and what the rest outlasts."""
    if comm <= 0:
        return 0.0
    return comm / chunks + max(0.0, comm * (1 - 1 / chunks) - compute)


def tp_comm(ctx: StepContext, cost: PassCost, moe: bool = False) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of one layer's tensor-parallel collectives for one microbatch. An MoE
    layer that runs the MLP whole on every tp rank (kernels.expert_split 1: the executor, or expert_tp 1: on the
    whole sequence, or under sequence parallelism on the rank's own shard) has the attention block's collectives
    only. One whose experts are split under sequence parallelism routes its own shard of tokens: the dispatcher
    all-gathers the top_k copies it receives over tp before the experts and reduce-scatters them after
    (Megatron-Core core_v0.10.0 moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher), plain collectives no GEMM
    hides; the attention block's (and a shared expert's) collectives overlap the attention GEMMs only."""
    m, lay, stack = ctx.plan.model, ctx.plan.layout, ctx.stack
    tokens = lay.microbatch_size * m.seq_len // lay.cp
    stream = tokens * m.hidden * ctx.comm_bytes
    tp = ctx.span("tp")
    dgrad, wgrad = cost.gemm_s
    forward_gemm = cost.forward_gemm_s
    mode = stack.tp_overlap
    split_mlp = not moe or mlp_tp(shape_of(ctx), moe=True) == lay.tp
    dispatched = moe and dispatches_shards(ctx)
    blocks = 2 if split_mlp else 1
    if dispatched:
        blocks = 1 + (1 if m.shared_experts else 0)
        forward_gemm, dgrad, wgrad = cost.attention_gemm_s
    if not lay.sequence_parallel:
        ar = ctx.time("all_reduce", stream, tp)
        fwd, bwd = blocks * ar, blocks * ar
        if mode != "none":  # the input gradient's all-reduce runs under the weight-gradient GEMM (async)
            bwd = max(0.0, blocks * ar - wgrad)
    else:
        per_element = tokens * m.hidden
        ag = blocks * ctx.time("all_gather", per_element * ctx.gather_bytes, tp)
        rs_out = blocks * ctx.time("reduce_scatter", per_element * ctx.reduce_bytes, tp)  # forward: the outputs
        rs = blocks * ctx.time("reduce_scatter", stream, tp)  # backward: the input gradients
        fwd = ag + rs_out
        if mode == "none":
            bwd = (2 if stack.sp_regather_input else 1) * ag + rs
        elif mode == "backward":
            bwd = ag + max(0.0, ag - dgrad) + max(0.0, rs - wgrad)
        else:
            # SM-driven shares (Stack.tp_overlap_sms): forward, the reduce-scatters of GEMMs without an SM margin;
            # backward, the input's re-gather and the input gradient's reduce-scatter; the all-gathers under
            # their GEMMs go over the copy engines
            shape = shape_of(ctx)
            row_gemms = ("proj", "fc2")[:blocks]
            unmargined = sum(1 for g in row_gemms if not sm_margin(stack, shape, g, moe)) / len(row_gemms)
            chunks = stack.tp_overlap_chunks
            exposed = overlapped(fwd, forward_gemm, chunks)
            fwd, hidden = exposed, fwd - exposed
            fwd += _contention(ctx, hidden * rs_out * unmargined / (ag + rs_out)) if hidden > 0 else 0.0
            exposed = overlapped(2 * ag, dgrad, chunks) + overlapped(rs, wgrad, chunks)
            hidden = 2 * ag + rs - exposed
            bwd = exposed + (_contention(ctx, hidden * (ag + rs) / (2 * ag + rs)) if hidden > 0 else 0.0)
    if dispatched:  # the gather's backward is a reduce-scatter and the scatter's a gather: the same two, exposed
        routed = tokens * m.top_k * routed_load(m) * m.hidden * ctx.ep_bytes[1]
        both = ctx.time("all_gather", routed, tp) + ctx.time("reduce_scatter", routed, tp)
        fwd, bwd = fwd + both, bwd + both
    # unfused projections: Q, K, V (and gate, up where the MLP is split) each all-reduce their input gradient
    extra = 0 if lay.fused_projections else (2 + (1 if m.glu and split_mlp else 0)) * ctx.time("all_reduce", stream, tp)
    return fwd, bwd + extra


def dispatches_shards(ctx: StepContext) -> bool:
    """Whether each tp rank routes its own sequence-parallel shard of an MoE layer's tokens (kernels.routing_shard)
    to experts split over tp, so that the routed copies are gathered over tp before the experts and scattered
    after (Megatron-Core); a stack that runs the experts whole on each tp rank (the executor) gathers nothing."""
    shape = shape_of(ctx)
    return routing_shard(shape) > 1 and mlp_tp(shape, moe=True) == shape.tp


def _contention(ctx: StepContext, overlap_s: float, held: float | None = None) -> float:
    """GEMM time lost to the SMs overlapped collectives occupy, for `overlap_s` seconds of overlap: `held` of them
    (Transformer Engine's tensor-parallel overlap, Stack.tp_overlap_sms, unless given)."""
    sms = ctx.cluster.accelerator.sm_count
    taken = ctx.stack.tp_overlap_sms if held is None else held
    return overlap_s * taken / sms if sms and overlap_s > 0 else 0.0


def layer_comm(ctx: StepContext, cost: PassCost, moe: bool, paired: bool = False) -> dict[str, tuple[float, float]]:
    """Exposed (forward, backward) seconds of one layer's TP, CP and EP communication for one microbatch.
    `paired`: the action runs in an overlapped forward-backward pair (DualPipe, Megatron-Core's combined 1F1B),
    whose compute hides its expert-parallel all-to-all."""
    m, lay = ctx.plan.model, ctx.plan.layout
    tokens = lay.microbatch_size * m.seq_len // lay.cp
    out = {"tp": (0.0, 0.0), "cp": (0.0, 0.0), "ep": (0.0, 0.0)}
    if lay.tp > 1:
        out["tp"] = tp_comm(ctx, cost, moe)
    if lay.cp > 1:
        out["cp"] = cp_comm(ctx, cost, tokens)
    if moe and lay.ep > 1:  # dispatch and combine all-to-alls of top_k copies of each token, each way
        routed = tokens // routing_shard(shape_of(ctx))
        moved = routed * m.top_k * m.hidden * routed_load(m)  # the busiest rank's share sets it
        span = ctx.span("ep")
        forwarding = forwards_between_nodes(ctx)
        kernel = dispatcher_kernels(ctx)
        groups = m.routing_groups
        sms = 0  # SMs the dispatcher's own kernels hold while they run
        if kernel is not None:  # the dispatcher's own kernels at their measured rates, inside a node or across
            sms = ctx.stack.ep_dispatch_sms or kernel.sms
            a2a = sum(
                node_forwarded_time(moved * width, span, m.top_k, kernel, sms, m.experts, groups)
                for width in ctx.ep_bytes
            )
        elif forwarding:
            share = node_forwarded_share(m.top_k, span.nodes, m.experts, groups)
            a2a = sum(all_to_all_time(moved * width, span, share) for width in ctx.ep_bytes)
        else:
            a2a = sum(ctx.time("all_to_all", moved * width, span) for width in ctx.ep_bytes)
        if paired:
            out["ep"] = (
                _paired_exposed(ctx, a2a, cost.forward_s, sms),
                _paired_exposed(ctx, a2a, cost.backward_input_s, sms),
            )
        else:
            out["ep"] = (a2a, a2a)
    return out


def _paired_exposed(ctx: StepContext, a2a: float, compute: float, sms: int) -> float:
    """Exposed seconds of a layer's all-to-all `a2a` beside the paired microbatch's `compute` (DualPipe, the
    combined 1F1B), whose hidden part still costs that compute the `sms` its dispatcher holds. Ideally (DualPipe, a
    stack's ep_overlap_hidden 1) the compute hides all it can: the compute outlasts the all-to-all by what those SMs
    cost it, or the all-to-all outlasts the compute. Else it hides the stack's measured share of that, the rest
    exposed after it."""
    hides = ctx.stack.ep_overlap_hidden if ctx.plan.layout.schedule != "dualpipe-v" else 1.0
    if hides == 1.0:
        return max(a2a - compute, _contention(ctx, a2a, sms))
    hidden = hides * min(a2a, compute)
    return a2a - hidden + _contention(ctx, hidden, sms)


def _node_forwarding(ctx: StepContext) -> bool:
    """Whether an MoE layer's expert-parallel dispatch runs a node-forwarding dispatcher's own kernels
    (Stack.ep_dispatch node-forwarding, ep > 1); a free-communication what-if prices none."""
    moe = ctx.plan.model.is_moe and ctx.plan.layout.ep > 1
    return moe and ctx.stack.ep_dispatch == "node-forwarding" and not ctx.options.free_comm


def forwards_between_nodes(ctx: StepContext) -> bool:
    """Whether an MoE layer's dispatch forwards tokens node to node (a node-forwarding dispatcher over an
    expert-parallel group that spans nodes) rather than sending each copy itself."""
    return _node_forwarding(ctx) and ctx.span("ep").nodes > 1


def dispatcher_kernels(ctx: StepContext) -> DispatchKernel | None:
    """The measured rates a node-forwarding dispatcher's own kernels run at (ComputeEfficiency.ep_dispatch), for an
    MoE layer whose expert-parallel group spans nodes or sits inside one (DeepEP's and HybridEP's intranode kernels
    also send a token once to each rank holding any of its experts); None where the stack sends every copy through
    NCCL's all-to-all, the accelerator has no rates, or communication is free."""
    return ctx.cluster.compute.ep_dispatch if _node_forwarding(ctx) else None


def dispatch_substitute(ctx: StepContext) -> str | None:
    """What a prediction should say when a node-forwarding dispatcher has no measured rates on the accelerator
    (ComputeEfficiency.ep_dispatch) and layer_comm moves it at NCCL's bandwidths instead; None otherwise."""
    if not forwards_between_nodes(ctx) or ctx.cluster.compute.ep_dispatch is not None:
        return None
    return (
        f"the stack's node-forwarding dispatcher has no measured rates for {ctx.cluster.accelerator.name} "
        "(compute.ep_dispatch); its NVLink stage is priced at NCCL's NVLink bandwidth"
    )


def cp_comm(ctx: StepContext, cost: PassCost, tokens: int) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of one layer's context-parallel exchange of K and V.

    ring (Megatron-Core's p2p): K and V pass around the cp ranks, one block of attention hiding each step (the
    backward's 2.5x longer blocks hide twice the traffic). all-gather (Llama 3 §3.3.2, the executor): every rank
    gathers the whole sequence's K and V before its attention and reduce-scatters their gradients after it,
    exposed."""
    m, lay = ctx.plan.model, ctx.plan.layout
    kv = tokens * m.n_kv_heads * (m.qk_head_dim + m.v_dim) / lay.tp * ctx.comm_bytes
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
    prefetched one layer ahead, so only what outlasts the layer's compute shows; with a `post` backward prefetch
    (Stack.fsdp_backward_prefetch) the backward's gather starts only when the layer after it is done, and shows
    whole."""
    p = layer_params(ctx.plan, layer)
    dp, edp = ctx.replica_spans()
    w, g = ctx.param_bytes, ctx.grad_bytes
    gather = ctx.time("all_gather", w * p.dense, dp) + ctx.time("all_gather", w * p.expert, edp)
    scatter = ctx.time("reduce_scatter", g * p.dense, dp) + ctx.time("reduce_scatter", g * p.expert, edp)
    backward = cost.backward_input_s + cost.backward_weight_s
    if ctx.stack.fsdp_backward_prefetch == "post":
        return max(0.0, gather - cost.forward_s), gather + max(0.0, scatter - backward)
    return max(0.0, gather - cost.forward_s), max(0.0, gather + scatter - backward)


def p2p_costs(ctx: StepContext) -> dict[tuple[int, int], float]:
    """Seconds to send one microbatch's activation (or its gradient) across each stage boundary. With the stack's
    scatter/gather (no sequence parallelism), each tp rank sends its 1/tp slice over its own NIC and the
    receiving node all-gathers the slices over NVLink (Narayanan et al. 2021, §4.1)."""
    lay, m = ctx.plan.layout, ctx.plan.model
    if lay.pp == 1:
        return {}
    pp_ranks = ctx.grid.group_of(0, "pp")
    tokens = lay.microbatch_size * m.seq_len // lay.cp
    whole = tokens * m.hidden * ctx.comm_bytes
    scatter = ctx.stack.pp_scatter_gather and not lay.sequence_parallel and lay.tp > 1
    nbytes = whole / lay.tp if lay.sequence_parallel or scatter else whole
    gather = ctx.time("all_gather", whole, ctx.span("tp")) if scatter else 0.0
    out = {}
    for stage in range(lay.num_stages - 1):
        a = pp_ranks[schedules.stage_rank(lay.schedule, lay.pp, stage)]
        b = pp_ranks[schedules.stage_rank(lay.schedule, lay.pp, stage + 1)]
        seconds = ctx.time("p2p", nbytes, ctx.fabric.span([a, b])) + gather if a != b else 0.0
        out[(stage, stage + 1)] = out[(stage + 1, stage)] = seconds
    return out


def dp_reduction(ctx: StepContext) -> tuple[str, int]:
    """The data-parallel gradient reduction's collective and the bytes per element it moves: an all-reduce without
    ZeRO, or under ZeRO-1 where the stack all-reduces the whole buffer (Stack.zero_grad_reduce), else a
    reduce-scatter; in the stack's wire dtype where it casts the buffer for the collective (Stack.grad_wire_dtype),
    else the buffer's."""
    lay, stack = ctx.plan.layout, ctx.stack
    all_reduce = lay.zero == 0 or (lay.zero == 1 and stack.zero_grad_reduce == "all-reduce")
    wire = DTYPE_BYTES[stack.grad_wire_dtype] if stack.grad_wire_dtype else ctx.grad_bytes
    return ("all_reduce" if all_reduce else "reduce_scatter"), wire


def tied_embedding_s(ctx: StepContext) -> dict[int, float]:
    """Per stage: the tied word embedding's gradient all-reduce between the stage holding the input embedding (the
    first) and the one holding the output layer that shares it (the last), on each tensor-parallel rank's vocabulary
    shard, in the gradient buffer's dtype, once the pipeline has flushed, exposed: Megatron's
    _allreduce_embedding_grads after the data-parallel reduction (core_v0.8.0 megatron/core/distributed/
    finalize_model_grads.py, after finish_grad_sync; megatron/training.py train_step in 2021), DeepSpeed's
    ReduceTiedGrads instruction just before it (runtime/pipe/schedule.py TrainSchedule, engine.py
    _exec_reduce_tied_grads on the fp32 gradient under bf16), the two back to back either way. None where the two
    stages share a rank (a V-shaped schedule) or the embeddings are not tied."""
    lay, m = ctx.plan.layout, ctx.plan.model
    last = lay.num_stages - 1
    if not m.tied_embeddings or last == 0:
        return {}
    pp_ranks = ctx.grid.group_of(0, "pp")
    a = pp_ranks[schedules.stage_rank(lay.schedule, lay.pp, 0)]
    b = pp_ranks[schedules.stage_rank(lay.schedule, lay.pp, last)]
    if a == b:
        return {}
    seconds = ctx.time("all_reduce", ctx.grad_bytes * m.vocab * m.hidden / lay.tp, ctx.fabric.span([a, b]))
    return {0: seconds, last: seconds}


def dp_costs(ctx: StepContext) -> tuple[dict[int, float], dict[int, float], float]:
    """Per stage: gradient reduction seconds (overlapped with the final backward as the stack does) and ZeRO-3
    gather seconds (pipelined FSDP); and the ZeRO-1/2 parameter all-gather after the optimizer."""
    plan, lay = ctx.plan, ctx.plan.layout
    reduce_s: dict[int, float] = {}
    gather_s: dict[int, float] = {}
    if lay.weight_replicas == 1 or (lay.zero == 3 and lay.pp == 1):
        return reduce_s, gather_s, 0.0
    dp, edp = ctx.replica_spans()
    op, g = dp_reduction(ctx)
    param_gather = 0.0
    w = ctx.param_bytes
    for stage in range(lay.num_stages):
        p = stage_params(plan, stage)
        reduce_s[stage] = ctx.time(op, g * p.dense, dp) + ctx.time(op, g * p.expert, edp)
        gather = ctx.time("all_gather", w * p.dense, dp) + ctx.time("all_gather", w * p.expert, edp)
        if lay.zero == 3:
            gather_s[stage] = gather
        elif lay.zero in (1, 2) and schedules.stage_rank(lay.schedule, lay.pp, stage) == 0:
            param_gather += gather
    return reduce_s, gather_s, param_gather
