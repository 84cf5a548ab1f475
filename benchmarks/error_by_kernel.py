"""Where the twin's error on published runs lives, by kernel class — a diagnostic, nothing in it is adopted.

For every training row of benchmarks/published_figures.py (on H100: DGX Cloud dense, Grok-1, Nemotron-4, NeMo 24.07
and 24.03.01's performance summaries, Megatron-Core r0.8.0, Llama 3 Table 4; on A100: Narayanan et al.,
Megatron-LM's README, MosaicML's MPT) the predicted step's share in three kernel classes, each found by slowing that
class alone by 1% through the accelerator's own efficiency fields (a what-if on the cluster; nothing is patched):

- `gemm`: tensor-core GEMMs at their compute-bound rate (`compute.gemm_peak_fraction`, every dtype);
- `attention`: the fused attention kernel's measured tables (`compute.attention`);
- `elementwise`: framework element-wise and normalisation kernels, fp8 casts and the loss
  (`compute.elementwise_bandwidth_fraction`).

What is left (communication, bubbles, host dispatch, the optimizer) is `1 - gemm - attention - elementwise` of the
step. Each row's error, log(predicted throughput / published), is then regressed on those shares: a coefficient c
says the class would have to run (1 + c) times as long as the twin prices it for the rows to agree, all else equal.
The fits are in-sample and several explanations fit the same rows, so they point where to look for a kernel-level
source, not at a constant to fit (issue 13: nothing fitted per row, one constant per accelerator).

Prints the rows and the fits and writes benchmarks/results/error_by_kernel.json.
Run: `python benchmarks/error_by_kernel.py` (about 30 s).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.published_figures import TABLES, Row
from plan import loader
from plan.cluster import Cluster
from twin.fidelity import PRECISION
from twin.step.predict import predict

SLOWER = 1.01
"""Each class is slowed by 1% to read its share of the step."""

CLASSES = ("gemm", "attention", "elementwise")

FITS: dict[str, tuple[str, ...]] = {
    "one constant": ("all",),
    "GEMM 16-bit / GEMM fp8": ("gemm_16-bit", "gemm_fp8"),
    "GEMM 16-bit / GEMM fp8 / attention": ("gemm_16-bit", "gemm_fp8", "attention"),
    "GEMM 16-bit / GEMM fp8 / attention / element-wise": ("gemm_16-bit", "gemm_fp8", "attention", "elementwise"),
}
"""Regressors of each fit: a row's share in a class (`all`: the whole step; GEMMs by the plan's precision, bf16 and
fp16 one, as twin/fidelity.py groups them). A regressor no row of a subset has is left out of that subset's fit."""

SUBSETS = {
    "NVIDIA DGX Cloud recipes": ("dgxc-h100", "dgxc-h100-moe", "dgxc-h100-nemotron"),
    "NVIDIA recipes and NeMo's performance summary": (
        "dgxc-h100",
        "dgxc-h100-moe",
        "dgxc-h100-nemotron",
        "nemo-24.07-h100",
        "nemo-long-seq-h100",
    ),
    "every H100 table": (
        "dgxc-h100",
        "dgxc-h100-moe",
        "dgxc-h100-nemotron",
        "nemo-24.07-h100",
        "nemo-long-seq-h100",
        "mcore-h100",
        "llama3-table4",
    ),
    "every A100 table": ("narayanan-a100", "megatron-a100-readme", "mpt-a100", "mpt-a100-40gb"),
}
"""The rows each fit reads: the H100 recipes whose every setting is published; with NeMo's earlier releases, whose
recipes the launcher of the time holds; then with the H100 tables whose layouts are partly deduced (Megatron-Core's
micro-batch and interleaving, Llama 3's kernels); the A100 tables, whose accelerator has no fitted constant."""


def _slower(cluster: Cluster, kind: str) -> Cluster:
    """The same cluster with one kernel class 1% slower."""
    eff = cluster.compute
    if kind == "gemm":
        update: dict[str, Any] = {"gemm_peak_fraction": {k: v / SLOWER for k, v in eff.gemm_peak_fraction.items()}}
    elif kind == "attention":
        update = {
            "attention": {
                name: tuple(
                    t.model_copy(
                        update={
                            f: tuple(x / SLOWER for x in getattr(t, f))
                            for f in ("forward_tflops", "backward_tflops", "fwd_bwd_tflops")
                            if getattr(t, f) is not None
                        }
                    )
                    for t in tables
                )
                for name, tables in eff.attention.items()
            }
        }
    else:
        base = eff.elementwise_bandwidth_fraction or eff.memory_bandwidth_fraction
        update = {"elementwise_bandwidth_fraction": base / SLOWER}
    return cluster.model_copy(update={"compute": eff.model_copy(update=update)})


