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

A plan argument is anything `load_plan` takes: a Plan, a preset name, a YAML path or a mapping. Bad input raises
`plan.PlanError` with one line naming the field and the fix; nothing here prints.
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
from plan.clusters import WhatIf, load_cluster_what_if
from plan.loader import PlanError
from plan.model_math import model_flops_per_token, param_count
from plan.schema import Plan
from twin.cli.launch import DEFAULT_TIMEOUT_S, Launch, launch
from twin.run import summary as run_summary
from twin.run.reliability import daly_interval_s
from twin.run.summary import RunPrediction, Sweep
from twin.step.fabric import Fabric
from twin.step.predict import PredictOptions, StepPrediction
from twin.step.predict import predict as _predict

if TYPE_CHECKING:
    from twin.calibrate.loop import Calibrated
    from twin.calibrate.measured import Measurement

PlanLike = Plan | str | Path | Mapping[str, Any]
"""A validated Plan, a preset name, a path to a plan YAML, or a plan as a mapping (the YAML's contents)."""

DEFAULT_EXECUTE_TIMEOUT_S = DEFAULT_TIMEOUT_S


def load_plan(source: PlanLike, overrides: Iterable[str] = ()) -> Plan:
    """A validated plan from a preset name, YAML path, mapping or Plan, with `section.field=value` overrides."""
    overrides = list(overrides)
    if isinstance(source, Plan):
        if not overrides:
            return source
        source = source.model_dump(mode="json")
    if isinstance(source, Mapping):
        data = loader.apply_overrides(loader.expand_model(dict(source), "plan"), overrides)
        return loader.validate_plan(data, "plan")
    return loader.load(source, overrides)


def cluster_of(plan: PlanLike) -> Cluster:
    """The cluster a plan runs on, its what-if overrides applied."""
    return loader.plan_cluster(load_plan(plan))


def cluster_what_if(plan: PlanLike) -> tuple[Cluster, WhatIf]:
    """The cluster a plan runs on and what its what-if overrides changed (the fields they set, and those that
    followed, such as the outermost tier grown with `nodes`)."""
    ref = load_plan(plan).cluster
    return load_cluster_what_if(ref.name, ref.overrides)


def load_cluster(name: str, overrides: Mapping[str, Any] | Iterable[str] = ()) -> Cluster:
    """A catalogue cluster (or cluster file) with what-if overrides: a mapping of dotted paths to values, or
    `path=value` strings as `--set cluster.PATH=value` takes them (e.g. "nodes=560")."""
    if not isinstance(overrides, Mapping):
        pairs = [loader.parse_override(item) for item in overrides]
        overrides = {".".join(path): value for path, value in pairs}
    return load_cluster_what_if(name, overrides)[0]


def facts(plan: PlanLike, fabric: bool = False) -> dict[str, Any]:
    """What follows from a plan and its cluster: sizes a user checks before running it. With `fabric`, also the
    cluster's bisection bandwidth (a max-flow over its switch tiers; up to a few hundred ms on large fabrics)."""
    p = load_plan(plan)
    cluster = loader.plan_cluster(p)
    params = param_count(p.model)
    world = p.layout.world_size
    extra = {"bisection_TBps": Fabric(cluster).bisection_Bps() / 1e12} if fabric else {}
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


@dataclass(frozen=True)
class Validation:
    """Whether a plan can be used, and if not why."""

    ok: bool
    plan: Plan | None
    reasons: tuple[str, ...]
    """Why it cannot be used: each one line naming the field and the fix (empty when ok)."""
    facts: dict[str, Any]
    """What follows from the plan (see `facts`); empty when it does not load."""


def validate(source: PlanLike, overrides: Iterable[str] = ()) -> Validation:
    """Check a plan (schema, layout against model, fit on its cluster) without raising."""
    try:
        plan = load_plan(source, overrides)
    except PlanError as exc:
        return Validation(False, None, (str(exc),), {})
    return Validation(True, plan, (), facts(plan))


def predict(plan: PlanLike, options: PredictOptions | None = None, cluster: Cluster | None = None) -> StepPrediction:
    """One optimizer step of `plan`, simulated: time, breakdown, memory, MFU, days to train.

    `cluster` replaces the plan's own (a calibrated profile, a what-if built in code)."""
    return _predict(load_plan(plan), cluster, options or PredictOptions())


def simulate_run(plan: PlanLike, seed: int = 0) -> RunPrediction:
    """The whole training run of `plan`, simulated once with `seed`."""
    return run_summary.simulate_run(run_summary.setup(load_plan(plan)), seed)


@dataclass(frozen=True)
class RunSummary:
    """The same run simulated over several seeds."""

    runs: list[RunPrediction]
    stats: dict[str, dict[str, float]]
    """Per figure: mean, p5 and p95 over the seeds; `interruptions`: mean count per cause."""


def simulate_runs(plan: PlanLike, seeds: int | Iterable[int], progress: Callable[[], None] | None = None) -> RunSummary:
    """The whole run once per seed (`seeds` a count from 0, or the seeds themselves); the step model runs once.
    `progress` is called after each run."""
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list:
        raise PlanError("seeds: give at least one seed")
    setup = run_summary.setup(load_plan(plan))
    runs = run_summary.run_seeds(setup, seed_list, progress)
    return RunSummary(runs, run_summary.summarise(runs))


def sweep_checkpoint(
    plan: PlanLike, seeds: int | Iterable[int] = 3, intervals_min: Sequence[float] | None = None
) -> Sweep:
    """Goodput against checkpoint interval (default: 13 intervals from a quarter to four times Daly's), over the
    same seeds at every interval, with the simulated optimum beside Young's and Daly's."""
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    setup = run_summary.setup(load_plan(plan))
    if intervals_min is None:
        daly = daly_interval_s(setup.ckpt.stall_s, 1 / sum(setup.rates.values()))
        intervals_s = [daly * f for f in np.geomspace(0.25, 4.0, 13)]
    else:
        intervals_s = [m * 60 for m in intervals_min]
    return run_summary.sweep_checkpoint(setup, intervals_s, seed_list)


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
) -> Launch:
    """Run `plan`'s layout for real under torchrun (gloo on CPU, NCCL on GPUs) and wait for it; the records and
    manifest land in `out` (default runs/<plan>-<time>). A plan given as a Plan or mapping is written to
    `out/plan.yaml` first, since the ranks load it themselves. With `capture` the gang's output is collected."""
    loaded = load_plan(plan, overrides)
    run_dir = out or Path("runs") / f"{loaded.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if isinstance(plan, str | Path):
        source, passed = str(plan), list(overrides)
    else:
        source, passed = str(_write_plan(loaded, run_dir)), []
    return launch(
        source, loaded, overrides=passed, steps=steps, device=device, out=run_dir, nnodes=nnodes,
        node_rank=node_rank, master_addr=master_addr, master_port=master_port, inject=list(inject),
        max_restarts=max_restarts, rdzv_conf=rdzv_conf, capture=capture, timeout_s=timeout_s,
    )  # fmt: skip


def _write_plan(plan: Plan, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "plan.yaml"
    path.write_text(yaml.safe_dump(json.loads(plan.model_dump_json()), sort_keys=False))
    return path


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
