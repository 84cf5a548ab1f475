"""The public Python API of ClusterTwin: the one door the `twin` command, the dashboard, the layout search and
users' own scripts all go through.

    from twin import api

    plan = api.load_plan("llama3-405b-16k", ["layout.pp=8", "cluster.nodes=4096"])
    step = api.predict(plan)                       # one optimizer step: time, MFU, memory, breakdown
    run = api.simulate_run(plan, seed=1)           # the whole run: failures, goodput, days, cost, energy
    many = api.simulate_runs(plan, range(20))      # the same over seeds, with mean and 5th/95th percentiles
    report = api.validate("my-plan.yaml")          # ok, or the reasons it is not, and what follows from it
    launch = api.execute("cpu-tiny", steps=5)      # run the layout for real under torchrun
    fitted = api.calibrate([launch.run_dir], "localhost-cpu")
    best = api.search("llama3-70b", cluster="dgx-h100-superpod", gpus=2048, batch_tokens=8 * 2**20)
    fleets = api.compare_fleets("dense-1t", ["xai-colossus", "tpu-v7-ironwood"])  # each at its best layout

A plan argument is anything `load_plan` takes: a Plan, a preset name, a YAML path or a mapping. Bad input raises
`plan.PlanError` with one line naming the field and the fix; nothing here prints.

Every call ends in bounded time (`limits`, plan/limits.py, caps what it reads and simulates; PlanError names a cap
it passes). Over memory: `validate` and whole-run calls refuse a plan unless `allow_oom`; `predict` reports it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from plan import loader
from plan.cluster import Cluster
from plan.clusters import WhatIf
from plan.clusters import load_cluster_what_if as _cluster_what_if
from plan.limits import DEFAULT_LIMITS, Limits
from plan.loader import PlanError
from plan.model_math import model_flops_per_token, param_count
from plan.records import profile_step_refusal
from plan.schema import Plan
from twin import fit
from twin.budget import check_step, run_step_actions
from twin.cli.launch import DEFAULT_TIMEOUT_S, Launch, launch, parse_nnodes
from twin.fidelity import Record
from twin.fidelity import record as _record
from twin.outputs import output_dir
from twin.run import summary as run_summary
from twin.run.budget import check_runs, seed_list_of
from twin.run.reliability import daly_interval_s
from twin.run.summary import RunPrediction, Sweep
from twin.run.summary import check_seed as check_seed
from twin.step.fabric import Fabric
from twin.step.memory import MemoryBreakdown
from twin.step.predict import PredictOptions, StepPrediction, rank_memories
from twin.step.predict import predict as _predict

if TYPE_CHECKING:
    import pandas as pd

    from twin.calibrate.loop import Calibrated
    from twin.calibrate.measured import Measurement
    from twin.search.engine import SearchResult, Tally

PlanLike = Plan | str | Path | Mapping[str, Any]
"""A validated Plan, a preset name, a path to a plan YAML, or a plan as a mapping (the YAML's contents)."""

DEFAULT_EXECUTE_TIMEOUT_S = DEFAULT_TIMEOUT_S


def load_plan(source: PlanLike, overrides: Iterable[str] = (), limits: Limits = DEFAULT_LIMITS) -> Plan:
    """A validated plan from a preset name, YAML path, mapping or Plan, with `section.field=value` overrides."""
    overrides = list(overrides)
    if isinstance(source, Plan):
        if not overrides:
            return source
        source = source.model_dump(mode="json")
    if isinstance(source, Mapping):
        data = loader.apply_overrides(loader.expand_model(dict(source), "plan"), overrides, limits)
        return loader.validate_plan(data, "plan")
    if not isinstance(source, str | Path):
        raise PlanError(f"plan: expected a Plan, a preset name, a path or a mapping, got {type(source).__name__}")
    return loader.load(source, overrides, limits)


def cluster_of(plan: PlanLike) -> Cluster:
    """The cluster a plan runs on, its what-if overrides applied."""
    return loader.plan_cluster(load_plan(plan))


def published_fidelity(plan: PlanLike) -> Record:
    """The twin's record on published runs of the plan's kind (accelerator, precision, MoE; twin/fidelity.py):
    `found`, the group, or None; `line`, what to show either way."""
    p = load_plan(plan)
    return _record(p, loader.plan_cluster(p))


def cluster_what_if(plan: PlanLike) -> tuple[Cluster, WhatIf]:
    """The cluster a plan runs on and what its what-if overrides changed (the fields they set, and those that
    followed, such as the outermost tier grown with `nodes`)."""
    ref = load_plan(plan).cluster
    return _cluster_what_if(ref.name, ref.overrides)


def load_cluster(name: str, overrides: Mapping[str, Any] | Iterable[str] = ()) -> Cluster:
    """A catalogue cluster (or cluster file) with what-if overrides: a mapping of dotted paths to values, or
    `path=value` strings as `--set cluster.PATH=value` takes them (e.g. "nodes=560")."""
    return load_cluster_what_if(name, overrides)[0]


def load_cluster_what_if(
    name: str, overrides: Mapping[str, Any] | Iterable[str] = (), limits: Limits = DEFAULT_LIMITS
) -> tuple[Cluster, WhatIf]:
    """`load_cluster`, and what its what-ifs changed (the fields they set, and those that followed)."""
    if not isinstance(overrides, Mapping):
        pairs = [loader.parse_override(item, limits) for item in overrides]
        overrides = {".".join(path): value for path, value in pairs}
    return _cluster_what_if(name, overrides)


def facts(plan: PlanLike, fabric: bool = False, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """What follows from a plan and its cluster: sizes a user checks before running it. With `fabric`, also the
    cluster's bisection bandwidth (a max-flow over its switch tiers, about 4 µs per node: None for a cluster past
    `limits.bisection_nodes`)."""
    p = load_plan(plan, limits=limits)
    cluster = loader.plan_cluster(p)
    params = param_count(p.model)
    world = p.layout.world_size
    extra: dict[str, Any] = {}
    if fabric:
        small = cluster.nodes <= limits.bisection_nodes
        extra["bisection_TBps"] = Fabric(cluster).bisection_Bps() / 1e12 if small else None
    return {
        **extra,
        "world_size": world,
        "nodes": -(-world // cluster.node.gpus),
        "cluster_gpus": cluster.gpus,
        "accelerator": cluster.accelerator.name,
        "params_total": params.total,
        "params_active": params.active,
        "model_flops_per_token": model_flops_per_token(p.model),
        "microbatches_per_replica": p.num_microbatches,
        "tokens_per_step": p.tokens_per_step,
        "total_steps": p.total_steps,
        "stage_layers": list(p.stage_layer_counts),
    }


def memory(plan: PlanLike, limits: Limits = DEFAULT_LIMITS) -> MemoryBreakdown:
    """Memory of the plan's fullest pipeline rank (what `predict` reports), without simulating the step."""
    p = load_plan(plan, limits=limits)
    check_step(p, limits)
    return fit.memory(p)


def memory_by_rank(plan: PlanLike, limits: Limits = DEFAULT_LIMITS) -> list[MemoryBreakdown]:
    """Memory of every pipeline rank (params, grads, optimizer, activations, transient, reserved), as `memory`."""
    p = load_plan(plan, limits=limits)
    check_step(p, limits)
    return rank_memories(p, loader.plan_cluster(p), loader.plan_stack(p))


def check_fit(plan: PlanLike, limits: Limits = DEFAULT_LIMITS) -> MemoryBreakdown:
    """The plan's memory if it fits; PlanError otherwise, saying by how much it is over and what would fix it."""
    p = load_plan(plan, limits=limits)
    check_step(p, limits)
    return fit.check_fit(p)


@dataclass(frozen=True)
class Validation:
    """Whether a plan can be used, and if not why."""

    ok: bool
    plan: Plan | None
    reasons: tuple[str, ...]
    """Why it cannot be used: each one line naming the field and the fix (empty when ok)."""
    facts: dict[str, Any]
    """What follows from the plan (see `facts`); empty when it does not load."""


def validate(
    source: PlanLike, overrides: Iterable[str] = (), limits: Limits = DEFAULT_LIMITS, allow_oom: bool = False
) -> Validation:
    """Check a plan without raising: schema, layout against model, size on its cluster, that the twin can simulate
    it within `limits`, and that it fits in memory (unless `allow_oom`; facts then hold the memory either way)."""
    try:
        plan = load_plan(source, overrides, limits)
        check_step(plan, limits)
        mem = fit.memory(plan)
    except PlanError as exc:
        return Validation(False, None, (str(exc),), {})
    memory_facts = {"memory_peak_GiB": mem.peak, "memory_capacity_GiB": mem.capacity, "fits": mem.fits}
    found = {**facts(plan, limits=limits), **memory_facts}
    if not mem.fits and not allow_oom:
        return Validation(False, plan, (fit.oom_message(plan, loader.plan_cluster(plan), mem),), found)
    return Validation(True, plan, (), found)


def predict(
    plan: PlanLike,
    options: PredictOptions | None = None,
    cluster: Cluster | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> StepPrediction:
    """One optimizer step of `plan`, simulated: time, breakdown, memory (and whether it `fits`), MFU, days to train.

    `cluster` replaces the plan's own (a calibrated profile, a what-if built in code)."""
    p = load_plan(plan, limits=limits)
    check_step(p, limits)
    return _predict(p, cluster, options or PredictOptions())


def _run_setup(plan: PlanLike, limits: Limits, allow_oom: bool, runs: int) -> run_summary.RunSetup:
    """A whole run's setup, once the plan is known to fit (unless `allow_oom`) and `runs` runs of it, and its step
    predictions, are within `limits`."""
    p = load_plan(plan, limits=limits)
    cluster = loader.plan_cluster(p)
    check_step(p, limits, run_step_actions(p, cluster))
    check_runs(runs, limits)
    if not allow_oom:
        fit.check_fit(p, cluster)
    return run_summary.setup(p, cluster)


def simulate_run(
    plan: PlanLike, seed: int = 0, limits: Limits = DEFAULT_LIMITS, allow_oom: bool = False
) -> RunPrediction:
    """The whole training run of `plan`, simulated once with `seed`. A plan that does not fit in memory raises
    PlanError unless `allow_oom`."""
    run_summary.check_seed(seed)
    return run_summary.simulate_run(_run_setup(plan, limits, allow_oom, 1), seed, limits)


@dataclass(frozen=True)
class RunSummary:
    """The same run simulated over several seeds."""

    runs: list[RunPrediction]
    stats: dict[str, dict[str, float]]
    """Per figure: mean, p5 and p95 over the seeds; `interruptions`: mean count per cause."""


def simulate_runs(
    plan: PlanLike,
    seeds: int | Iterable[int],
    progress: Callable[[], None] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    allow_oom: bool = False,
) -> RunSummary:
    """The whole run once per seed (`seeds` a count from 0, or the seeds themselves); the step model runs once.
    `progress` is called after each run. More seeds than `limits.runs` raise PlanError before any is simulated."""
    seed_list = seed_list_of(seeds, limits)
    setup = _run_setup(plan, limits, allow_oom, len(seed_list))
    runs = run_summary.run_seeds(setup, seed_list, progress, limits)
    return RunSummary(runs, run_summary.summarise(runs))


def sweep_checkpoint(
    plan: PlanLike,
    seeds: int | Iterable[int] = 3,
    intervals_min: Sequence[float] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    allow_oom: bool = False,
    progress: Callable[[], None] | None = None,
) -> Sweep:
    """Goodput against checkpoint interval (default: 13 intervals from a quarter to four times Daly's), over the
    same seeds at every interval, with the simulated optimum beside Young's and Daly's. `progress` is called after
    each run."""
    seed_list = seed_list_of(seeds, limits)
    intervals = len(intervals_min) if intervals_min is not None else 13
    setup = _run_setup(plan, limits, allow_oom, len(seed_list) * intervals)
    if not setup.rates:
        raise PlanError(
            f"{setup.plan.name}: no failure rate is above zero, so goodput does not depend on the checkpoint interval "
            "and there is nothing to sweep; give the cluster or reliability.failure_rates a failure rate"
        )
    if intervals_min is None:
        daly = daly_interval_s(setup.ckpt.stall_s, 1 / sum(setup.rates.values()))
        intervals_s = [daly * f for f in np.geomspace(0.25, 4.0, 13)]
    else:
        intervals_s = [m * 60 for m in intervals_min]
    return run_summary.sweep_checkpoint(setup, intervals_s, seed_list, limits, progress)


def execute(
    plan: PlanLike,
    overrides: Sequence[str] = (),
    *,
    steps: int = 10,
    device: str = "cpu",
    out: Path | None = None,
    nnodes: str = "1",
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    inject: Sequence[str] = (),
    max_restarts: int | None = None,
    rdzv_conf: str | None = None,
    capture: bool = True,
    timeout_s: float = DEFAULT_EXECUTE_TIMEOUT_S,
    stats_every: int = 10,
    profile_step: int | None = None,
) -> Launch:
    """Run `plan`'s layout for real under torchrun (gloo on CPU, NCCL on GPUs) and wait for it; the records and
    manifest land in `out` (default runs/<plan>-<time>). A plan given as a Plan or mapping is written to
    `out/plan.yaml` first, since the ranks load it themselves. With `capture` the gang's output is collected; every
    `stats_every` steps the ranks also record per-layer norms and MoE expert loads (0: never); step `profile_step`
    (from 0) is traced on every rank into `out/profile/` (see `twin trace`)."""
    loaded = load_plan(plan, overrides)
    parse_nnodes(nnodes)  # a malformed --nnodes is refused before --out is created
    if refusal := profile_step_refusal(profile_step, steps):
        raise PlanError(refusal)
    run_dir = output_dir(out or Path("runs") / f"{loaded.name}-{time.strftime('%Y%m%d-%H%M%S')}", "--out")
    if isinstance(plan, str | Path):
        source, passed = str(plan), list(overrides)
    else:
        source, passed = str(run_dir / "plan.yaml"), []
        Path(source).write_text(yaml.safe_dump(json.loads(loaded.model_dump_json()), sort_keys=False))
    return launch(
        source, loaded, overrides=passed, steps=steps, device=device, out=run_dir, nnodes=nnodes,
        node_rank=node_rank, master_addr=master_addr, master_port=master_port, inject=list(inject),
        max_restarts=max_restarts, rdzv_conf=rdzv_conf, capture=capture, timeout_s=timeout_s, stats_every=stats_every,
        profile_step=profile_step,
    )  # fmt: skip


def measure(run_dirs: Path | Sequence[Path]) -> Measurement:
    """The steady-state step of executor runs of one plan (repeats pooled; warm-up steps and replays left out),
    with its plan as it ran (the manifest's `ran` applied) — what to predict and compare it with."""
    from twin.calibrate.measured import read_measurements

    dirs = [run_dirs] if isinstance(run_dirs, Path) else list(run_dirs)
    found = read_measurements(dirs)
    if len(found) != 1:
        raise PlanError(f"measure: the runs hold {len(found)} different plans; give runs of one plan")
    return found[0]


def calibrate(
    runs: Sequence[Path],
    cluster: str | Cluster,
    *,
    held_out: Sequence[Path] = (),
    bench: Path | None = None,
    name: str | None = None,
) -> Calibrated:
    """Fit `cluster`'s calibratable fields to executor runs (`runs`), and predict every run — fitted and held out —
    before and after: the rows of `twin calibrate`'s table, the fitted profile and notes."""
    from twin.calibrate.loop import calibrate as fit_runs
    from twin.calibrate.measured import read_measurements

    base = cluster if isinstance(cluster, Cluster) else loader.load_cluster(cluster)
    fit_data = read_measurements(list(runs))
    held = read_measurements(list(held_out)) if held_out else []
    return fit_runs(fit_data, base, held, bench, name=name or base.name)


def search(
    model_or_plan: str | Mapping[str, Any],
    cluster: str | None = None,
    overrides: Iterable[str] = (),
    *,
    gpus: int | tuple[int, int] | None = None,
    batch_tokens: float | tuple[float, float] | None = None,
    objective: str = "time",
    top: int = 5,
    fix: Iterable[str] = (),
    workers: int | None = None,
    progress: Callable[[Tally], None] | None = None,
    seeds: int = 3,
    limits: Limits = DEFAULT_LIMITS,
    ray: str | None = None,
) -> SearchResult:
    """The `top` layouts of a model preset on `cluster` (or a plan's model on its cluster) by `objective` (time,
    cost, mfu, goodput-time), the Pareto front, and the plan as given. `gpus`: at most N or a (fewest, most)
    range; `batch_tokens`: a batch or a range; `fix`: pins; `ray`: an address or "local" (see twin/search/)."""
    from twin.search import front

    options = (gpus, batch_tokens, objective, top, fix, workers, progress, seeds, limits, ray)
    return front.run(model_or_plan, cluster, overrides, *options)[0]


def sweep(plan: str, fields: Sequence[str], overrides: Iterable[str] = ()) -> pd.DataFrame:
    """Every combination of `fields` (each `section.field=a,b,c`) predicted, a row each (or why it cannot run)."""
    from twin.search import front

    return front.sweep(plan, fields, overrides)


def compare_fleets(source: str | Mapping[str, Any], clusters: Sequence[str], overrides: Iterable[str] = (),
                   **options: Any) -> pd.DataFrame:  # fmt: skip
    """A model preset or plan on each fleet in `clusters` at its best layout, with its whole run: a row per fleet
    (time, MFU, days, goodput, cost, energy; options and defaults as twin/search/fleet.py `compare`)."""
    from twin.search import fleet

    return fleet.compare(source, clusters, overrides, **options)
