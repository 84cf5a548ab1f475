"""What a search learns about one candidate: whether the loader accepts it, whether it fits, a lower bound on its
step time (cheap, from cached per-layer costs), and its simulated step (in a worker process).

The bound (`Bounds`) is the busiest pipeline rank's work: a rank runs its actions one after another, each at least
as long as its layers' compute and exposed communication, after microbatch 0's forward has passed the stages before
it (embedding and head, bubbles, dispatch floors, the optimizer, stragglers and data waits only add), so no
simulated step is shorter. tests/test_search.py holds bound ≤ step on every candidate it
simulates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plan import loader
from plan.cluster import Cluster
from plan.errors import PlanError
from plan.schema import Plan
from plan.stack import Stack
from twin.search.space import Knobs, Shape, plan_data
from twin.step import schedules
from twin.step.comm_costs import dp_costs, layer_comm, p2p_costs, tied_embedding_s
from twin.step.context import PredictOptions, shape_of, step_context
from twin.step.costs import NORM_REDUCTION_BYTES, layer_costs, mtp_projection_cost, optimizer_s
from twin.step.ends import embedding_cost, head_cost
from twin.step.fabric import Fabric
from twin.step.memory import stage_layer_ranges
from twin.step.pipeline_data import PipelineInput
from twin.step.predict import predict, rank_memory, straggler_factor
from twin.step.steady import grown, sample_counts


@dataclass(frozen=True)
class Outcome:
    """A simulated candidate: what a planner compares."""

    step_time_s: float
    mfu: float
    days_to_train: float
    gpu_hours: float
    memory_peak_GiB: float
    memory_capacity_GiB: float
    breakdown_s: dict[str, float]
    microbatches_simulated: int


class Bounds:
    """Lower bounds on step time, from parts cached across the shapes that share them.

    Per layer and microbatch, the seconds of its forward and of its backward actions: compute and the exposed
    TP, CP and EP communication inside them, keyed by what they depend on. The model, stack and cluster are fixed in
    a search; of the layout, only the fields of LAYER_KEY — dp, the pipeline and the ZeRO stage change where a
    layer runs, not what it costs, since tp, cp and ep are the innermost axes of the rank order. Per pipeline rank,
    its dense and MoE layers and the layers of the stages before its first, keyed by pp, virtual stages and
    schedule. A miss builds the shape's plan (the loader's rules); a shape the loader rejects has no bound."""

    LAYER_KEY = (
        "tp", "cp", "ep", "expert_tp", "microbatch_size", "sequence_parallel", "recompute", "fused_projections"
    )  # fmt: skip

    def __init__(self, base: Mapping[str, Any], cluster: Cluster, stack: Stack) -> None:
        self.base, self.cluster, self.stack = base, cluster, stack
        self.fabric = Fabric(cluster)  # one for every candidate: its spans are cached per layout
        self._layer: dict[tuple[Any, ...], dict[Any, tuple[float, float]]] = {}
        self._ranks: dict[tuple[Any, ...], list[RankLayers]] = {}
        self.hits = self.misses = 0

    def step_s(self, shape: Shape, knob: Knobs) -> float | None:
        """Seconds no simulated step of the shape with these knobs is shorter than; None where the loader rejects
        it. For each pipeline rank: its actions run one after another (all of their layers' compute and exposed
        communication), and its first waits for microbatch 0's forward through every earlier stage."""
        lkey, rkey = self._keys(shape, knob)
        if lkey in self._layer and rkey in self._ranks:
            self.hits += 1
        else:
            self.misses += 1
            plan = build(plan_data(self.base, shape, knob), self.cluster)
            if isinstance(plan, str):
                return None
            if lkey not in self._layer:
                self._layer[lkey] = self._per_layer_s(plan)
            if rkey not in self._ranks:
                self._ranks[rkey] = _rank_layers(plan)
        cost = self._layer[lkey]
        dense, moe, embed, head = cost[False], cost.get(True, (0.0, 0.0)), cost["embedding"], cost["head"]
        m = shape.microbatches
        busiest = max(
            m * (r.dense * sum(dense) + r.moe * sum(moe) + r.first * sum(embed) + r.last * sum(head))
            + r.dense_before * dense[0] + r.moe_before * moe[0] + (not r.first) * embed[0]
            for r in self._ranks[rkey]
        )  # fmt: skip
        gpu = self.cluster.accelerator.kind != "cpu"  # a CPU host's skew counts its cores (costs.independent_ranks)
        return busiest * (straggler_factor(self.cluster, shape.gpus) if gpu else 1.0)

    def _keys(self, shape: Shape, knob: Knobs) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        layout = {**self.base["layout"], "expert_tp": None, **shape.layout(), **knob.layout()}
        lkey = (*(layout.get(k) for k in self.LAYER_KEY), min(shape.gpus, self.cluster.node.gpus), shape.schedule)
        return lkey, (shape.pp, shape.virtual_stages, shape.schedule)

    def _per_layer_s(self, plan: Plan) -> dict[Any, tuple[float, float]]:
        """Forward and backward seconds of one layer's actions for one microbatch (the lesser of the plain and the
        overlapped-pair costs where DualPipe or the stack's combined 1F1B pairs them), and the embedding's and the
        output head's compute."""
        ctx = step_context(plan, self.cluster, PredictOptions(), self.stack, self.fabric)
        full = plan.layout.recompute == "full"
        shape = shape_of(ctx)
        out: dict[Any, tuple[float, float]] = {}
        for name, extra in (
            (
                "embedding",
                embedding_cost(plan.model, shape, ctx.device, ctx.grad_bytes, ctx.stack.grad_accumulation_upcast),
            ),
            ("head", head_cost(plan.model, shape, ctx.device, ctx.stack)),
        ):
            out[name] = (extra.forward_s, extra.backward_input_s + extra.backward_weight_s)
            out[("W", name)] = (0.0, extra.backward_weight_s)
        for moe, c in layer_costs(ctx).items():
            options = []
            # a pair may hide the all-to-all (DualPipe-V, the combined 1F1B): the lesser is still a bound
            hideable = plan.layout.schedule == "dualpipe-v" or ctx.stack.ep_overlap
            for paired in (False, True) if hideable else (False,):
                comm = layer_comm(ctx, c, moe, paired)
                fwd = sum(comm[axis][0] for axis in comm)
                bwd = sum(comm[axis][1] for axis in comm) + (fwd if full else 0.0)
                options.append((c.forward_s + fwd, c.backward_input_s + c.recompute_s + bwd))
            forward, backward = min(options, key=sum)
            out[moe] = (forward, backward + c.backward_weight_s)
            out[("W", moe)] = (0.0, c.backward_weight_s)
        if plan.model.mtp_layers:  # the last stage's multi-token prediction: a layer, a projection, the head again
            n, layer = plan.model.mtp_layers, plan.model.is_moe
            proj = mtp_projection_cost(plan.model, shape, ctx.device)
            (hf, hb), (lf, lb) = out["head"], out[layer]
            hw, lw = out[("W", "head")][1], out[("W", layer)][1]
            proj_b = proj.backward_input_s + proj.backward_weight_s
            out["head"] = (hf + n * (lf + proj.forward_s + hf), hb + n * (lb + proj_b + hb))
            out[("W", "head")] = (0.0, hw + n * (lw + proj.backward_weight_s + hw))
        return out

    def pipeline_s(self, plan: Plan) -> float:
        """A tighter bound for a plan about to be simulated: the longest path through its schedule's actions, each
        as long as its layers' compute and exposed communication, every rank running its own in order and waiting
        for the stage before (forward) or after (backward) and its transfer; then the gradient buckets on the rank's
        link, the reduction they do not overlap, the step-end barrier and the optimizer. The simulation without
        link contention, parameter gathers and dispatch floors, which only add. Costs a few milliseconds; a
        simulation, tens."""
        lay, m = plan.layout, plan.model
        shape, knob = shape_from(plan), knobs_from(plan)
        if self.step_s(shape, knob) is None:
            return 0.0
        cost = self._layer[self._keys(shape, knob)[0]]
        split = schedules.splits_weight_grad(lay.schedule)
        durations: dict[tuple[str, int], float] = {}
        for stage, layers in enumerate(stage_layer_ranges(plan)):
            kinds = [m.is_moe_layer(i) for i in layers]
            extras = ["embedding"] * (stage == 0) + ["head"] * (stage == lay.num_stages - 1)
            f = sum(cost[k][0] for k in kinds) + sum(cost[e][0] for e in extras)
            b = sum(cost[k][1] for k in kinds) + sum(cost[e][1] for e in extras)
            w = sum(cost[("W", k)][1] for k in [*kinds, *extras]) if split else 0.0
            durations["F", stage], durations["B", stage], durations["W", stage] = f, b - w, w
        ctx = step_context(plan, self.cluster, PredictOptions(), self.stack, self.fabric)
        owner = schedules.stage_ranks(lay.schedule, lay.pp, lay.num_stages)
        count = plan.schedule_microbatches
        finish, done, exact = _walk(lay.schedule, lay.pp, lay.virtual_stages, count, durations, owner, p2p_costs(ctx))
        # each stage's gradient buckets queue on its rank's data-parallel link as its final backward runs (the
        # last one ready only as that action ends); then the rank reduces what its buckets did not overlap, meets
        # the others at the gradient-norm all-reduce (a barrier) and steps its optimizer; the first and last stage's
        # ranks all-reduce a tied embedding's gradient beside their reduction
        reduce_s, _, _ = dp_costs(ctx)
        tied = tied_embedding_s(ctx)
        final = "W" if split else "B"
        after, once = [], []
        for r in range(lay.pp):
            mine = [s for s in range(lay.num_stages) if owner[s] == r]
            ready = finish[r]
            if ctx.dp_overlap > 0:
                ends = {s: done[final, s] for s in mine}
                per_bucket = {s: ctx.dp_overlap * reduce_s.get(s, 0.0) / BUCKETS for s in mine}
                first = min(ends[s] - durations[final, s] * (1 - 1 / BUCKETS) for s in mine)
                link = max(first + BUCKETS * sum(per_bucket.values()), *(ends[s] + per_bucket[s] for s in mine))
                ready = max(ready, link)
            after.append(ready + (1 - ctx.dp_overlap) * sum(reduce_s.get(s, 0.0) for s in mine))
            once.append(sum(tied.get(s, 0.0) for s in mine))
        barrier = ctx.time("all_reduce", NORM_REDUCTION_BYTES, ctx.span("dp", "pp", "cp", "tp"))
        runs = lay.schedule_runs  # a step's runs in turn (the tied all-reduce, once a step, left out of several)
        last = max(a + t for a, t in zip(after, once, strict=True)) if runs == 1 else runs * max(after)
        step = last + barrier + max(optimizer_s(ctx).values())
        step *= 1.0 if exact else 1.0 - WALK_MARGIN
        gpu = self.cluster.accelerator.kind != "cpu"
        return step * (straggler_factor(self.cluster, shape.gpus) if gpu else 1.0)


