"""The same model on several fleets: each fleet's best layout (a search on that fleet), then the whole run on it
— time, cost, energy and goodput side by side. What `twin fleet`, `twin search --sweep cluster=...` and the
dashboard's Fleets tab show.

A fleet is compared at its own best layout, not at one layout carried over: a 9,216-chip TPU pod cannot hold a
100k-GPU plan's data parallelism, and a layout tuned for one scale-up domain (8 GPUs, 72, a torus) wastes another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from plan import loader
from plan.errors import PlanError
from plan.limits import DEFAULT_LIMITS, Limits
from plan.schema import Plan
from twin.budget import run_limits
from twin.fidelity import record
from twin.search import front
from twin.search.engine import Tally

FLEET_COLUMNS = (
    "cluster", "accelerator", "fleet_gpus", "gpus", "layout", "stack", "batch_tokens", "step_time_s", "mfu",
    "memory_peak_GiB", "ideal_days", "wall_days", "goodput", "cost_usd", "energy_mwh", "published_rows",
    "published_mean_abs_error", "reason", "note",
)  # fmt: skip
"""A fleet row's columns, in the order tables print them. `published_rows` and `published_mean_abs_error`: the
twin's record on published runs of the best plan's kind on that fleet's accelerator (twin/fidelity.py; 0 rows
where none is checked)."""


def compare(
    source: str | Mapping[str, Any],
    clusters: Sequence[str],
    overrides: Iterable[str] = (),
    *,
    gpus: front.Range | None = None,
    batch_tokens: front.Range | None = None,
    objective: str = "time",
    fixes: Iterable[str] = (),
    seeds: int = 1,
    workers: int | None = None,
    progress: Callable[[str, Tally | None], None] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> pd.DataFrame:
    """A row per fleet in `clusters`: the best layout of `source` (a model preset or a plan) on it by `objective`,
    and that layout's whole run over `seeds` seeds (mean wall days, goodput, cost, energy). A fleet where nothing
    fits gets a row with the reason; one whose best layout's whole run cannot finish keeps its step figures and
    says why its run does not — unless fewer of its GPUs can finish it, or finish it sooner: then the row is the
    fastest whole run on fewer (halving the count while the run's wall days shrink), with a `note` saying so.
    `progress(cluster, tally)` follows each search. The best plans themselves are in the frame's `attrs["plans"]`,
    by fleet."""
    if not clusters:
        raise PlanError("fleet: name at least one cluster to compare (twin presets lists them)")
    overrides = _with_policy(source, list(overrides))
    rows, plans = [], {}
    for name in clusters:
        report = (lambda t, n=name: progress(n, t)) if progress else None
        try:
            cluster = loader.load_cluster(name)
        except PlanError as exc:
            rows.append({"cluster": name, "reason": str(exc)})
            continue
        row: dict[str, Any] = {"cluster": name, "accelerator": cluster.accelerator.name, "fleet_gpus": cluster.gpus}
        ask = _Ask(source, name, overrides, batch_tokens, objective, tuple(fixes), seeds, workers, report, limits)
        try:
            found, plans[name] = _best_run(ask, cluster.gpus, gpus)
            row |= found
        except PlanError as exc:
            row["reason"] = str(exc)
        best = plans.get(name)
        if best is not None:
            checked = record(best, loader.plan_cluster(best)).found
            row["published_rows"] = checked.rows if checked else 0
            row["published_mean_abs_error"] = checked.mean_abs_error if checked else None
        rows.append(row)
    frame = pd.DataFrame(rows, columns=list(FLEET_COLUMNS))
    for text in ("reason", "note"):  # empty where none (a column no row fills would otherwise be float NaN)
        frame[text] = frame[text].astype(object).fillna("")
    frame.attrs["plans"] = {name: plan for name, plan in plans.items() if plan is not None}  # run or not
    return frame


def _with_policy(source: str | Mapping[str, Any], overrides: list[str]) -> list[str]:
    """A model compared across fleets runs under elastic shrink unless `reliability.elastic` is set: the job drops a
    failed node's data-parallel replicas and grows back when it returns, as the reference plan does. Without spares
    a gang-scheduled job waits out every repair (48 h in the catalogue's failure sections), which at 100k GPUs
    leaves no fleet any goodput to compare. A plan keeps its own policy."""
    model = isinstance(source, str) and source in loader.model_presets()
    if model and not any(o.startswith("reliability.elastic") for o in overrides):
        return [*overrides, "reliability.elastic=true"]
    return overrides


SMALLEST_SHARE = 64
"""A fleet whose whole run cannot finish, or finishes late, is tried on halves of it down to this fraction of its
GPUs."""


@dataclass(frozen=True)
class _Ask:
    """One fleet's search as the comparison asks it: everything but how many GPUs it may take."""

    source: str | Mapping[str, Any]
    name: str
    overrides: list[str]
    batch_tokens: front.Range | None
    objective: str
    fixes: tuple[str, ...]
    seeds: int
    workers: int | None
    progress: Callable[[Tally], None] | None
    limits: Limits


def _best_run(ask: _Ask, fleet_gpus: int, gpus: front.Range | None) -> tuple[dict[str, Any], Plan | None]:
    """The best layout on fleet `name` (the whole fleet unless `gpus` says otherwise), its whole run, and its plan.
    Where that run cannot finish (failures outpace recovery at that scale), or finishes so late that half as many
    GPUs could be faster (`_half_may_win`), the same search on half as many GPUs, and on halves of that while the
    whole run gets shorter: a planner's answer is then how much of the fleet one synchronous job should take."""
    if isinstance(gpus, tuple):  # a range of counts the user explores: its best, as it comes
        return _run_at(ask, gpus)
    most = int(min(gpus, fleet_gpus)) if gpus else fleet_gpus
    row, plan = _run_at(ask, most)
    if plan is None or not (row["reason"] or _half_may_win(row)):
        return row, plan
    best = None if row["reason"] else (row, plan)
    fewer = min(row["gpus"], most) // 2
    while fewer >= max(1, most // SMALLEST_SHARE):
        smaller, smaller_plan = _run_at(ask, fewer)
        if smaller_plan is None or (smaller["reason"] and best is not None):
            break
        if not smaller["reason"]:
            if best is not None and smaller["wall_days"] >= best[0]["wall_days"]:
                break
            best = smaller, smaller_plan
            if not _half_may_win(smaller):
                break
        fewer = smaller["gpus"] // 2
    if best is None or best[1] is plan:
        return row, plan
    if row["reason"]:
        cause = row["reason"].removeprefix("whole run: ").split(": ", 1)[-1].split(";")[0]
        why = f"cannot finish ({cause})"
    else:
        why = f"takes {row['wall_days']:,.1f} wall days ({row['goodput']:.0%} goodput)"
    fastest = f"the fastest whole run takes {best[0]['gpus']:,} of the fleet's GPUs"
    return {**best[0], "note": f"the {row['gpus']:,}-GPU best layout's whole run {why}; {fastest}"}, best[1]


def _half_may_win(row: Mapping[str, Any]) -> bool:
    """Whether half as many GPUs could finish sooner than this finished run: at best they train the model's FLOPs at
    the accelerator's full peak (MFU 1), which takes 2 * mfu * ideal_days; failures and recovery only add to that."""
    return 2 * row["mfu"] * row["ideal_days"] < row["wall_days"]


def _run_at(ask: _Ask, most: front.Range) -> tuple[dict[str, Any], Plan | None]:
    """The best layout on at most `most` of fleet `name`'s GPUs (or a range of counts), its whole run (or why it
    cannot finish), and its plan."""
    from twin import api

    result, _ = front.run(
        ask.source, ask.name, ask.overrides, gpus=most, batch_tokens=ask.batch_tokens, objective=ask.objective, top=1,
        fixes=ask.fixes, workers=ask.workers, progress=ask.progress, seeds=1, limits=ask.limits,
    )  # fmt: skip
    if not result.top:
        t = result.tally
        return {"reason": f"no layout fits {ask.name}: {t.shapes:,} seen, {t.over_memory:,} over memory, "
                          f"{t.invalid:,} invalid"}, None  # fmt: skip
    best = result.top[0]
    o = best.outcome
    row = {
        "gpus": best.shape.gpus, "layout": best.label, "stack": best.plan.stack.name,
        "batch_tokens": best.plan.tokens_per_step, "step_time_s": o.step_time_s, "mfu": o.mfu,
        "memory_peak_GiB": o.memory_peak_GiB, "ideal_days": o.days_to_train, "reason": "",
    }  # fmt: skip
    try:
        limits = run_limits(best.plan, loader.plan_cluster(best.plan), ask.limits)
        runs = api.simulate_runs(best.plan, ask.seeds, limits=limits)
    except PlanError as exc:  # the step stands; the run cannot finish (failures outpace recovery, say)
        return {**row, "reason": f"whole run: {exc}"}, best.plan
    return {
        **row,
        **{key: runs.stats[key]["mean"] for key in ("wall_days", "goodput", "cost_usd", "energy_mwh")},
    }, best.plan
