"""How fast `twin predict` is, and what its cost grows with.

Times `predict` (best of 5, pinned to one core) for plans at 8, 1k, 16k and 100k GPUs, then two sweeps of the
100k reference: growing the GPU count at a fixed pipeline (dp 49 -> 781) and growing pp x microbatches at a fixed
GPU count. Event counts should follow pp x microbatches x virtual stages, not GPUs. Prints a table and writes
benchmarks/results/predict_speed.json. Run: `python benchmarks/predict_speed.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from plan import loader
from twin.step.predict import predict

CASES = {
    "8 GPUs: Llama 3 8B, TP8, one DGX H100": (
        "llama3-405b-16k",
        [
            "model=llama3-8b",
            "cluster=dgx-h100-superpod",
            "layout.dp=1",
            "layout.pp=1",
            "layout.schedule=1f1b",
            "layout.virtual_stages=1",
            "training.global_batch=64",
            "reliability.hot_spares=0",
        ],
    ),
    "1k GPUs: Llama 3 70B, TP8 PP4 DP32": (
        "llama3-405b-16k",
        [
            "model=llama3-70b",
            "cluster=dgx-h100-superpod",
            "layout.dp=32",
            "layout.pp=4",
            "layout.virtual_stages=5",
            "training.global_batch=512",
        ],
    ),
    "16k GPUs: Llama 3 405B preset": ("llama3-405b-16k", []),
    "100k GPUs: seeds' reference preset": ("reference-100k", []),
    "385k GPUs: the seeds' 1T model over the whole multi-building fleet, PP128 ZB-H1 (what `twin search` picks "
    "there under fast recovery)": (
        "reference-100k",
        [
            "cluster=multi-building-gb200-400k",
            "layout.tp=8",
            "layout.pp=128",
            "layout.cp=8",
            "layout.dp=47",
            "layout.schedule=zb-h1",
            "layout.virtual_stages=1",
            "training.global_batch=7802",
            "reliability.hot_spares=0",
        ],
    ),
}


def best_of(plan, repeats: int = 5) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    times, events = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        events = predict(plan).events
        times.append(time.perf_counter() - t0)
    return min(times), events


def row(label: str, plan) -> dict:  # type: ignore[no-untyped-def]
    seconds, events = best_of(plan)
    lay = plan.layout
    return {
        "case": label,
        "gpus": lay.world_size,
        "pp": lay.pp,
        "virtual": lay.virtual_stages,
        "microbatches": plan.num_microbatches,
        "pp_x_m_x_v": lay.pp * plan.num_microbatches * lay.virtual_stages,
        "events": events,
        "seconds": round(seconds, 4),
    }


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    t0 = time.perf_counter()  # a whole fresh `twin predict` process: interpreter, imports, cluster load, predict
    subprocess.run(
        [sys.executable, "-m", "twin.cli", "predict", "reference-100k", "--json"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    cold = time.perf_counter() - t0
    rows = [row(label, loader.load(src, sets)) for label, (src, sets) in CASES.items()]
    ref = "reference-100k"
    for dp in (49, 196, 390, 781):  # more GPUs, same pipeline
        rows.append(
            row(f"reference, dp={dp}", loader.load(ref, [f"layout.dp={dp}", f"training.global_batch={dp * 32}"]))
        )
    for m in (16, 32, 64, 128):  # same GPUs, more microbatches
        rows.append(row(f"reference, m={m}", loader.load(ref, [f"training.global_batch={781 * m}"])))
    table = Table(title=f"twin predict, warm, one core (a fresh `twin predict reference-100k` process: {cold:.2f} s)")
    for col in ("case", "gpus", "pp", "virtual", "microbatches", "pp_x_m_x_v", "events", "seconds"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        table.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in r.values()))
    Console(width=150).print(table)
    out = Path(__file__).parent / "results" / "predict_speed.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"first_call_s": cold, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
