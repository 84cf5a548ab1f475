"""Simulate → execute → calibrate → re-predict: the loop behind `twin calibrate` and `twin loop`.

Plans run through the API's `execute` (torchrun in a subprocess: the twin never imports the executor), one at a
time so that runs do not share the host, each `repeats` times. The first plans are calibrated on; the last
`holdout` are predicted by the calibrated profile without having been seen by the fit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from plan.bench import read_bench
from plan.cluster import Cluster
from plan.loader import PlanError
from twin.calibrate.bench_fit import fit_bench
from twin.calibrate.fit import KNOBS, Calibrator, Fit, calibrated_profile, predict_with_interval, with_fields
from twin.calibrate.measured import Measurement, read_measurements
from twin.calibrate.report import Row, phase_groups
from twin.step.predict import predict

RUN_TIMEOUT_S = 3600.0
"""Wall limit of one calibration run: an 8-step run of a calibration plan takes well under a minute here."""


@dataclass(frozen=True)
class Calibrated:
    fit: Fit
    profile: Cluster
    rows: list[Row]
    notes: list[str]


def base_profile(cluster: Cluster, bench: Path | None, data: Sequence[Measurement]) -> tuple[Cluster, list[str]]:
    """The profile the fit starts from: the catalogue's, with microbenchmark fields and the measured jitter."""
    values: dict[str, float] = {}
    notes = []
    if bench is not None:
        fitted = fit_bench(read_bench(bench), cluster)
        values.update(fitted.values)
        notes.append(
            f"Microbenchmark start ({bench}): "
            + ", ".join(f"{k} {v:.4g}" for k, v in fitted.values.items())
            + f"; GEMM curve RMS error {', '.join(f'{d} {e:.1%}' for d, e in fitted.gemm_rms.items())}"
            + f"; collective sweep RMS error {fitted.link_rms:.1%}."
        )
    if data:
        jitter = statistics.median_high(m.busy_cv for m in data)
        values["stragglers.jitter_cv"] = jitter
        notes.append(f"stragglers.jitter_cv set to the measured median busy-time spread {jitter:.3f}.")
    return (with_fields(cluster, values) if values else cluster), notes


def calibrate(
    data: Sequence[Measurement], cluster: Cluster, held_out: Sequence[Measurement] = (), bench: Path | None = None,
    name: str | None = None,
) -> Calibrated:  # fmt: skip
    """Fit `cluster` to `data` and predict every plan (fitted and held out) before and after."""
    if not data:
        raise PlanError("calibrate: no runs to fit; give at least one run directory")
    for m in (*data, *held_out):
        if m.plan.cluster.name != cluster.name:
            raise PlanError(
                f"{m.runs[0]}: ran on cluster {m.plan.cluster.name!r}, not {cluster.name!r}; calibrate runs of one "
                "cluster"
            )
    start, notes = base_profile(cluster, bench, data)
    # a microbenchmark measured the GEMM curve: the fit takes it as given rather than trading it against overheads
    knobs = [k for k in KNOBS if not (bench is not None and k.path.startswith("compute.gemm_"))]
    fit = Calibrator(start, knobs).fit(data)
    rows = []
    for role, group in (("fit", data), ("held out", held_out)):
        for m in group:
            interval = predict_with_interval(m.plan, fit)
            after = predict(m.plan, fit.cluster)
            rows.append(
                Row(
                    label=m.label, role=role, measured_s=m.step_s, measured_sd_s=m.step_sd, repeats=len(m.runs),
                    before_s=predict(m.plan, cluster).step_time_s, after_s=interval.step_s, low_s=interval.low_s,
                    high_s=interval.high_s, measured_phases=phase_groups(m.stage_phases),
                    predicted_phases=phase_groups(after.stage_phases_s, after.breakdown_s["straggler"]),
                )
            )  # fmt: skip
    for path, value in fit.values.items():
        notes.append(f"fitted {path} = {value:.4g} ± {fit.std[path]:.2g}")
    notes += [f"not identifiable from these runs, left as is: {path}" for path in fit.fixed]
    cv = statistics.median_high(m.step_sd / m.step_s if m.step_s > 0 else 0.0 for m in data)  # data is not empty
    sources = [r for m in data for r in m.runs] + ([str(bench)] if bench else [])
    profile = calibrated_profile(fit, name or cluster.name, sources, cv)
    return Calibrated(fit, profile, rows, notes)


def execute(plan: str, overrides: Sequence[str], steps: int, run_dir: Path, device: str) -> None:
    """One run of `plan` through the API (`twin.api.execute`); a failed run raises PlanError with its last line."""
    from twin import api  # the API imports this module's caller; import at use

    run = api.execute(plan, overrides, steps=steps, out=run_dir, device=device, timeout_s=RUN_TIMEOUT_S)
    if not run.ok:
        raise PlanError(f"{plan}: the executor failed (exit {run.returncode}): {(run.error or 'no output')[:300]}")
    if not run.summary.get("steps"):
        raise PlanError(f"{plan}: the executor ended without a step record in {run_dir}")


def run_all(
    plans: Sequence[str],
    overrides: Sequence[str],
    repeats: int,
    steps: int,
    out: Path,
    device: str,
    progress: Callable[[str], None] | None = None,
) -> list[list[Path]]:
    """Execute every plan `repeats` times, interleaving repeats (so slow drift on the host spreads over all plans);
    the run directories of each plan, in the order given. `progress` is told each run as it starts (or is found
    finished: a rerun of the loop keeps finished runs)."""
    dirs: list[list[Path]] = [[] for _ in plans]
    for r in range(repeats):
        for i, plan in enumerate(plans):
            run_dir = out / "runs" / f"{i:02d}-{Path(plan).stem}-r{r}"
            if progress:
                progress(f"{Path(plan).stem} (repeat {r + 1}/{repeats})")
            if not (run_dir / "records.jsonl").exists():
                execute(plan, overrides, steps, run_dir, device)
            dirs[i].append(run_dir)
    return dirs


def split(dirs: Sequence[Sequence[Path]], holdout: int) -> tuple[list[Measurement], list[Measurement]]:
    """One measurement per plan (its repeats pooled): the first len − holdout to fit, the last `holdout` held out."""
    if not 0 <= holdout < len(dirs):
        raise PlanError(f"--holdout {holdout}: must leave at least one of the {len(dirs)} plans to fit")
    data = [m for runs in dirs for m in read_measurements(list(runs))]
    cut = len(data) - holdout
    return data[:cut], data[cut:]


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
