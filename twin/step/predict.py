"""Predict one optimizer step of a plan: time, where it goes, memory, MFU — by simulating one pipeline replica.

Every data-parallel replica does the same work on uniform hardware, so one replica's pipeline is simulated
(shared/DESIGN.md, "Scale without brute force"); the TP/CP/EP/DP groups of its ranks are placed on the fabric with
the shared rank grid, and their collectives cost what the fabric says. Variation between ranks enters as the median
of the slowest of N ranks' step-time multipliers, drawn from the extreme-value distribution of N lognormals.
What each action, transfer and reduction costs comes from twin/step/costs.py and comm_costs.py, under the plan's
software stack (plan/stack.py); this module runs the simulation and summarises it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from statistics import NormalDist
from typing import Any

from plan import loader
from plan.cluster import Cluster
from plan.model_math import model_flops_per_token, recompute_flops_per_token
from plan.schema import Plan
from plan.stack import Stack
from twin.step import schedules
from twin.step.collectives import collective_time
from twin.step.comm_costs import dispatch_substitute, dp_costs, dp_reduction, p2p_costs, tied_embedding_s
from twin.step.compute import Device, attention_substitute
from twin.step.context import PredictOptions, StepContext, grad_reduce_bytes, shape_of, step_context
from twin.step.costs import (
    NORM_REDUCTION_BYTES,
    host_sharing,
    independent_ranks,
    layer_costs,
    optimizer_s,
    stage_costs,
)
from twin.step.ends import head_cost
from twin.step.kernels import PassCost
from twin.step.memory import MemoryBreakdown, rank_breakdowns, stage_layer_ranges, stage_params
from twin.step.memory import activation_bytes as layer_activation_bytes
from twin.step.pipeline import no_cycle_collection, simulate
from twin.step.pipeline_data import PipelineInput, PipelineResult, Slice, Spans
from twin.step.steady import simulate_extended


@dataclass(frozen=True)
class StepPrediction:
    """One optimizer step of a plan, predicted."""

    plan: str
    cluster: str
    world_size: int
    num_microbatches: int
    step_time_s: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs utilisation by the convention Megatron-LM, PaLM (Appendix B) and Llama 3 publish: 6 FLOPs per
    matmul parameter per token plus 12 · layers · heads · head_dim · seq_len for the attention scores, unmasked,
    no recompute — against the dense peak of the plan's matmul dtype (fp8's own for fp8 plans)."""
    hfu: float
    """Hardware FLOPs utilisation (Korthikanti et al. 2022): the same count plus the recomputed work (so >= mfu)."""
    mfu_bf16: float
    """`mfu` against the dense bf16 peak (equal to mfu unless the plan trains in fp8)."""
    executed_utilisation: float
    """FLOPs the kernels really run (a fused causal attention skips the masked half; recompute included) over the
    peak: the device's busy share, which a correct model never puts above 1."""
    tflops_per_gpu: float
    """Model TFLOP/s per GPU (the MFU numerator)."""
    bubble_fraction: float
    memory: MemoryBreakdown
    fits: bool
    breakdown_s: dict[str, float]
    collectives: dict[str, dict[str, Any]]
    days_to_train: float
    gpu_hours: float
    events: int
    microbatches_simulated: int
    """Microbatches per replica the simulation ran: the plan's own, or fewer where a long step's steady state was
    extended to it (twin/step/steady.py); the timeline holds these."""
    slices: Spans = field(repr=False)
    """The simulated spans, as `timeline` lists them."""
    pp: int = field(repr=False)
    """Pipeline ranks: a stage's model chunk (virtual stage) is its number over this."""
    stage_phases_s: list[dict[str, float]] = field(default_factory=list, repr=False)
    """Per pipeline rank, where its step went in the executor's record vocabulary (plan.records.PHASES)."""
    notes: tuple[str, ...] = ()
    """How the prediction stood in for a figure the catalogue lacks (a kernel priced at another's figure), for the
    user to read beside it."""

    @cached_property
    def timeline(self) -> list[dict[str, Any]]:
        """Every span of the step, a row each (rank, stage, kind, microbatch, start_s, end_s, track, chunk): made
        when first asked for, as a deep pipeline's step has hundreds of thousands that most callers never read."""
        return [
            {
                "rank": s.rank,
                "stage": s.stage,
                "kind": s.kind,
                "microbatch": s.microbatch,
                "start_s": s.start,
                "end_s": s.end,
                "track": s.track,
                "chunk": s.stage // self.pp if s.stage >= 0 else -1,
            }
            for s in self.slices
        ]

    def to_json(self, timeline: bool = False) -> dict[str, Any]:
        out = asdict(replace(self, slices=Spans(())))
        del out["slices"], out["pp"]
        if timeline:
            out["timeline"] = self.timeline
        else:
            out.pop("stage_phases_s")
        return out


