"""What executor runs measured, reduced to what calibration compares: one steady-state step per plan.

Runs of the same resolved plan (same `plan_sha256`) are repeats and are pooled. Each is priced as it ran: the plan
with the manifest's `ran` section applied (fp32 matmuls on CPU, separate projections, fp32 reduction, ...). The
first steps of a run pay for allocator warm-up, lazy initialisation and the first collectives' connection set-up
(step 0 of a cpu-tiny run takes 3x a later one), so each run's first `WARMUP_STEPS` steps are left out, as are steps
replayed after a restart. Phases are averaged over the ranks of each pipeline coordinate: those ranks do the same
work, and the twin simulates one of them. An MoE run is priced with the expert imbalance its records show.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from plan.records import (
    PHASES,
    ProfileIndex,
    RecordError,
    expert_imbalance,
    plan_as_ran,
    read_json_file,
    read_manifest,
    steps_frame,
)
from plan.schema import Plan

WARMUP_STEPS = 2


@dataclass(frozen=True)
class Measurement:
    """One plan's measured steady-state step, pooled over its repeat runs."""

    plan: Plan
    runs: tuple[str, ...]
    step_s: float
    """Mean step time over the steady steps of every repeat (seconds)."""
    step_sd: float
    """Standard deviation of the steady steps' times, within and between repeats (seconds)."""
    repeat_means: tuple[float, ...]
    """Mean step time of each repeat run (seconds)."""
    stage_phases: tuple[dict[str, float], ...]
    """Per pipeline rank, mean seconds per phase (plan.records.PHASES)."""
    busy_cv: float
    """Relative spread of per-rank compute time among ranks doing the same work (the host's jitter)."""

    @property
    def label(self) -> str:
        return layout_label(self.plan)


def layout_label(plan: Plan) -> str:
    """A short name of a plan's layout, e.g. 'dp2 tp2 pp2 1f1b m4'."""
    lay = plan.layout
    parts = [f"dp{lay.dp}", f"tp{lay.tp}", f"pp{lay.pp}"]
    parts += [f"cp{lay.cp}"] if lay.cp > 1 else []
    parts += [f"ep{lay.ep}"] if lay.ep > 1 else []
    parts += [f"v{lay.virtual_stages}"] if lay.virtual_stages > 1 else []
    parts += [lay.schedule] if lay.pp > 1 else []
    parts += [f"m{plan.num_microbatches}"]
    parts += [f"z{lay.zero}"] if lay.zero else []
    return " ".join(parts)


def read_measurements(run_dirs: list[Path], warmup: int = WARMUP_STEPS) -> list[Measurement]:
    """Read run directories and pool repeats of the same plan; a run without steady steps raises RecordError."""
    groups: dict[str, list[tuple[Path, Plan]]] = {}
    for run_dir in run_dirs:
        manifest = read_manifest(run_dir)
        plan = plan_as_ran(manifest)
        imbalance = expert_imbalance(run_dir / "records.jsonl", plan)
        if imbalance is not None:  # priced with the routing it had
            plan = plan.model_copy(update={"model": plan.model.model_copy(update={"expert_imbalance": imbalance})})
        groups.setdefault(manifest.plan_sha256, []).append((run_dir, plan))
    return [_pool(runs, warmup) for runs in groups.values()]


def _pool(runs: list[tuple[Path, Plan]], warmup: int) -> Measurement:
    import pandas as pd  # kept off `twin predict`'s import path

    frames = []
    for i, (run_dir, _) in enumerate(runs):
        df = steps_frame(run_dir / "records.jsonl")
        df = df.drop_duplicates(["step", "rank"], keep="last")  # a step replayed after a restart counts once
        # the profiler slows its step, and the ranks' trace exports the next one (cpu-tiny-moe: 1.2 s against 0.3 s)
        df = df[(df.step >= warmup) & ~df.step.isin(_profiled_steps(run_dir))]
        if df.empty:
            raise RecordError(
                f"{run_dir}: no steps after the first {warmup} warm-up steps; run at least {warmup + 3} steps"
            )
        frames.append(df.assign(repeat=i))
    steps = pd.concat(frames)
    per_step = steps.groupby(["repeat", "step"]).step_s.max()  # the job's step: its slowest rank's
    busy = steps.forward + steps.backward
    cohort = steps.assign(busy=busy).groupby(["repeat", "step", "coord_pp"]).busy
    cv = (cohort.std(ddof=0) / cohort.mean()).dropna()
    stage = steps.groupby("coord_pp")[list(PHASES)].mean()
    return Measurement(
        plan=runs[0][1],
        runs=tuple(str(p) for p, _ in runs),
        step_s=float(per_step.mean()),
        step_sd=float(per_step.std(ddof=1)) if len(per_step) > 1 else 0.0,
        repeat_means=tuple(float(v) for v in per_step.groupby(level="repeat").mean()),
        stage_phases=tuple({p: float(stage.loc[r, p]) for p in PHASES} for r in sorted(stage.index)),
        busy_cv=float(statistics.median(cv)) if len(cv) else 0.0,
    )


def _profiled_steps(run_dir: Path) -> tuple[int, ...]:
    """The step `--profile-step` recorded in this run and the one after it; none without a profile."""
    index = run_dir / "profile" / "ranks.json"
    if not index.exists():
        return ()
    step = read_json_file(index, ProfileIndex, "rerun without --profile-step").step
    return (step, step + 1)