@dataclass(frozen=True)
class RankLayers:
    """A pipeline rank's layers, dense and MoE, and those of the stages before its first."""

    dense: int
    moe: int
    dense_before: int
    moe_before: int
    first: bool
    """Holds the first stage (and the embedding)."""
    last: bool
    """Holds the last stage (and the output head)."""


WALK_MARGIN = 1e-9
"""How much an extended walk's bound is lowered: extending sums in another order than walking, so the two can differ
in the last digits, and a bound must not rise above the step it bounds."""


def _walk(
    schedule: str,
    pp: int,
    v: int,
    m: int,
    durations: Mapping[tuple[str, int], float],
    owner: Sequence[int],
    p2p_s: Mapping[tuple[int, int], float],
) -> tuple[list[float], dict[tuple[str, int], float], bool]:
    """`_longest_path` through the schedule's step of m microbatches, and whether it was walked whole (else
    extended, as twin/step/steady.py extends a step: walked for counts a period apart from past the warm-up, one
    more at a time until every figure grew alike over the last three, then grown by as many periods more as m
    needs; walked whole where that would cost as much)."""
    counts = sample_counts(schedule, pp, m)
    if counts is not None:
        step, n = counts[1] - counts[0], counts[-1]
        walks = [_longest_path(schedules.build(schedule, pp, v, c), durations, owner, p2p_s) for c in counts]
        spent = sum(counts)
        while spent < m:
            grown = _grown(walks[-3:], (m - n) / step)
            if grown is not None:
                return *grown, False
            n += step
            spent += n
            walks.append(_longest_path(schedules.build(schedule, pp, v, n), durations, owner, p2p_s))
    return *_longest_path(schedules.build(schedule, pp, v, m), durations, owner, p2p_s), True


