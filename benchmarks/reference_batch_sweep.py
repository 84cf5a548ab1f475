"""The seeds' 100k-H100 reference: which global batch, and which layout, reaches the 35-55% MFU band.

The seeds pair a dense 1T model on TP8 x PP16 x DP781 with a ~4M-token batch. This sweeps microbatches per replica,
pipeline schedule and recompute policy for that layout, and a few layouts that need fewer replicas (context or
deeper pipeline parallelism), keeping only plans that fit in memory; it prints each layout's smallest batch in the
band and days to train 15T tokens, beside the seeds' ~26 days at 40% MFU. Writes
benchmarks/results/reference_batch_sweep.json. Run: `python benchmarks/reference_batch_sweep.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from plan import loader
from plan.loader import PlanError
from twin.step.predict import predict

LAYOUTS = {  # name -> overrides; every one uses ~100k H100s
    "TP8 PP16 DP781 (seeds)": ["layout.tp=8", "layout.pp=16", "layout.cp=1", "layout.dp=781"],
    "TP8 CP2 PP16 DP390": ["layout.tp=8", "layout.pp=16", "layout.cp=2", "layout.dp=390"],
    "TP8 PP32 DP390": ["layout.tp=8", "layout.pp=32", "layout.cp=1", "layout.dp=390"],
    "TP8 CP4 PP16 DP195": ["layout.tp=8", "layout.pp=16", "layout.cp=4", "layout.dp=195"],
}
SCHEDULES = {"1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2, "interleaved-1f1b v4": 4, "zbv": 2}
MICROBATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
BAND = (0.35, 0.55)


def candidates(layout: list[str]):  # type: ignore[no-untyped-def]
    dp = int(next(o for o in layout if o.startswith("layout.dp=")).split("=")[1])
    for m in MICROBATCHES:
        for label, v in SCHEDULES.items():
            for recompute in ("selective", "full"):
                sets = [
                    *layout,
                    f"layout.schedule={label.split()[0]}",
                    f"layout.virtual_stages={v}",
                    f"layout.recompute={recompute}",
                    f"training.global_batch={dp * m}",
                ]
                try:
                    yield m, label, recompute, loader.load("reference-100k", sets)
                except PlanError:
                    continue  # e.g. interleaved needs microbatches in multiples of pp


def main() -> None:
    rows = []
    for name, layout in LAYOUTS.items():
        for m, schedule, recompute, plan in candidates(layout):
            p = predict(plan)
            rows.append(
                {
                    "layout": name,
                    "microbatches": m,
                    "schedule": schedule,
                    "recompute": recompute,
                    "global_batch": plan.training.global_batch,
                    "tokens_per_step_M": plan.tokens_per_step / 1e6,
                    "mfu": p.mfu,
                    "fits": p.fits,
                    "memory_GiB": p.memory.peak,
                    "step_s": p.step_time_s,
                    "days_15T": p.days_to_train,
                }
            )
    fitting = [r for r in rows if r["fits"]]
    smallest = min((r for r in fitting if r["layout"].endswith("(seeds)")), key=lambda r: r["global_batch"])
    best_at = {}
    for r in sorted(fitting, key=lambda r: (r["global_batch"], -r["mfu"])):
        if BAND[0] <= r["mfu"] and r["layout"] not in best_at:
            best_at[r["layout"]] = r
    table = Table(title="1T dense on ~100k H100: the smallest batch per layout in the 35-55% MFU band")
    for col in (
        "layout",
        "schedule",
        "recompute",
        "microbatches",
        "global batch",
        "tokens/step",
        "MFU",
        "memory",
        "days for 15T",
    ):
        table.add_column(col)
    smallest_row = {**smallest, "layout": smallest["layout"] + " — smallest valid batch"}
    for r in [smallest_row, *best_at.values()]:
        table.add_row(
            r["layout"],
            r["schedule"],
            r["recompute"],
            str(r["microbatches"]),
            f"{r['global_batch']:,}",
            f"{r['tokens_per_step_M']:.1f}M",
            f"{r['mfu']:.1%}",
            f"{r['memory_GiB']:.0f} GiB",
            f"{r['days_15T']:.1f}",
        )
    Console(width=160).print(table)
    print("the seeds: ~4M tokens per step, ~26 days at 40% MFU")
    out = Path(__file__).parent / "results" / "reference_batch_sweep.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"smallest_valid": smallest, "smallest_in_band": best_at, "all": rows}, indent=2))
    print(f"wrote {out} ({len(rows)} plans predicted)")


if __name__ == "__main__":
    main()