def measure(table: str, row: Row) -> dict[str, Any]:
    """One published row (benchmarks/published_figures.py, with its plan): its error and the step's shares."""
    plan = row["plan"]
    cluster = loader.plan_cluster(plan)
    step = predict(plan, cluster).step_time_s
    shares = {
        kind: math.log(predict(plan, _slower(cluster, kind)).step_time_s / step) / math.log(SLOWER) for kind in CLASSES
    }
    return {
        "table": table,
        "row": row["what"],
        "dtype": plan.training.dtype,
        "predicted_step_s": step,
        "error": row["error"],  # the twin's figure over the published, less one (more is better in every table)
        **shares,
        "rest": 1 - sum(shares.values()),
    }


def _regressor(row: dict[str, Any], name: str) -> float:
    if name == "all":
        return 1.0
    if name.startswith("gemm_"):
        return row["gemm"] if PRECISION.get(row["dtype"], row["dtype"]) == name.removeprefix("gemm_") else 0.0
    return float(row[name])


def fit(rows: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, Any]:
    """Least squares of each row's log throughput error on its shares: c per class, ± one standard error."""
    names = tuple(n for n in names if any(_regressor(r, n) for r in rows))  # no fp8 row, no fp8 regressor
    y = np.array([math.log(1 + r["error"]) for r in rows])
    x = np.array([[_regressor(r, n) for n in names] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)  # a class priced too fast makes its rows optimistic: y > 0
    resid = y - x @ coef
    dof = max(1, len(rows) - len(names))
    cov = np.linalg.pinv(x.T @ x) * float(resid @ resid) / dof
    after = np.exp(resid) - 1
    return {
        "classes": {
            n: {"c": float(c), "se": float(math.sqrt(max(v, 0.0)))}
            for n, c, v in zip(names, coef, np.diag(cov), strict=True)
        },
        "rows": len(rows),
        "mean_abs_error_before": float(np.mean(np.abs([r["error"] for r in rows]))),
        "mean_abs_error_after": float(np.mean(np.abs(after))),
        "worst_abs_error_after": float(np.max(np.abs(after))),
    }


def main() -> None:
    console = Console()
    tables = sorted({t for names in SUBSETS.values() for t in names})
    rows = [measure(t, r) for t in tables for r in TABLES[t]() if "plan" in r]
    table = Table(title="H100 rows: the twin's throughput error and the step's share by kernel class")
    for col in ("row", "error", "GEMM", "attention", "element-wise", "rest"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for r in sorted(rows, key=lambda r: -abs(r["error"])):
        table.add_row(r["row"], f"{r['error']:+.1%}", *(f"{r[k]:.2f}" for k in (*CLASSES, "rest")))
    console.print(table)
    fits: dict[str, Any] = {}
    for subset, tables in SUBSETS.items():
        chosen = [r for r in rows if r["table"] in tables]
        fits[subset] = {name: fit(chosen, names) for name, names in FITS.items()}
        out = Table(title=f"{subset} ({len(chosen)}): c, the extra time a class would need (1 s.e.)")
        for col in ("regressors", "c", "mean |error| before → after", "worst after"):
            out.add_column(col, justify="left" if col == "regressors" else "right")
        for name, f in fits[subset].items():
            cs = ", ".join(f"{k} {v['c']:+.3f}±{v['se']:.3f}" for k, v in f["classes"].items())
            before, after = f["mean_abs_error_before"], f["mean_abs_error_after"]
            out.add_row(name, cs, f"{before:.1%} → {after:.1%}", f"{f['worst_abs_error_after']:.1%}")
        console.print(out)
    path = Path(__file__).resolve().parent / "results" / "error_by_kernel.json"
    path.write_text(json.dumps({"rows": rows, "fits": fits}, indent=1) + "\n")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