def straggler_factor(cluster: Cluster, ranks: int) -> float:
    """Median of the slowest of `ranks` lognormal step-time multipliers with sigma = the cluster's jitter_cv:
    the max of N draws has CDF F^N, so its median is F^-1(0.5^(1/N)) — one extreme-value quantile, not N draws."""
    sigma = cluster.stragglers.jitter_cv
    if sigma == 0 or ranks <= 1:
        return 1.0
    return math.exp(sigma * NormalDist().inv_cdf(0.5 ** (1.0 / ranks)))  # stdlib: scipy.stats costs 0.7 s to import


def rank_memory(plan: Plan, cluster: Cluster, stack: Stack) -> MemoryBreakdown:
    """Memory of the plan's fullest pipeline rank (see `rank_memories`). Needs no simulation, so `twin validate`
    calls it too (twin/fit.py)."""
    return max(rank_memories(plan, cluster, stack), key=lambda b: b.peak)


def rank_memories(plan: Plan, cluster: Cluster, stack: Stack) -> list[MemoryBreakdown]:
    """Memory of every pipeline rank: each stage's activations per in-flight microbatch in units of one dense
    layer's, the schedule's peak of those on each pipeline rank, then the memory model (twin/step/memory.py)."""
    lay, m = plan.layout, plan.model
    dense, kept = layer_activation_bytes(plan, stack, moe=False)
    moe = layer_activation_bytes(plan, stack, moe=True)[0] if m.is_moe else dense
    weights = {
        s: sum(moe / dense if m.is_moe_layer(i) else 1.0 for i in layers)
        for s, layers in enumerate(stage_layer_ranges(plan))
    }
    weights[lay.num_stages - 1] += m.mtp_layers * (moe / dense)  # multi-token prediction's layers keep theirs too
    kept_for_w = kept if schedules.splits_weight_grad(lay.schedule) else 0.0
    live = schedules.peak_live_per_rank(
        lay.schedule, lay.pp, lay.virtual_stages, plan.schedule_microbatches, weights, kept_for_w
    )
    return rank_breakdowns(plan, cluster, stack, live, grad_reduce_bytes(plan, stack))


DEFAULT_OPTIONS = PredictOptions()


def predict(plan: Plan, cluster: Cluster | None = None, options: PredictOptions = DEFAULT_OPTIONS) -> StepPrediction:
    """Predict one optimizer step of `plan` on its cluster."""
    with no_cycle_collection():  # its timeline alone is a dictionary per simulated span
        return _predict(plan, cluster, options)


