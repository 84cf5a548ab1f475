"""Fit an accelerator's one fitted constant, its in-training fraction, on one published table — and only there.

The accelerator files price GEMMs from a table of GEMMs measured alone (XLA's sm_90 sweep) and fused attention from
the kernels' own benchmarks (the FlashAttention papers' tables). Inside a training step the weight GEMMs run slower
than the sweep: the whole step's power sets the clocks, communication kernels share the SMs and L2, and Transformer
Engine's GEMMs carry epilogues and fp32 weight-gradient accumulation. `compute.in_training_fraction` scales the
GEMMs' throughput by that ratio; the attention tables run as measured (scaled too, the fit's residual was 2.4%;
GEMMs alone, 1.3%). Issue 13's rule: fit such a constant once per accelerator generation on one table, and report
the others.

H100: fitted on the bf16 rows of NVIDIA's DGX Cloud recipes (benchmarks/published.py DGXC_H100), the only H100 table
whose every setting is published (layout, micro-batch, stack flags). Left out: the same table's fp8 rows,
Megatron-Core's H100 table, Llama 3's Table 4, NeMo's 24.07 and 24.03.01 performance summaries. A100: no fraction is
fitted (its tables agree without one).

Least squares on log(predicted / published step time) over the rows (`scipy.optimize.least_squares`); the standard
error comes from the Jacobian (s²·(JᵀJ)⁻¹). Prints the fit and writes benchmarks/results/fit_in_training.json.
Run: `python benchmarks/fit_in_training.py`. The value goes into topologies/accelerators/h100-sxm5-80gb.yaml by hand,
with this script's figures; tests/test_published.py checks the file still sits at the table's centre.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.published import DGXC_H100, DgxcRow, dgxc_plan
from twin.step.predict import predict

FIELD = "cluster.compute.in_training_fraction"


def residuals(fraction: float, rows: list[DgxcRow]) -> np.ndarray:
    """log(predicted / published step time) of each row with the fraction set."""
    return np.array([math.log(predict(dgxc_plan(r, [f"{FIELD}={fraction}"])).step_time_s / r.step_s) for r in rows])


def fit(rows: list[DgxcRow]) -> dict[str, float]:
    """The fraction that centres the rows, its standard error, and the residual spread."""
    result = least_squares(lambda x: residuals(float(x[0]), rows), x0=[0.9], bounds=([0.3], [1.0]), diff_step=1e-3)
    r, jac = result.fun, result.jac
    dof = max(1, len(r) - 1)
    s2 = float(r @ r) / dof
    std = math.sqrt(s2 / float(jac[:, 0] @ jac[:, 0]))
    return {"fraction": float(result.x[0]), "std": std, "rows": len(rows), "rms_log_error": math.sqrt(s2)}


def main() -> None:
    bf16 = [r for r in DGXC_H100 if r.dtype == "bf16"]
    out = fit(bf16)
    print(
        f"H100 in_training_fraction = {out['fraction']:.3f} ± {out['std']:.3f} (1 s.e.) from {out['rows']} bf16 rows "
        f"of NVIDIA/dgxc-benchmarking v25.02; residual rms {out['rms_log_error']:.1%}"
    )
    for r, e in zip(bf16, residuals(out["fraction"], bf16), strict=True):
        print(f"  {r.model:12s} {r.gpus:5d} GPUs: predicted/published step {math.exp(e) - 1:+.1%}")
    path = Path(__file__).parent / "results" / "fit_in_training.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"h100": out}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
