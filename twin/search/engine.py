"""`twin search`: the best layouts for a model on a fleet.

The search walks shapes (twin/search/space.py) in order of a lower bound on their objective — the busiest rank's
compute, from per-layer costs cached across shapes that share them — and stops as soon as the next shape's bound
cannot beat the K-th best simulated so far: every shape left is bounded at least as high, so none of them could
enter the top K (pruning is exact: tests/test_search.py checks the top K against simulating every candidate). For a
shape it reaches, the loader builds each memory-for-time trade in order of time (the fastest recompute level first,
and within it the least sharding), keeps the first that fits at each recompute level, and simulates those in worker
processes, a batch at a time.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from plan import loader
from plan.errors import PlanError
from plan.limits import DEFAULT_LIMITS
from plan.model_math import model_flops_per_token
from plan.schema import Plan
from twin.budget import run_limits
from twin.search.evaluate import Bounds, Outcome, build, knobs_from, memory_of, shape_from, simulate
from twin.search.space import Knobs, Shape, Space, knobs, neutral, plan_data, restrict, shapes
from twin.step.compute import Device

Objective = Literal["time", "cost", "mfu", "goodput-time"]
OBJECTIVES: tuple[str, ...] = ("time", "cost", "mfu", "goodput-time")


@dataclass(frozen=True)
class Candidate:
    """A layout the search simulated (or, for the plan as given, tried to)."""

    shape: Shape
    knobs: Knobs
    plan: Plan
    outcome: Outcome
    cost_usd: float
    objective: float
    """The value ranked on, lower is better: days to train, dollars, or minus the MFU (goodput-time: wall days of
    the whole run, once the finalists are simulated with failures; days to train before)."""
    run_wall_days: float | None = None

    @property
    def headroom_GiB(self) -> float:
        return self.outcome.memory_capacity_GiB - self.outcome.memory_peak_GiB

    @property
    def label(self) -> str:
        s, k = self.shape, self.knobs
        parts = [f"TP{s.tp}", f"PP{s.pp}", f"DP{s.dp}"] + [f"CP{s.cp}"] * (s.cp > 1) + [f"EP{s.ep}"] * (s.ep > 1)
        parts += [f"ETP{s.expert_tp}"] * (s.expert_tp > 0)
        sched = {"interleaved-1f1b": f"int{s.virtual_stages}", "dualpipe-v": "dpv"}.get(s.schedule, s.schedule)
        recompute = {"none": "", "selective": " sel", "full": " full"}[k.recompute]
        return f"{'·'.join(parts)} {sched} m{s.microbatch_size} z{k.zero}{recompute}" + " sp" * k.sequence_parallel


@dataclass
class Tally:
    """What the search has done so far (the progress bar's counts)."""

    shapes: int = 0
    seen: int = 0
    invalid: int = 0
    over_memory: int = 0
    pruned: int = 0
    simulated: int = 0
    cost_cache_hits: int = 0


@dataclass
class SearchResult:
    top: list[Candidate]
    pareto: list[Candidate]
    """Simulated candidates no other beats on time to train, GPUs and memory headroom at once."""
    given: Candidate | str | None
    """The base plan's own layout, simulated, or the reason it cannot run; None when a model was given."""
    tally: Tally
    objective: str
    simulated: list[Candidate] = field(default_factory=list, repr=False)


def objective_of(objective: str, plan: Plan, step_s: float, usd_per_gpu_hour: float, peak_flops: float) -> float:
    """The objective of a plan whose step takes `step_s` (increasing in step_s for each objective)."""
    tokens_per_s = plan.tokens_per_step / step_s
    days = plan.training.tokens / tokens_per_s / 86400
    if objective == "cost":
        return days * 24 * plan.layout.world_size * usd_per_gpu_hour
    if objective == "mfu":
        return -tokens_per_s * model_flops_per_token(plan.model) / (plan.layout.world_size * peak_flops)
    return days


def search(
    base: Mapping[str, Any],
    space: Space,
    objective: str = "time",
    top_k: int = 5,
    workers: int | None = None,
    executor: Executor | None = None,
    progress: Callable[[Tally], None] | None = None,
    exhaustive: bool = False,
    given: Plan | str | None = None,
    seeds: int = 3,
) -> SearchResult:
    """The `top_k` best candidates of `space` for the base plan's model, cluster, stack and training (plan data,
    as loader.plan_data gives it). `exhaustive` simulates every candidate that fits (the brute force the pruned
    search is tested against). `executor` runs the simulations (default: a process pool of `workers`, all cores)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")
    probe = loader.validate_plan(neutral(base), "search base")
    cluster, stack = loader.plan_cluster(probe), loader.plan_stack(probe)
    price = cluster.economics.usd_per_gpu_hour
    peak = Device.of(cluster, probe.training.dtype, cluster.node.gpus).peak_flops
    rank_on = "time" if objective == "goodput-time" else objective
    space = restrict(space)
    fixed = {k: v for k, v in space.fixed.items() if not k.startswith("layout.")}
    base = loader.apply_overrides(dict(base), [f"{k}={v}" for k, v in fixed.items()])
    candidate_base = settled(base)
    bounds = Bounds(base, cluster, stack)
    tally = Tally()

    def score(plan: Plan, step_s: float) -> float:
        return objective_of(rank_on, plan, step_s, price, peak)

    tokens, flops_per_token = probe.training.tokens, model_flops_per_token(probe.model)

    def score_shape(shape: Shape, step_s: float) -> float:  # objective_of, from a shape
        tokens_per_s = shape.global_batch * probe.model.seq_len / step_s
        if rank_on == "mfu":
            return -tokens_per_s * flops_per_token / (shape.gpus * peak)
        days = tokens / tokens_per_s / 86400
        return days * 24 * shape.gpus * price if rank_on == "cost" else days

    # each shape's bound: its fastest trade (no recompute), whatever its memory
    bounded: list[tuple[float, Shape]] = []
    for shape in shapes(space, base["model"], base["layout"].get("edge_stage_trim", 0)):
        tally.shapes += 1
        fastest = knobs(space, shape.tp)[0]  # no recompute, sequence parallel where it is allowed: least compute
        bound = bounds.step_s(shape, fastest)
        if bound is None:
            tally.invalid += 1
            continue
        bounded.append((score_shape(shape, bound), shape))
    bounded.sort(key=lambda item: item[0])

    pool = executor or ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1)
    in_flight = 2 * (workers or os.cpu_count() or 1)  # enough to keep every worker busy while this one prunes
    best: list[Candidate] = []  # the top K so far, by (objective, _order): ties resolve as the final ranking does
    simulated: list[Candidate] = []
    pending: dict[Future[Outcome], tuple[Shape, Knobs, Plan]] = {}

    def collect(done: Iterable[Future[Outcome]]) -> None:
        for fut in done:
            shape, knob, plan = pending.pop(fut)
            outcome = fut.result()
            tally.simulated += 1
            cand = _candidate(shape, knob, plan, outcome, price, score)
            simulated.append(cand)
            bisect.insort(best, cand, key=_rank)
            del best[top_k:]

    def beaten(objective: float) -> bool:
        """No layout of this objective or worse can enter the top K (pruning waits for the K-th result); one equal
        to the K-th may still enter it by the order ties are ranked in."""
        return not exhaustive and len(best) >= top_k and objective > best[-1].objective

    try:
        for i, (bound, shape) in enumerate(bounded):
            if beaten(bound):
                tally.pruned += len(bounded) - i
                break
            for shape_, knob, plan in _trades_that_fit(candidate_base, shape, space, cluster, stack, tally):
                if beaten(score(plan, bounds.pipeline_s(plan))):
                    tally.pruned += 1  # its pipeline alone cannot beat the K-th best
                    continue
                pending[pool.submit(simulate, plan.model_dump(mode="json"))] = (shape_, knob, plan)
                while len(pending) >= in_flight:
                    collect(wait(pending, return_when=FIRST_COMPLETED).done)
            if progress:
                progress(tally)
        collect(wait(pending).done)
    finally:
        if executor is None:
            pool.shutdown(cancel_futures=True)
    tally.cost_cache_hits = bounds.hits
    top = best
    simulated.sort(key=_rank)
    if objective == "goodput-time":
        top = _by_goodput(top, seeds)
    mine = _given(given, cluster, stack, score, price) if isinstance(given, Plan) else given
    return SearchResult(top, pareto_front(simulated), mine, tally, objective, simulated)


SETTLED = ("model", "cluster", "stack", "reliability")
"""Plan sections no candidate changes."""


def settled(base: Mapping[str, Any]) -> dict[str, Any]:
    """The base plan data with the sections no candidate changes validated once, as section objects: a candidate's
    validation then takes them as they are (pydantic does not validate a model instance again) and checks its
    layout and training, and every rule across sections, as `twin validate` does. A third of a search's time was
    validating the same model, cluster and stack thousands of times."""
    plan = loader.validate_plan(neutral(base), "search base")
    return {**base, **{name: getattr(plan, name) for name in SETTLED}}


def _trades_that_fit(
    base: Mapping[str, Any], shape: Shape, space: Space, cluster: Any, stack: Any, tally: Tally
) -> list[tuple[Shape, Knobs, Plan]]:
    """Per recompute level, the shape's first memory-for-time trade that the loader accepts and that fits in
    memory: sequence parallelism before none (it only saves memory), then the least ZeRO sharding (more only adds
    gathers). Whether recompute or sharding costs less time depends on the shape, so each level is simulated."""
    out = []
    for recompute in space.recompute:
        level = [k for k in knobs(space, shape.tp) if k.recompute == recompute]
        lean = Knobs(any(k.sequence_parallel for k in level), recompute, max(k.zero for k in level))
        leanest = build(plan_data(base, shape, lean), cluster)  # sequence parallel where allowed, most sharding
        if isinstance(leanest, Plan) and _over(leanest, cluster, stack):
            tally.seen += len(level)
            tally.over_memory += len(level)
            continue  # memory only grows with less sharding
        for knob in level:
            tally.seen += 1
            plan = build(plan_data(base, shape, knob), cluster)
            if isinstance(plan, str):
                tally.invalid += 1
                continue
            peak, capacity = memory_of(plan, cluster, stack)
            if peak > capacity:
                tally.over_memory += 1
                continue
            out.append((shape, knob, plan))
            if knob.zero <= 1:
                return out  # fits with no sharding past the optimizer state: more recompute only costs time
            break
    return out


def _over(plan: Plan, cluster: Any, stack: Any) -> bool:
    peak, capacity = memory_of(plan, cluster, stack)
    return peak > capacity


def _rank(c: Candidate) -> tuple[Any, ...]:
    return (c.objective, _order(c))


def _order(c: Candidate) -> tuple[Any, ...]:
    """A fixed order among equal objectives, so a result does not depend on which worker finished first."""
    return (c.shape, c.knobs.recompute, c.knobs.zero, c.knobs.sequence_parallel)


def _by_goodput(top: list[Candidate], seeds: int) -> list[Candidate]:
    """The finalists re-ranked by the whole run's mean wall days over `seeds` seeds (failures, checkpoints)."""
    from twin import api

    out = []
    for cand in top:
        limits = run_limits(cand.plan, loader.plan_cluster(cand.plan), DEFAULT_LIMITS)
        try:
            wall = api.simulate_runs(cand.plan, seeds, limits=limits).stats["wall_days"]["mean"]
        except PlanError:  # its whole run cannot finish (failures outpace recovery): ranked after every one that can
            wall = math.inf
        out.append(replace(cand, run_wall_days=wall, objective=wall))
    return sorted(out, key=lambda c: c.objective)  # stable: equal ones (those that cannot finish) by step time


def _given(
    plan: Plan, cluster: Any, stack: Any, score: Callable[[Plan, float], float], price: float
) -> Candidate | str:
    """The plan as given, simulated like a candidate; or why it cannot run."""
    shape, knob = shape_from(plan), knobs_from(plan)
    peak, capacity = memory_of(plan, cluster, stack)
    if peak > capacity:
        return f"{plan.name}: does not fit in memory ({peak:,.1f} of {capacity:,.1f} GiB per GPU)"
    outcome = simulate(plan.model_dump(mode="json"))
    return _candidate(shape, knob, plan, outcome, price, score)


def _candidate(
    shape: Shape, knob: Knobs, plan: Plan, outcome: Outcome, price: float, score: Callable[[Plan, float], float]
) -> Candidate:
    """A simulated layout, priced and scored."""
    return Candidate(shape, knob, plan, outcome, outcome.gpu_hours * price, score(plan, outcome.step_time_s))


def pareto_front(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates that no other beats on all of: days to train (lower), GPUs (fewer), memory headroom (more)."""
    pool = list(candidates)

    def beats(a: Candidate, b: Candidate) -> bool:
        ka = (a.outcome.days_to_train, a.shape.gpus, -a.headroom_GiB)
        kb = (b.outcome.days_to_train, b.shape.gpus, -b.headroom_GiB)
        return all(x <= y for x, y in zip(ka, kb, strict=True)) and ka != kb

    front = [c for c in pool if not any(beats(o, c) for o in pool)]
    return sorted(front, key=lambda c: c.outcome.days_to_train)


def why_better(a: Candidate, b: Candidate, most: int = 2) -> str:
    """Where `a`'s step gains on `b`'s, per token: the components that differ most."""
    per_a = a.plan.tokens_per_step
    per_b = b.plan.tokens_per_step
    deltas = {
        k: a.outcome.breakdown_s.get(k, 0.0) / per_a - b.outcome.breakdown_s.get(k, 0.0) / per_b
        for k in set(a.outcome.breakdown_s) | set(b.outcome.breakdown_s)
    }
    scale = b.outcome.step_time_s / per_b
    ranked = sorted(deltas.items(), key=lambda kv: abs(kv[1]), reverse=True)[:most]
    parts = [f"{name} {delta / scale:+.1%}" for name, delta in ranked if abs(delta) > 1e-4 * scale]
    if parts:
        parts[0] += " of the next's time per token"
    if a.shape.gpus != b.shape.gpus:
        parts.append(f"{a.shape.gpus:,} vs {b.shape.gpus:,} GPUs")
    return ", ".join(parts) or "the same step"
