"""Calibration recovers known parameters from synthetic records written by the twin itself."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from plan import loader
from plan.bench import BenchResult, GemmPoint
from plan.cluster import Cluster
from plan.rank_grid import RankGrid
from plan.records import Phases, ProfiledRank, ProfileIndex, RankCoords, RunManifest, StepRecord
from plan.schema import Plan
from twin.calibrate.bench_fit import fit_bench
from twin.calibrate.fit import (
    KNOBS,
    Calibrator,
    Fit,
    calibrated_profile,
    get_field,
    predict_with_interval,
    with_fields,
)
from twin.calibrate.measured import read_measurements
from twin.step.compute import Device
from twin.step.predict import predict

TRUE = {  # the knobs twin.calibrate.fit fits, at values far from the catalogue's
    "compute.kernel_overhead_us": 40.0,
    "compute.layer_overhead_us": 300.0,
    "compute.sharded_kernel_overhead_us": 120.0,
    "node.intra.latency_us": 900.0,
    "node.wakeup_latency_us": 2000.0,
    "compute.dp_overlap_fraction": 0.2,
}
FACTS = {"stragglers.jitter_cv": 0.0}  # measured, not fitted: synthetic ranks have no spread
LAYOUTS = [
    [],  # cpu-tiny: dp2 tp2 pp2 1f1b
    ["layout.dp=4", "layout.pp=1"],
    ["layout.tp=1", "layout.pp=4"],
    ["layout.dp=8", "layout.tp=1", "layout.pp=1"],
    ["layout.dp=1", "layout.schedule=gpipe"],
    ["layout.tp=1", "layout.schedule=interleaved-1f1b", "layout.virtual_stages=2"],
    ["layout.zero=1"],  # FSDP2-style ZeRO: its reduction overlap is fitted
]
HELD_OUT = ["layout.dp=4", "layout.tp=2", "layout.pp=1", "layout.zero=0", "layout.microbatch_size=1"]


def write_synthetic_run(plan: Plan, cluster: Cluster, run_dir: Path, steps: int, noise: float, seed: int) -> None:
    """A run directory as the executor writes it, with the twin's phases and step time plus relative noise."""
    pred = predict(plan, cluster)
    rng = np.random.default_rng(seed)
    grid = RankGrid.from_layout(plan.layout)
    run_dir.mkdir(parents=True)
    manifest = RunManifest(
        run_id=run_dir.name,
        created_unix=0.0,
        plan=plan,
        plan_sha256=hashlib.sha256(plan.model_dump_json().encode()).hexdigest(),
        torch_version="synthetic",
        python_version="synthetic",
        device="cpu",
        backend="gloo",
        world_size=plan.layout.world_size,
        hosts=("synthetic",) * plan.layout.world_size,
    )
    (run_dir / "manifest.json").write_text(manifest.model_dump_json())
    lines = []
    for step in range(steps):
        warmup = 3.0 if step == 0 else 1.0  # a real run's first step pays for warm-up: calibration must drop it
        factor = warmup * (1 + noise * rng.standard_normal())
        for rank in range(plan.layout.world_size):
            c = grid.coords(rank)
            phases = {k: v * factor for k, v in pred.stage_phases_s[c.pp].items()}
            record = StepRecord(
                step=step,
                rank=rank,
                coords=RankCoords(dp=c.dp, pp=c.pp, cp=c.cp, ep=0, tp=c.tp),
                time_unix=float(step),
                step_s=pred.step_time_s * factor,
                phases=Phases(**phases),
                tokens=plan.tokens_per_step,
            )
            lines.append(record.model_dump_json())
    (run_dir / "records.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Cluster, Cluster, list[Path]]:
    base = with_fields(loader.load_cluster("localhost-cpu"), FACTS)
    truth = with_fields(base, {**TRUE, **FACTS})
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for i, overrides in enumerate(LAYOUTS):
        for repeat in range(2):
            run_dir = root / f"run{i}-{repeat}"
            write_synthetic_run(loader.load("cpu-tiny", overrides), truth, run_dir, 6, 0.01, seed=10 * i + repeat)
            dirs.append(run_dir)
    return base, truth, dirs


def test_repeats_are_pooled_and_warmup_dropped(synthetic: tuple[Cluster, Cluster, list[Path]]) -> None:
    _, truth, dirs = synthetic
    data = read_measurements(dirs)
    assert len(data) == len(LAYOUTS)
    assert all(len(m.runs) == 2 and len(m.repeat_means) == 2 for m in data)
    first = data[0]
    assert first.step_s == pytest.approx(predict(first.plan, truth).step_time_s, rel=0.02)
    assert 0 < first.step_sd < 0.05 * first.step_s  # 1% noise on 8 steps


def test_the_profiled_step_and_the_next_are_left_out(tmp_path: Path) -> None:
    # step 3 profiled and step 4 paying for its trace exports, as a real run measures them (1.2 s against 0.3 s)
    plan, truth = loader.load("cpu-tiny"), with_fields(loader.load_cluster("localhost-cpu"), FACTS)
    run_dir = tmp_path / "run"
    write_synthetic_run(plan, truth, run_dir, 8, 0.0, seed=0)
    clean = read_measurements([run_dir])[0].step_s
    records = [StepRecord.model_validate_json(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    slowed = [r.model_copy(update={"step_s": 4 * r.step_s}) if r.step in (3, 4) else r for r in records]
    (run_dir / "records.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in slowed))
    assert read_measurements([run_dir])[0].step_s > 1.5 * clean  # without the profile's index: counted
    coords = RankCoords(dp=0, pp=0, cp=0, ep=0, tp=0)
    index = ProfileIndex(step=3, device="cpu", ranks=(ProfiledRank(rank=0, coords=coords, trace="rank0.json"),))
    (run_dir / "profile").mkdir()
    (run_dir / "profile" / "ranks.json").write_text(index.model_dump_json())
    assert read_measurements([run_dir])[0].step_s == pytest.approx(clean)


ONE_WIDTH_KNOBS = [
    k for k in KNOBS if k.path not in ("compute.gemm_half_gflop", "compute.elementwise_bandwidth_fraction")
]
"""The synthetic runs are all of one model width, which cannot tell the GEMM curve's knee and the element-wise rate
from per-layer costs (that needs several widths: benchmarks/calibration_widths.py); they are left out here."""


@pytest.fixture(scope="module")
def fitted(synthetic: tuple[Cluster, Cluster, list[Path]]) -> Fit:
    return Calibrator(synthetic[0], ONE_WIDTH_KNOBS).fit(read_measurements(synthetic[2]))


def test_fit_recovers_known_parameters(fitted: Fit) -> None:
    fit = fitted
    for path, value in TRUE.items():
        assert path in fit.values, f"{path} was not fitted (fixed: {fit.fixed})"
        # within its own stated uncertainty (3 sigma), and that uncertainty is small: the data pin it down
        assert abs(fit.values[path] - value) <= max(0.03 * value, 3 * fit.std[path]), path
        assert fit.std[path] < 0.1 * value, path
    assert fit.values["compute.gemm_peak_fraction.bf16"] == pytest.approx(0.8, rel=0.05)  # untouched truth
    assert fit.step_rms < 0.02


def test_held_out_plan_predicted_within_its_interval(
    synthetic: tuple[Cluster, Cluster, list[Path]], fitted: Fit
) -> None:
    base, truth, _ = synthetic
    fit = fitted
    plan = loader.load("cpu-tiny", HELD_OUT)
    actual = predict(plan, truth).step_time_s
    before = predict(plan, base).step_time_s
    interval = predict_with_interval(plan, fit)
    assert abs(before / actual - 1) > 0.3  # the base profile is far off ...
    assert interval.step_s == pytest.approx(actual, rel=0.03)  # ... the fitted one is not
    assert interval.low_s <= actual <= interval.high_s


def test_profile_round_trips_as_a_cluster_file(synthetic: tuple[Cluster, Cluster, list[Path]]) -> None:
    base, _, dirs = synthetic
    fit = Calibrator(base).fit(read_measurements(dirs[:4]))
    profile = calibrated_profile(fit, "localhost-cpu", [str(d) for d in dirs[:4]], 0.01)
    again = Cluster.model_validate_json(profile.model_dump_json())
    assert again.calibration is not None and again.calibration.base == "localhost-cpu"
    for p in again.calibration.parameters:
        assert get_field(again, p.path) == pytest.approx(p.value)


@pytest.mark.slow  # a whole least-squares fit through the command: about 15 s on 2 cores
def test_calibrate_command_writes_a_profile_plans_can_name(
    synthetic: tuple[Cluster, Cluster, list[Path]], tmp_path: Path
) -> None:
    import json

    from typer.testing import CliRunner

    from twin.cli.app import app

    dirs = synthetic[2]
    out = tmp_path / "fitted.yaml"
    args = ["calibrate", *map(str, dirs), "--cluster", "localhost-cpu", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["fit"]["plans"] == len(LAYOUTS)
    assert report["fit"]["median_abs_error_after"] < 0.02 < report["fit"]["median_abs_error_before"]
    plan = loader.load("cpu-tiny", [f"cluster={out}"])
    fitted = loader.plan_cluster(plan)
    assert fitted.calibration is not None
    assert fitted.compute.kernel_overhead_us == pytest.approx(TRUE["compute.kernel_overhead_us"], rel=0.05)


def test_calibrate_rejects_runs_of_another_cluster(synthetic: tuple[Cluster, Cluster, list[Path]]) -> None:
    from typer.testing import CliRunner

    from twin.cli.app import app

    result = CliRunner().invoke(app, ["calibrate", str(synthetic[2][0]), "--cluster", "single-h100"])
    assert result.exit_code == 2
    assert "not 'single-h100'" in result.output


def test_a_gpu_bench_fits_the_table_model_the_step_model_prices() -> None:
    """`twin bench` on a GPU: the GEMM sweep is fitted with the model an accelerator fitted to a measured table uses
    (fraction, GEMM bandwidth, fixed cost per GEMM), not the CPU's saturating curve, and recovers known constants
    from times that model generated; the step model then prices a GEMM as the sweep measured it."""
    cluster = loader.load_cluster("dgx-h100-superpod")
    truth = {"compute.gemm_peak_fraction.bf16": 0.7, "compute.gemm_bandwidth_GBps": 3000.0, "compute.gemm_fixed_us": 9}
    true_device = Device.of(with_fields(cluster, {**truth, "compute.in_training_fraction": 1.0}), "bf16", 8)
    sizes = (256, 1024, 4096)
    points = [
        GemmPoint(m=m, n=n, k=k, dtype="bf16", seconds=true_device.gemm_s(m, n, k))
        for m in sizes
        for n in sizes
        for k in sizes
    ]
    bench = BenchResult(
        device="cuda", backend="nccl", world_size=1, host="h", torch_version="x", threads_per_rank=1, gemm=tuple(points)
    )
    fitted = fit_bench(bench, cluster)
    for path, value in truth.items():
        assert fitted.values[path] == pytest.approx(value, rel=1e-3), path
    assert "compute.gemm_half_gflop" not in fitted.values and fitted.gemm_rms["bf16"] < 1e-3
