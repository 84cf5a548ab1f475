"""Fit as a verdict: does a plan fit in its accelerators' memory, by how much is it over, and what single change
would make it fit. Cheap enough for `twin validate`: the memory model and the schedule's in-flight microbatches,
without simulating the step.

`memory` is the figure `predict` reports, by the same function (twin/step/predict.py `rank_memory`); tests/test_fit.py
holds the two equal for every preset and for plans that do not fit.
"""

from __future__ import annotations

from plan import loader
from plan.cluster import Cluster
from plan.errors import PlanError
from plan.schema import Plan
from twin.step.memory import MemoryBreakdown
from twin.step.predict import rank_memory

ALLOW_HINT = "pass --allow-oom to go on anyway"


def memory(plan: Plan, cluster: Cluster | None = None) -> MemoryBreakdown:
    """Memory of the plan's fullest pipeline rank (the figure `predict` reports), without simulating the step."""
    cluster = cluster or loader.plan_cluster(plan)
    return rank_memory(plan, cluster, loader.plan_stack(plan))


def check_fit(plan: Plan, cluster: Cluster | None = None) -> MemoryBreakdown:
    """The plan's memory if it fits; otherwise PlanError saying by how much it is over and what would fix it."""
    cluster = cluster or loader.plan_cluster(plan)
    mem = memory(plan, cluster)
    if not mem.fits:
        raise PlanError(oom_message(plan, cluster, mem))
    return mem


def oom_message(plan: Plan, cluster: Cluster, mem: MemoryBreakdown, allow_hint: bool = True) -> str:
    """One line: the plan does not fit, by how much, the single changes that would make it fit (and, with
    `allow_hint`, how to go on anyway)."""
    over = f"{plan.name}: does not fit in memory: {mem.peak:,.1f} GiB needed on pipeline rank {mem.pipeline_rank} of "
    over += f"{mem.capacity:,.1f} GiB per {cluster.accelerator.name}, over by {mem.peak - mem.capacity:,.1f} GiB"
    fixes = fixes_that_fit(plan, cluster)
    if fixes:
        hint = "it fits with " + " or ".join(fixes)
    else:
        hint = "no single change of zero, recompute, microbatch_size, tp or pp makes it fit; spread it over more GPUs"
    return f"{over}; {hint}" + (f"; or {ALLOW_HINT}" if allow_hint else "")


def fixes_that_fit(plan: Plan, cluster: Cluster, most: int = 3) -> list[str]:
    """Up to `most` single `--set` changes, among those a planner reaches for first, under which the plan is valid
    and fits, each with the peak it gives."""
    lay = plan.layout
    candidates: list[tuple[str, object]] = [("layout.zero", z) for z in range(lay.zero + 1, 4)]
    order = ["none", "selective", "full"]
    candidates += [("layout.recompute", r) for r in order[order.index(lay.recompute) + 1 :]]
    if lay.microbatch_size > 1:
        candidates.append(("layout.microbatch_size", lay.microbatch_size // 2))
    candidates += [("layout.tp", lay.tp * 2), ("layout.pp", lay.pp * 2)]
    found = []
    for field, value in candidates:
        section, key = field.split(".")
        data = plan.model_dump(mode="json")
        data[section][key] = value
        if key == "pp":
            data[section]["stage_layers"] = None
        try:
            variant = loader.validate_plan(data, "fix")
            mem = memory(variant, cluster)
        except (PlanError, ValueError):
            continue
        if mem.fits:
            found.append(f"{field}={value} ({mem.peak:,.1f} GiB)")
        if len(found) == most:
            break
    return found