def _predict(plan: Plan, cluster: Cluster | None, options: PredictOptions) -> StepPrediction:
    cluster = cluster or loader.plan_cluster(plan)
    ctx = step_context(plan, cluster, options)
    lay = plan.layout
    reduce_s, gather_s, param_gather = dp_costs(ctx)
    kinds = layer_costs(ctx)
    inp = PipelineInput(
        orders=(),  # each simulation's own, below
        stage_rank=schedules.stage_ranks(lay.schedule, lay.pp, lay.num_stages),
        costs=stage_costs(ctx, kinds),
        overlap_costs=stage_costs(ctx, kinds, paired=True) if _pairs_hide_all_to_all(ctx) else {},
        p2p_s=p2p_costs(ctx),
        split_w=schedules.splits_weight_grad(lay.schedule),
        dp_stage_s=reduce_s,
        tied_stage_s=tied_embedding_s(ctx),
        gather_stage_s=gather_s,
        optimizer_s=optimizer_s(ctx),
        barrier_s=ctx.time("all_reduce", NORM_REDUCTION_BYTES, ctx.span("dp", "pp", "cp", "tp")),
        dp_overlap=ctx.dp_overlap,
        host=host_sharing(ctx),
        blocking_sends=not ctx.stack.pp_overlap,
    )
    paired = _combined_1f1b(ctx)
    orders_for = functools.partial(schedules.build, lay.schedule, lay.pp, lay.virtual_stages, paired=paired)
    m = plan.schedule_microbatches
    if options.every_microbatch:
        result = simulate(replace(inp, orders=orders_for(m)))
    else:
        result = simulate_extended(inp, orders_for, lay.schedule, lay.pp, m)
    tied = {r: inp.tied_rank_s(r) for r in range(len(result.ranks))}
    result = repeated(result, lay.schedule_runs, inp.barrier_s, tied)
    return _summarise(ctx, result, rank_memory(plan, cluster, ctx.stack), param_gather, kinds)


def repeated(result: PipelineResult, runs: int, barrier_s: float, tied: Mapping[int, float]) -> PipelineResult:
    """A step of `runs` runs of the simulated schedule (Layout.schedule_runs), one after another: each run's fill,
    drain and gradient reduction again, the step-end gradient-norm all-reduce, a tied embedding's all-reduce (each
    rank's `tied` seconds: the trainer finalizes its gradients once a step) and the optimizer once. Every rank
    leaves the barrier at the same moment, so each run starts once the slowest rank has finished the one before; a
    later stage's exposed reduction that could overlap the next run's fill is counted whole (the bound errs slow).
    A rank's work and waits up to the barrier repeat `runs` times, the barrier, its optimizer and its wait for the
    slowest optimizer once. The timeline keeps the first run's actions, marks the other runs on each rank as one
    span ("runs") and moves the step's end (the last reduction, the barrier, the optimizer) after it."""
    if runs == 1:
        return result
    ranks, shift = [], {}
    for r, t in enumerate(result.ranks):
        tail = result.step_s - t.end  # waiting for the slowest optimizer, once
        once = tied.get(r, 0.0)
        before = t.end - t.optimizer - barrier_s - once  # the rank's run up to the barrier, less what runs once
        shift[r] = (runs - 1) * before
        ranks.append(
            replace(
                t,
                compute=runs * t.compute,
                recompute=runs * t.recompute,
                tp=runs * t.tp,
                cp=runs * t.cp,
                ep=runs * t.ep,
                dp=runs * t.dp,
                pp=runs * (t.pp - once) + once,
                forward=runs * t.forward,
                bubble=runs * (t.bubble - tail) - (runs - 1) * barrier_s + tail,
                end=t.end + shift[r],
            )
        )
    recorded = list(result.slices.recorded)
    # where each rank's first run ends: the start of its step-end spans (the last reduction, the barrier, the optimizer)
    run_ends = {r: min((s.start for s in recorded if s.rank == r and s.stage == -1), default=None) for r in shift}
    for i, s in enumerate(recorded):  # in place: the exposed collectives point at their actions' positions
        if s.stage == -1:
            recorded[i] = s._replace(start=s.start + shift[s.rank], end=s.end + shift[s.rank])
    recorded += [Slice(r, -1, "runs", -1, at, at + shift[r]) for r, at in run_ends.items() if at is not None]
    slices = Spans(recorded, result.slices.exposures, result.slices.tail)
    return replace(result, step_s=max(t.end for t in ranks), ranks=tuple(ranks), slices=slices)


def _combined_1f1b(ctx: StepContext) -> bool:
    """Whether the stack co-schedules forwards with backwards to hide the all-to-alls (Stack.ep_overlap), on a
    schedule Megatron-Core's combined 1F1B runs, for an expert-parallel MoE plan."""
    lay, m = ctx.plan.layout, ctx.plan.model
    return ctx.stack.ep_overlap and m.is_moe and lay.ep > 1 and schedules.pairs_forward_backward(lay.schedule, lay.pp)


