"""`twin bench`, `twin calibrate` and `twin loop`: measure the host, fit a profile, and close the loop.

Registered by twin.cli.app (which wraps each in its `user_errors`). The bench's torchrun is started here, in the
CLI package, like every launch of the executor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml
from rich.progress import Progress
from rich.table import Table

from plan import loader
from plan.loader import PlanError
from twin import api
from twin.cli.launch import REPO_ROOT, child_env, free_port
from twin.cli.options import BenchOpt, JsonOpt, console, err_console
from twin.outputs import output_dir, output_file

if TYPE_CHECKING:
    from plan.cluster import Cluster
    from twin.calibrate.loop import Calibrated

# scipy, pandas and plotly load inside the commands: `twin predict` starts in under a second without them.

SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a field of every plan: section.field=value (repeatable)."),
]
BENCH_TIMEOUT_S = 1800.0
"""Wall limit of `twin bench`: the full CPU sweep takes a few minutes on 8 ranks of a 2-core host."""


def bench(
    device: Annotated[str, typer.Option(help="cpu (gloo) or cuda (NCCL).")] = "cpu",
    ranks: Annotated[int, typer.Option(min=1, help="Ranks to start (collectives need 2 or more).")] = 8,
    out: Annotated[Path | None, typer.Option(help="Directory for bench.json (default runs/bench-<time>).")] = None,
    cluster: Annotated[str, typer.Option(help="Cluster whose peaks and fabric the sweep is fitted against.")] = (
        "localhost-cpu"
    ),
    quick: Annotated[bool, typer.Option(help="A few sizes only.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Microbenchmarks: a GEMM sweep, per-op costs and a collective sweep (nccl-tests algbw/busbw), fitted."""
    from plan.bench import read_bench
    from twin.calibrate.bench_fit import fit_bench
    from twin.calibrate.fit import get_field
    from twin.calibrate.loop import stamp

    if device not in ("cpu", "cuda"):
        raise PlanError(f"--device {device!r}: use cpu or cuda")
    base = loader.load_cluster(cluster)
    out = output_dir(out or Path("runs") / f"bench-{stamp()}", "--out")  # absolute: the bench runs in the repo
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "executor.bench"]
    cmd += ["--out", str(out), "--device", device] + (["--quick"] if quick else [])
    try:
        result = subprocess.run(
            cmd, env=child_env(1), capture_output=True, text=True, check=False, cwd=REPO_ROOT, timeout=BENCH_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise PlanError(f"twin bench: the benchmark ran past {BENCH_TIMEOUT_S:.0f} s and was stopped") from None
    if result.returncode:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise PlanError(f"twin bench: the benchmark failed (exit {result.returncode}): {tail[:300]}")
    if not (out / "bench.json").is_file():
        raise PlanError(f"twin bench: the benchmark ended but wrote no {out / 'bench.json'}; run it again")
    res = read_bench(out / "bench.json")
    fitted = fit_bench(res, base)
    if as_json:
        print(json.dumps({"ok": True, "bench": str(out / "bench.json"), "fitted": fitted.values}))
        return
    table = Table(title=f"collectives on {res.host} ({res.backend}, {res.world_size} ranks)")
    for col in ("op", "ranks", "bytes", "time us", "algbw GB/s", "busbw GB/s"):
        table.add_column(col, justify="right")
    for p in res.collectives:
        table.add_row(p.op, str(p.ranks), f"{p.bytes:,}", f"{p.seconds * 1e6:,.0f}", f"{p.algbw_GBps:.3f}",
                      f"{p.busbw_GBps:.3f}")  # fmt: skip
    console.print(table)
    fit_table = Table(title=f"fitted against {base.name}")
    for col in ("field", "catalogue", "microbenchmark"):
        fit_table.add_column(col)
    for path, value in fitted.values.items():
        fit_table.add_row(path, f"{get_field(base, path):.4g}", f"{value:.4g}")
    console.print(fit_table)
    console.print(f"bench.json → {out / 'bench.json'}" + "".join(f"\nskipped: {s}" for s in res.skipped))


def _show(result: Calibrated, title: str) -> None:
    table = Table(title=title)
    for col in ("layout", "set", "measured s", "before s", "after s [95%]", "error before", "error after"):
        table.add_column(col, justify="right")
    for r in result.rows:
        table.add_row(r.label, r.role, f"{r.measured_s:.4f} ± {r.measured_sd_s:.4f}", f"{r.before_s:.4f}",
                      f"{r.after_s:.4f} [{r.low_s:.4f}, {r.high_s:.4f}]", f"{r.error_before:+.1%}",
                      f"{r.error_after:+.1%}")  # fmt: skip
    console.print(table)
    for note in result.notes:
        console.print(f"  {note}", highlight=False)


def _write_profile(profile: Cluster, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(json.loads(profile.model_dump_json(exclude_none=True)), sort_keys=False)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(f"# Written by `twin calibrate`; see `calibration:` for the runs and the fit.\n{text}")
    tmp.replace(path)


def calibrate_command(
    runs: Annotated[list[Path], typer.Argument(help="Run directories written by `twin execute`.")],
    cluster: Annotated[str, typer.Option(help="The catalogue cluster the runs ran on.")],
    out: Annotated[Path | None, typer.Option(help="Profile to write (default topologies/calibrated/NAME.yaml).")] = (
        None
    ),
    bench_file: BenchOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Fit a cluster profile to executor runs; print measured, predicted before and after, and the error."""
    from twin.calibrate.report import summary

    base = loader.load_cluster(cluster)
    path = output_file(out or loader.TOPOLOGY_DIR / "calibrated" / f"{base.name}.yaml", "--out")
    result = api.calibrate(runs, base, bench=bench_file)
    _write_profile(result.profile, path)
    if as_json:
        print(json.dumps({"ok": True, "profile": str(path), "rows": [r.to_json() for r in result.rows],
                          "fit": summary(result.rows, "fit")}))  # fmt: skip
        return
    _show(result, f"calibration of {base.name} on {len(runs)} run(s)")
    console.print(f"profile → {path} (plans name it as cluster: calibrated/{path.stem})")


def loop(
    plans: Annotated[list[str], typer.Argument(help="Plan files or presets; the last --holdout are held out.")],
    overrides: SetOpt = None,
    holdout: Annotated[int, typer.Option(min=0, help="Plans (the last given) predicted without being fitted.")] = 0,
    repeats: Annotated[int, typer.Option(min=1, help="Runs of each plan (their spread is reported).")] = 2,
    steps: Annotated[int, typer.Option(min=3, help="Steps per run (the first two are warm-up).")] = 8,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    out: Annotated[Path | None, typer.Option(help="Loop directory (default runs/loop-<time>).")] = None,
    bench_file: BenchOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Predict, execute, calibrate on all but the held-out plans, re-predict them; write report.md/.html."""
    from twin.calibrate.loop import calibrate, run_all, split, stamp
    from twin.calibrate.report import summary, write_report

    loaded = [loader.load(p, overrides or []) for p in plans]
    clusters = {str(p.cluster) for p in loaded}
    if len(clusters) != 1:
        raise PlanError(f"twin loop: the plans name several clusters {sorted(clusters)}; loop over one at a time")
    base = loader.plan_cluster(loaded[0])
    out = output_dir(out or Path("runs") / f"loop-{stamp()}", "--out")
    with Progress(transient=False, console=err_console) as bar:
        task = bar.add_task("executing plans", total=len(plans) * repeats)

        def started(label: str) -> None:
            bar.update(task, description=label)
            bar.advance(task)

        dirs = run_all(plans, overrides or [], repeats, steps, out, device, started)
    fit_data, held = split(dirs, holdout)
    result = calibrate(fit_data, base, held, bench_file, name=base.name)
    _write_profile(result.profile, out / f"{base.name}.yaml")
    title = f"Calibration loop: {base.name}, {len(fit_data)} plans fitted, {len(held)} held out"
    write_report(out, result.rows, title, result.notes)
    if as_json:
        print(json.dumps({"ok": True, "out": str(out), "fit": summary(result.rows, "fit"),
                          "held_out": summary(result.rows, "held out")}))  # fmt: skip
        return
    _show(result, title)
    console.print(f"report → {out / 'report.md'}, {out / 'report.html'}; profile → {out / (base.name + '.yaml')}")