Walk = tuple[list[float], dict[tuple[str, int], float]]


def _grown(walks: list[Walk], periods: float) -> Walk | None:
    """The last of three walks a period apart grown by `periods` more (steady.grown), if every figure grew alike."""
    (fa, la), (fb, lb), (fc, lc) = walks
    free = [grown(x, y, z, periods) for x, y, z in zip(fa, fb, fc, strict=True)]
    last = {key: grown(la[key], lb[key], lc[key], periods) for key in lc}
    if None in free or None in last.values():
        return None
    return [f for f in free if f is not None], {k: t for k, t in last.items() if t is not None}


def _longest_path(
    orders: tuple[tuple[schedules.Action, ...], ...],
    durations: Mapping[tuple[str, int], float],
    owner: Sequence[int],
    p2p_s: Mapping[tuple[int, int], float],
) -> tuple[list[float], dict[tuple[str, int], float]]:
    """When each rank finishes, and when the last action of each kind on each stage ends, if every action takes its
    duration, each rank runs its order, and an action starts once its rank is free and the action it depends on (the
    previous stage's forward, the next stage's backward, of the same microbatch) is done — and its result sent,
    where the two stages are on different ranks (`owner`), which takes at least the transfer's time (`p2p_s`)."""
    done: dict[tuple[str, int, int], float] = {}
    last_end: dict[tuple[str, int], float] = {}
    free = [0.0] * len(orders)
    at = [0] * len(orders)
    left = sum(len(o) for o in orders)
    last = len(owner) - 1
    while left:
        moved = False
        for rank, order in enumerate(orders):
            while at[rank] < len(order):
                a = order[at[rank]]
                source = a.stage - 1 if a.kind == "F" else a.stage + 1
                if a.kind == "W" or (a.kind == "F" and a.stage == 0) or (a.kind == "B" and a.stage == last):
                    dep = 0.0
                else:
                    sent = done.get((a.kind, source, a.microbatch))
                    if sent is None:
                        break
                    dep = sent + (p2p_s.get((source, a.stage), 0.0) if owner[source] != rank else 0.0)
                free[rank] = max(free[rank], dep) + durations[a.kind, a.stage]
                done[a.kind, a.stage, a.microbatch] = last_end[a.kind, a.stage] = free[rank]
                at[rank] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError("schedule deadlocks: an action waits on one that never runs")  # a schedules.py bug
    return free, last_end