def _pairs_hide_all_to_all(ctx: StepContext) -> bool:
    """DualPipe's overlapped pairs, and the combined 1F1B's, hide expert-parallel all-to-alls; elsewhere a pair
    costs what its halves do."""
    lay, m = ctx.plan.layout, ctx.plan.model
    return (lay.schedule == "dualpipe-v" and m.is_moe and lay.ep > 1) or _combined_1f1b(ctx)


def _summarise(
    ctx: StepContext, result: PipelineResult, memory: MemoryBreakdown, param_gather: float, kinds: dict[bool, PassCost]
) -> StepPrediction:
    plan, cluster, lay = ctx.plan, ctx.cluster, ctx.plan.layout
    critical = max(range(len(result.ranks)), key=lambda r: (result.ranks[r].end, -r))
    rt = result.ranks[critical]
    first = result.slices.first(0, "F")
    first_forward = first.end - first.start
    if ctx.stack.dp_overlap_for(lay.pp) == "grad+param":  # overlaps the next step's first forward
        gather_exposed = max(0.0, param_gather - first_forward)
    else:
        gather_exposed = param_gather
    base = result.step_s + gather_exposed
    straggle = base * (straggler_factor(cluster, independent_ranks(ctx)) - 1) if ctx.options.stragglers else 0.0
    token_bytes = 2 if plan.model.vocab <= 2**16 else 4
    read_s = plan.tokens_per_step * token_bytes / (cluster.storage.read_GBps * 1e9)
    data_wait = max(0.0, read_s - (base + straggle))  # the loader prefetches during the step
    step = base + straggle + data_wait
    breakdown = {
        "compute": rt.compute,
        "recompute": rt.recompute,
        "tp_comm": rt.tp,
        "cp_comm": rt.cp,
        "ep_comm": rt.ep,
        "pp_comm": rt.pp,
        "dp_comm_exposed": rt.dp + gather_exposed,
        "bubble": rt.bubble,
        "optimizer": rt.optimizer,
        "straggler": straggle,
        "data_wait": data_wait,
    }
    ranks_per_node = min(lay.world_size, cluster.node.gpus)
    peak = Device.of(cluster, plan.training.dtype, ranks_per_node).peak_flops
    bf16_peak = Device.of(cluster, "bf16", ranks_per_node).peak_flops
    tokens_per_s = plan.tokens_per_step / step
    model_flops = tokens_per_s * model_flops_per_token(plan.model)
    recomputed = tokens_per_s * recompute_flops_per_token(plan.model, lay.recompute)
    executed = _hardware_flops_per_step(ctx, kinds) / step / (lay.world_size * peak)
    if executed > 1.0 + 1e-9:  # an internal invariant: no device runs faster than its peak
        raise RuntimeError(f"{plan.name}: the step model runs {executed:.0%} of peak; a model error, please report it")
    days = plan.training.tokens / tokens_per_s / 86400
    return StepPrediction(
        plan=plan.name,
        cluster=cluster.name,
        world_size=lay.world_size,
        num_microbatches=plan.num_microbatches,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        mfu=model_flops / (lay.world_size * peak),
        hfu=(model_flops + recomputed) / (lay.world_size * peak),
        mfu_bf16=model_flops / (lay.world_size * bf16_peak),
        executed_utilisation=executed,
        tflops_per_gpu=model_flops / lay.world_size / 1e12,
        bubble_fraction=rt.bubble / step,
        memory=memory,
        fits=memory.fits,
        breakdown_s=breakdown,
        collectives=_collective_summary(ctx),
        days_to_train=days,
        gpu_hours=days * 24 * lay.world_size,
        events=result.events,
        microbatches_simulated=result.extended_from or plan.schedule_microbatches,
        slices=result.slices.then(_step_tail(result, gather_exposed, straggle, data_wait)),
        pp=lay.pp,
        stage_phases_s=[r.phases() for r in result.ranks],
        notes=_notes(ctx),
    )


