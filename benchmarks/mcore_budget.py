"""Where each Megatron-Core H100 row's step goes in the twin, and what the published figure leaves room for.

The Megatron-Core r0.8.0 table (../shared/published/megatron-core-h100.md) does not publish micro-batch size,
interleaving or dropout, and benchmarks/published.py fixes them once for the table (micro-batch 1; pipelined rows
interleaved, since the README's pipeline-communication overlap exists only under the interleaved schedule: the
largest of 6, 4, 3, 2 virtual stages that divides their layers per rank, as issue 13 fixed it, else one layer per
virtual stage).
This script asks what the published figures themselves say about those choices, with nothing fitted:

1. Per row: the published step time (Megatron-Core's FLOP count over the published TFLOP/s), the twin's compute,
   exposed TP, bubble and exposed DP, and the "room" the published step leaves beside compute and TP. Where the
   twin's own data-parallel exposure (the fp32 gradient reduce-scatter that only the last microbatch's backward can
   hide, and the bf16 parameter all-gather under the first forward) is larger than that room, the row cannot have
   run as planned: either a setting differs (a larger micro-batch hides more of the reduction) or the twin's compute
   is too slow.
2. The same release's strong-scaling figure (README, images/strong_scaling.png at f2e5db402c: the 177B model at a
   fixed batch of 1,152 sequences, MFU 47 % at 96 GPUs falling to 42 % at 4,608; the 2,304-GPU point is the table's
   177B row at 44 %), predicted as TP8 x PP6 with DP 2, 48 and 96 at 1, 2, 4 and 8 virtual stages. At DP 96 each
   pipeline gets 12 microbatches, whose non-interleaved bubble (5/12) leaves no way to 42 % from 47 %: the figure
   implies interleaving, and the 96-GPU point (bubble and DP traffic negligible) measures the twin's compute alone.
3. Every row at micro-batch 1, 2 and 4 (the README publishes none): a larger micro-batch gives the data-parallel
   reduction a longer last backward to hide behind (and a pipelined row a larger bubble). Shown, not adopted: a
   micro-batch chosen from the figure it is checked on would be a fit.

Prints the three tables and writes benchmarks/results/mcore_budget.json. Run: `python benchmarks/mcore_budget.py`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.published import MCORE_H100, McoreRow, mcore_plan, mcore_tflops, mcore_virtual_stages, vp_label
from twin import api

STRONG_SCALING = ((2, 0.47), (48, 0.44), (96, 0.42))
"""(DP, published MFU) of the README's strong-scaling figure for the 177B model at TP8 x PP6 (96, 2,304 and
4,608 GPUs): the endpoints as the README's prose gives them, the middle as the weak-scaling table's 177B row."""

STRONG_BATCH = 1152


def row_budget(row: McoreRow) -> dict[str, Any]:
    pred = api.predict(mcore_plan(row))
    b = pred.breakdown_s
    published_s = mcore_tflops(row, 1.0) / row.tflops  # Megatron-Core's FLOPs over the published TFLOP/s
    busy = b["compute"] + b["tp_comm"] + b["bubble"]
    return {
        "row": row.name,
        "layout": f"TP{row.tp} PP{row.pp} DP{row.dp}" + vp_label(mcore_virtual_stages(row)),
        "published_s": published_s,
        "predicted_s": pred.step_time_s,
        "compute_s": b["compute"],
        "tp_exposed_s": b["tp_comm"],
        "bubble_s": b["bubble"],
        "dp_exposed_s": b["dp_comm_exposed"],
        "room_s": published_s - busy,
        "tflops_error": published_s / pred.step_time_s - 1,  # the twin's TFLOP/s over the published, less one
    }


def strong_scaling() -> list[dict[str, Any]]:
    base = next(r for r in MCORE_H100 if r.name == "177B")
    peak = api.load_cluster("dgx-h100-superpod").accelerator.peak_tflops["bf16"]  # the README's MFU divides by it
    out = []
    for dp, published in STRONG_SCALING:
        row = dataclasses.replace(base, dp=dp, batch=STRONG_BATCH)
        for virtual in (1, 2, 4, 8):
            pred = api.predict(mcore_plan(row, virtual))
            mfu = mcore_tflops(row, pred.step_time_s) / peak
            out.append({"gpus": row.tp * row.pp * dp, "dp": dp, "virtual": virtual, "published_mfu": published,
                        "predicted_mfu": mfu, "bubble_s": pred.breakdown_s["bubble"],
                        "dp_exposed_s": pred.breakdown_s["dp_comm_exposed"]})  # fmt: skip
    return out


MICRO_BATCHES = (1, 2, 4)


def micro_batch_errors() -> list[dict[str, Any]]:
    """Each row's TFLOP/s error at every micro-batch in MICRO_BATCHES that divides its batch per replica."""
    out = []
    for row in MCORE_H100:
        for mbs in MICRO_BATCHES:
            if (row.batch // row.dp) % mbs:
                continue
            plan = api.load_plan(mcore_plan(row), [f"layout.microbatch_size={mbs}"])
            pred, memory = api.predict(plan), api.memory(plan)
            out.append({"row": row.name, "microbatch": mbs, "tflops_error": mcore_tflops(row, pred.step_time_s) /
                        row.tflops - 1, "dp_exposed_s": pred.breakdown_s["dp_comm_exposed"],
                        "peak_gib": memory.peak, "fits": memory.fits})  # fmt: skip
    return out


def main() -> None:
    console = Console(width=150)
    rows = [row_budget(r) for r in MCORE_H100]
    table = Table(title="Megatron-Core H100 rows: the twin's step against the room the published step leaves")
    for col in ("row", "layout", "published s", "twin s", "compute", "TP", "bubble", "DP exposed", "room", "flag"):
        table.add_column(col, justify="left" if col in ("row", "layout", "note") else "right")
    for r in rows:
        note = "DP > room" if r["dp_exposed_s"] > max(0.0, r["room_s"]) else ""
        if r["room_s"] < 0:
            note = "busy > published"
        table.add_row(
            r["row"], r["layout"], *(f"{r[k]:.3f}" for k in ("published_s", "predicted_s", "compute_s")),
            *(f"{r[k]:.3f}" for k in ("tp_exposed_s", "bubble_s", "dp_exposed_s", "room_s")), note,
        )  # fmt: skip
    console.print(table)
    strong = strong_scaling()
    table = Table(title="177B strong scaling at batch 1,152, TP8 x PP6: MFU by virtual stages")
    for col in ("GPUs", "published", "v=1", "v=2", "v=4", "v=8"):
        table.add_column(col, justify="right")
    for dp, published in STRONG_SCALING:
        cells = [f"{s['predicted_mfu']:.1%}" for s in strong if s["dp"] == dp]
        table.add_row(f"{6 * 8 * dp:,}", f"{published:.0%}", *cells)
    console.print(table)
    by_mbs = micro_batch_errors()
    table = Table(title="TFLOP/s error by micro-batch (a what-if; the table runs 1; GiB where it does not fit)")
    for col in ("row", *(f"mbs {m}" for m in MICRO_BATCHES)):
        table.add_column(col, justify="right")
    for r in MCORE_H100:
        cells = {e["microbatch"]: f"{e['tflops_error']:+.1%}" + ("" if e["fits"] else f" ({e['peak_gib']:.0f} GiB)")
                 for e in by_mbs if e["row"] == r.name}  # fmt: skip
        table.add_row(r.name, *(cells.get(m, "") for m in MICRO_BATCHES))
    means = {m: [abs(e["tflops_error"]) for e in by_mbs if e["microbatch"] == m] for m in MICRO_BATCHES}
    table.add_row("mean |error|", *(f"{sum(v) / len(v):.1%} ({len(v)})" for v in means.values()))
    console.print(table)
    out = Path(__file__).parent / "results" / "mcore_budget.json"
    out.write_text(json.dumps({"rows": rows, "strong_scaling": strong, "micro_batch": by_mbs}, indent=1) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