BUCKETS: int = PipelineInput.__dataclass_fields__["buckets"].default  # type: ignore[assignment]
"""Gradient buckets per stage, as predict simulates them."""


def shape_from(plan: Plan) -> Shape:
    lay = plan.layout
    return Shape(lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.microbatch_size, lay.schedule, lay.virtual_stages,
                 plan.training.global_batch, lay.expert_tp or 0)  # fmt: skip


def knobs_from(plan: Plan) -> Knobs:
    lay = plan.layout
    return Knobs(lay.sequence_parallel, lay.recompute, lay.zero)


def _rank_layers(plan: Plan) -> list[RankLayers]:
    lay, m = plan.layout, plan.model
    ranges = stage_layer_ranges(plan)
    out = []
    for stages in schedules.rank_stages(lay.schedule, lay.pp, lay.num_stages):
        mine = [i for s in stages for i in ranges[s]]
        before = [i for s in range(min(stages)) for i in ranges[s]]
        moe_mine = sum(m.is_moe_layer(i) for i in mine)
        moe_before = sum(m.is_moe_layer(i) for i in before)
        first, last = 0 in stages, lay.num_stages - 1 in stages
        out.append(RankLayers(len(mine) - moe_mine, moe_mine, len(before) - moe_before, moe_before, first, last))
    return out


def memory_of(plan: Plan, cluster: Cluster, stack: Stack) -> tuple[float, float]:
    """Peak and capacity (GiB) of the plan's fullest rank, as `predict` reports them."""
    mem = rank_memory(plan, cluster, stack)
    return mem.peak, mem.capacity


def build(data: Mapping[str, Any], cluster: Cluster) -> Plan | str:
    """The candidate as a Plan, or the loader's one-line reason it is not one (a rule of plan/schema.py, or the
    cluster too small)."""
    try:
        plan = loader.validate_plan(data, "candidate")
        loader.check_fits_cluster(plan, cluster, "candidate")
    except (PlanError, ValueError) as exc:
        return str(exc)
    return plan


def simulate(data: Mapping[str, Any]) -> Outcome:
    """One candidate's step, simulated (run in a worker process: the plan travels as data)."""
    plan = loader.validate_plan(data, "candidate")
    pred = predict(plan)
    return Outcome(
        step_time_s=pred.step_time_s,
        mfu=pred.mfu,
        days_to_train=pred.days_to_train,
        gpu_hours=pred.gpu_hours,
        memory_peak_GiB=pred.memory.peak,
        memory_capacity_GiB=pred.memory.capacity,
        breakdown_s=dict(pred.breakdown_s),
        microbatches_simulated=pred.microbatches_simulated,
    )
