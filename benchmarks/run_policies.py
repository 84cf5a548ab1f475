"""Whole-run figures for issue 5, with speed.

1. Speed: one simulated run of the 100k-GPU reference (about 26 training days), and 100 seeds of it.
2. Llama 3 405B on 16,384 H100 for 54 days at the catalogue's failure rates: interruptions by cause beside
   Table 5 of Dubey et al. 2024, and goodput under a Llama-3-like policy (async checkpoints, automated restart).
3. The seeds' 100k fleet: MTBF, and goodput of sync checkpoints every 30 minutes against async in-memory
   checkpoints with hot spares and sub-minute recovery; the gain in MFU-equivalent points (MFU x goodput).
Writes benchmarks/results/run_policies.json. Run: `python benchmarks/run_policies.py`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.published import LLAMA3_TABLE_5
from plan import loader
from twin.run.summary import run_seeds, setup, simulate_run, summarise
from twin.step.predict import predict

SEEDS = 100
SLACK = ["layout.dp=760", "training.global_batch=24320", "reliability.hot_spares=128"]
"""2.7% of the fleet held back: 760 replicas leave 336 nodes, 128 of them hot spares."""
FAST = ["reliability.restart_min=0.5", "reliability.heartbeat_timeout_s=10", "reliability.watchdog_timeout_s=30"]
POLICIES = {
    "seeds' fleet as given (4 spare nodes), async": ["reliability.checkpoint=async", "reliability.elastic=false"],
    "... and elastic shrink instead of waiting": ["reliability.checkpoint=async", "reliability.elastic=true"],
    "2.7% slack: sync every 30 min, 10 min restart": [
        *SLACK,
        "reliability.checkpoint=sync",
        "reliability.checkpoint_interval_min=30",
    ],
    "2.7% slack: async, Daly interval, 10 min restart": [*SLACK, "reliability.checkpoint=async"],
    "2.7% slack: in-memory + 128 hot spares, 10 min restart": [*SLACK, "reliability.checkpoint=in-memory"],
    "2.7% slack: in-memory + 128 hot spares, recovery < 1 min": [*SLACK, "reliability.checkpoint=in-memory", *FAST],
}


def speed() -> dict:
    run_setup = setup(loader.load("reference-100k"))
    t0 = time.perf_counter()
    one = simulate_run(run_setup, 0)
    single = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_seeds(run_setup, range(SEEDS))
    many = time.perf_counter() - t0
    return {
        "one_run_s": single,
        "seeds": SEEDS,
        "seeds_s": many,
        "simulated_wall_days": one.wall_days,
        "ideal_days": one.ideal_days,
    }


def llama() -> dict:
    run_setup = setup(loader.load("llama3-405b-16k"))
    run_setup = replace(run_setup, useful_s=54 * 86400 * 0.9)  # about 54 days of wall time
    runs = run_seeds(run_setup, range(20))
    stats = summarise(runs)
    scale = 54 / stats["wall_days"]["mean"]
    return {
        "per_54_days": {c: stats["interruptions"].get(c, 0) * scale for c in LLAMA3_TABLE_5},
        "stragglers_per_54_days": stats["interruptions"].get("straggler", 0) * scale,
        "goodput": stats["goodput"],
        "published": LLAMA3_TABLE_5,
    }


def fleet() -> dict:
    mfu = predict(loader.load("reference-100k")).mfu
    out = {"mfu": mfu, "policies": {}}
    for name, sets in POLICIES.items():
        stats = summarise(run_seeds(setup(loader.load("reference-100k", sets)), range(10)))
        out["policies"][name] = {
            "goodput": stats["goodput"],
            "wall_days": stats["wall_days"],
            "mtbf_hours": stats["mtbf_hours"]["mean"],
            "effective_mfu": mfu * stats["goodput"]["mean"],
        }
    return out


def main() -> None:
    console = Console(width=140)
    results = {"speed": speed(), "llama3": llama(), "fleet": fleet()}
    sp = results["speed"]
    console.print(
        f"speed: one run ({sp['simulated_wall_days']:.1f} wall days, {sp['ideal_days']:.1f} ideal) in "
        f"{sp['one_run_s']:.2f} s; {SEEDS} seeds in {sp['seeds_s']:.1f} s"
    )
    table = Table(title="Llama 3 405B, 16,384 H100, 54 days: interruptions by cause")
    for col in ("cause", "simulated (mean of 20)", "Llama 3 Table 5"):
        table.add_column(col)
    for cause, published in LLAMA3_TABLE_5.items():
        table.add_row(cause, f"{results['llama3']['per_54_days'][cause]:.1f}", str(published))
    table.add_row("total", f"{sum(results['llama3']['per_54_days'].values()):.1f}", "466")
    console.print(table)
    g = results["llama3"]["goodput"]
    console.print(
        f"Llama-3-like policy goodput {g['mean']:.1%} (5th-95th {g['p5']:.1%}-{g['p95']:.1%}); "
        f"the paper reports >90% effective training time"
    )
    fl = results["fleet"]
    table = Table(title=f"100k-H100 reference (step-model MFU {fl['mfu']:.1%}): recovery policy")
    for col in ("policy", "MTBF (h)", "goodput", "wall days", "MFU x goodput"):
        table.add_column(col)
    for name, r in fl["policies"].items():
        table.add_row(
            name,
            f"{r['mtbf_hours']:.2f}",
            f"{r['goodput']['mean']:.1%}",
            f"{r['wall_days']['mean']:.1f}",
            f"{r['effective_mfu']:.1%}",
        )
    console.print(table)
    out = Path(__file__).parent / "results" / "run_policies.json"
    out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
