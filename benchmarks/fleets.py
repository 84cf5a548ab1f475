"""The seeds' 1T dense model on every fleet of the catalogue: each fleet's best layout (`twin search`, time
objective, batch 4M-64M tokens), its whole run (failures, checkpoints, elastic shrink; on fewer of its GPUs
where the whole fleet's run cannot finish or fewer finish sooner), and a warm `twin predict` of that layout timed
on one core — the issue's ≤ 0.2 s at 400k GPUs.

Prints the table the README carries and writes benchmarks/results/fleets.json.
Run: `python benchmarks/fleets.py [FLEET ...]` (the fleets in FLEETS by default; about a minute each).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.predict_speed import best_of
from twin import api
from twin.step.predict import predict

OUT = Path(__file__).parent / "results" / "fleets.json"
MODEL = "dense-1t"
TOKENS = "training.tokens=15e12"  # the reference plan's 15T tokens
BATCH = (4e6, 64e6)  # the seeds' batch range (issue 15)
FLEETS = (
    "reference-100k-h100", "xai-colossus", "hgx-b200-superpod", "gb200-nvl72-fleet", "gb300-nvl72-fleet",
    "multi-building-gb200-400k", "tpu-v4-pods", "tpu-v7-ironwood", "trn2-ultraserver-rainier",
)  # fmt: skip
"""The fleets of 16k GPUs and more: the 100k references and the 2026 fleets. On the smaller ones a 1T model takes
years, and its whole run draws a failure every few hours for all of them."""


def one_core_predict_s(plan: Any) -> float:
    """The best of 5 warm `predict`s on one core, as benchmarks/predict_speed.py times them."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if cores:
        os.sched_setaffinity(0, {min(cores)})
    try:
        predict(plan)  # warm: caches and imports
        return best_of(plan)[0]
    finally:
        if cores:
            os.sched_setaffinity(0, cores)


def main(names: list[str]) -> None:
    fleets = names or list(FLEETS)
    rows: list[dict[str, Any]] = []
    for name in fleets:
        t0 = time.perf_counter()
        frame = api.compare_fleets(MODEL, [name], [TOKENS], batch_tokens=BATCH, seeds=2)
        row = frame.to_dict(orient="records")[0]
        row["search_s"] = time.perf_counter() - t0
        plan = frame.attrs["plans"].get(name)
        if plan is not None:
            row["predict_s"] = one_core_predict_s(plan)
        rows.append(row)
        print(f"{name}: {row.get('layout') or row['reason']} ({row['search_s']:.0f} s)", flush=True)
    show(rows)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"model": MODEL, "batch_tokens": BATCH, "rows": rows}, indent=2, default=str) + "\n")
    print(f"wrote {OUT}")


def show(rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"{MODEL}, 15T tokens, batch 4M-64M tokens: each fleet at its best layout")
    heads = ("fleet", "accelerator", "GPUs", "layout", "MFU", "days", "goodput", "$M", "GWh", "predict s")
    for head in heads:
        table.add_column(head)
    print("| " + " | ".join(heads) + " |\n|" + "---|" * len(heads))
    for r in sorted(rows, key=lambda r: r["wall_days"] if r["wall_days"] == r["wall_days"] else float("inf")):
        if r.get("layout") is None or r["layout"] != r["layout"]:  # no layout (NaN): the fleet cannot hold it
            cells = [r["cluster"], str(r.get("accelerator") or ""), "", "cannot run: " + r["reason"][:80]] + [""] * 6
        else:
            ran = not r["reason"]
            gpus = f"{r['gpus']:,.0f}" + (f" of {r['fleet_gpus']:,.0f}" if r.get("note") else "")
            cells = [r["cluster"], r["accelerator"], gpus, r["layout"], f"{r['mfu']:.1%}",
                     f"{r['wall_days']:.1f}" if ran else f"({r['ideal_days']:.1f})", f"{r['goodput']:.1%}" if ran
                     else "run cannot finish", f"{r['cost_usd'] / 1e6:,.0f}" if ran else "",
                     f"{r['energy_mwh'] / 1e3:,.1f}" if ran else "", f"{r['predict_s']:.3f}"]  # fmt: skip
        table.add_row(*cells)
        print("| " + " | ".join(cells) + " |")
    Console(width=200).print(table)
    for r in rows:
        if r.get("note"):
            print(f"{r['cluster']}: {r['note']}")


if __name__ == "__main__":
    main(sys.argv[1:])
