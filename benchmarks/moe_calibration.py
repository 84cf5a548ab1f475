"""The twin against executor runs of mixture-of-experts layouts it was never fitted on (issue 17).

Executes the MoE layouts of `plans/cpu-calibration-moe/` (the tiny MoE model: DP2·EP2, DP4·EP4, DP2·EP2·TP2 and
DP4·EP2·PP2) `--repeats` times through `twin.api.execute`, pools the repeats, and predicts each with the catalogue
profile (`localhost-cpu`, before calibration) and with the profile `twin loop` fitted on the dense calibration set
(`calibrated/localhost-cpu`, after): every MoE layout is held out of that fit. Each run is priced with the expert
imbalance its records show (plan.records.expert_imbalance); the table also gives the prediction with balanced
routing, to show what the imbalance is worth, and the step's share in exposed expert-parallel all-to-all (comm_ep)
measured and predicted.

Run: `python benchmarks/moe_calibration.py [--repeats 2] [--steps 8]` (about 4 minutes on 2 cores); prints a
table and writes benchmarks/results/moe_calibration.json. Runs go to runs/moe-calibration/ (kept: a rerun reuses
finished runs; delete the directory to measure again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from twin import api
from twin.calibrate.loop import run_all
from twin.calibrate.measured import Measurement, read_measurements

ROOT = Path(__file__).resolve().parent.parent
PLANS = sorted(str(p) for p in (ROOT / "plans" / "cpu-calibration-moe").glob("*.yaml"))
OUT = Path(__file__).parent / "results" / "moe_calibration.json"
PROFILES = {"before": "localhost-cpu", "after": "calibrated/localhost-cpu"}


def row(m: Measurement) -> dict[str, Any]:
    measured_ep = statistics.mean(p["comm_ep"] for p in m.stage_phases)
    out: dict[str, Any] = {
        "layout": m.label, "runs": len(m.runs), "measured_s": m.step_s, "measured_sd": m.step_sd,
        "imbalance": m.plan.model.expert_imbalance, "measured_comm_ep_share": measured_ep / m.step_s,
    }  # fmt: skip
    balanced = m.plan.model_copy(update={"model": m.plan.model.model_copy(update={"expert_imbalance": 1.0})})
    for when, profile in PROFILES.items():
        cluster = api.load_cluster(profile)
        pred = api.predict(m.plan, cluster=cluster)
        out[f"{when}_s"] = pred.step_time_s
        out[f"{when}_error"] = pred.step_time_s / m.step_s - 1
        out[f"{when}_comm_ep_share"] = pred.breakdown_s["ep_comm"] / pred.step_time_s
        out[f"{when}_balanced_error"] = api.predict(balanced, cluster=cluster).step_time_s / m.step_s - 1
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    console = Console(width=160)
    dirs = run_all(PLANS, [], args.repeats, args.steps, ROOT / "runs" / "moe-calibration", "cpu", console.print)
    rows = sorted(
        (row(m) for runs in dirs for m in read_measurements(list(runs))), key=lambda r: -abs(r["after_error"])
    )
    table = Table(title="MoE layouts held out of the CPU calibration: step time, measured and predicted (worst first)")
    for col in ("layout", "measured s", "imbalance", "comm_ep meas.", "before s", "error", "after s", "error",
                "after, balanced", "comm_ep pred."):  # fmt: skip
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        table.add_row(
            r["layout"], f"{r['measured_s']:.3f} ± {r['measured_sd']:.3f}", f"{r['imbalance']:.2f}",
            f"{r['measured_comm_ep_share']:.0%}", f"{r['before_s']:.3f}", f"{r['before_error']:+.1%}",
            f"{r['after_s']:.3f}", f"{r['after_error']:+.1%}", f"{r['after_balanced_error']:+.1%}",
            f"{r['after_comm_ep_share']:.0%}",
        )  # fmt: skip
    console.print(table)
    for when in PROFILES:
        errors = [abs(r[f"{when}_error"]) for r in rows]
        console.print(f"{when} calibration: mean |error| {statistics.mean(errors):.1%}, worst {max(errors):.1%}")
    OUT.write_text(json.dumps({"plans": PLANS, "repeats": args.repeats, "steps": args.steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