def _notes(ctx: StepContext) -> tuple[str, ...]:
    """What the prediction priced with a stand-in figure: the stack's attention kernel at another's table
    (Device.of), a node-forwarding dispatcher without the accelerator's measured rates (comm_costs.layer_comm); and
    where the timeline shows less than the step (Layout.schedule_runs: one run of the schedule, then the step's end)."""
    notes = [attention_substitute(ctx.cluster, ctx.stack.attention_kernel, ctx.stack.flash), dispatch_substitute(ctx)]
    runs = ctx.plan.layout.schedule_runs
    if runs > 1:
        notes.append(
            f"the timeline shows the first of the step's {runs} schedule runs, the others as one span a rank "
            "('runs'), then the step's end (layout.schedule_runs)"
        )
    return tuple(n for n in notes if n)


def _step_tail(result: PipelineResult, gather: float, straggle: float, wait: float) -> tuple[Slice, ...]:
    """What the step adds after the simulated pipeline, on every rank: the exposed ZeRO parameter all-gather, the
    slowest rank's expected lag, and waiting for data, so the timeline ends where the step does."""
    spans, start = [], result.step_s
    for kind, seconds, track in (("DP", gather, "comm"), ("straggler", straggle, "compute"), ("data", wait, "compute")):
        if seconds > 0:
            spans += [Slice(r, -1, kind, -1, start, start + seconds, track) for r in range(len(result.ranks))]
            start += seconds
    return tuple(spans)


def _hardware_flops_per_step(ctx: StepContext, kinds: dict[bool, PassCost]) -> float:
    """FLOPs the kernels of the whole job run in one step (causal attention, recompute included)."""
    plan, lay, m = ctx.plan, ctx.plan.layout, ctx.plan.model
    per_layer = {moe: c.forward_flops + c.backward_flops + c.recompute_flops for moe, c in kinds.items()}
    total = per_layer[False] * (m.layers - m.moe_layers) + per_layer.get(True, 0.0) * m.moe_layers
    h = head_cost(m, shape_of(ctx), ctx.device, ctx.stack)
    total += h.forward_flops + h.backward_flops
    return total * plan.num_microbatches * lay.tp * lay.cp * lay.dp


def _collective_summary(ctx: StepContext) -> dict[str, dict[str, Any]]:
    """For each parallel axis: its group's span and the cost of its typical collective."""
    lay, m = ctx.plan.layout, ctx.plan.model
    tokens = lay.microbatch_size * m.seq_len // lay.cp
    stream = tokens * m.hidden * ctx.comm_bytes
    reduce_op, wire = dp_reduction(ctx)
    grads = wire * sum(stage_params(ctx.plan, s).dense for s in range(lay.num_stages)) / lay.num_stages
    typical = {
        "tp": ("all_gather" if lay.sequence_parallel else "all_reduce", stream),
        "cp": ("p2p", stream),
        "ep": ("all_to_all", stream * max(1, m.top_k)),
        "dp": (reduce_op, grads),
        "pp": ("p2p", stream / lay.tp if lay.sequence_parallel or ctx.stack.pp_scatter_gather else stream),
    }
    out = {}
    for axis, (op, nbytes) in typical.items():
        axes = ("dp", "cp") if axis == "dp" else (axis,)  # gradients reduce over every rank of the weights
        if math.prod(ctx.grid.size(a) for a in axes) == 1:
            continue
        span = ctx.span(*axes) if axis != "pp" else ctx.fabric.span(ctx.grid.group_of(0, "pp")[:2])
        cost = collective_time(op, nbytes, span, ctx.net)  # type: ignore[arg-type]
        out[axis] = {
            "op": op,
            "bytes": nbytes,
            "algorithm": cost.algorithm,
            "seconds": cost.seconds,
            "busbw_GBps": cost.busbw_Bps / 1e9,
            "tier": span.tier,
            "ranks": span.size,
            "per_node": span.per_node,
            "hops": span.hops,
        }
    return out
