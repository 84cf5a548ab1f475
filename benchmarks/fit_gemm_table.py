"""Fit an accelerator's GEMM timing to a measured table of GEMMs by shape — kernel-level truth, not a training run.

The step model prices a GEMM of m x k by k x n (b of them, batched) as

    t = max(2·b·m·n·k / (fraction · peak), bytes / bandwidth) + fixed,    bytes = 2·b·(m·k + k·n + m·n)

the best-shape throughput, the operands and product moved once at the bandwidth GEMMs see (above HBM's where L2
serves a reused operand), and a fixed cost per GEMM (launch, the first wave's ramp and the last wave's tail).
cuBLAS picks its tile per shape, so one fixed tile's wave quantization (the model for accelerators without a
table) fits such a table worse than no wave term at all: this script fits both and prints them (H100: rms 0.27
against 0.04 in log time).

H100: XLA's default GEMM table for sm_90 (benchmarks/data/xla_sm90_matmul_bf16.csv, 375 shapes, b in {1, 2, 4},
m, n, k in 256-4096). The fit takes the shapes of transformer layers, every dimension (m·b for m) at least 1,024;
the smaller ones (k = 256 writes an output 16 times its work) are reported, not fitted. The three constants go
into topologies/accelerators/h100-sxm5-80gb.yaml by hand (compute.gemm_peak_fraction.bf16, gemm_bandwidth_GBps,
gemm_fixed_us); tests/test_published.py checks the file against this fit.

Least squares on log(model / measured time) (`scipy.optimize.least_squares`). Prints the fit, the worst shapes and
the table's own layer-sized shapes, and writes benchmarks/results/fit_gemm_table.json.
Run: `python benchmarks/fit_gemm_table.py`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from plan import loader
from twin.calibrate.bench_fit import fit_gemm_timing
from twin.step.compute import TILE, Device, fitted_gemm_s

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "benchmarks" / "data" / "xla_sm90_matmul_bf16.csv"
H100 = loader.load_cluster("dgx-h100-superpod")
PEAK_FLOPS = H100.accelerator.peak_tflops["bf16"] * 1e12
"""The dense bf16 peak the table's fraction is of (topologies/accelerators/h100-sxm5-80gb.yaml)."""
OPERAND_BYTES = 2
LAYER_SIZED = 1024
"""The smallest dimension a transformer layer's GEMM has in the tables the twin is judged by (elements)."""


@dataclass(frozen=True)
class GemmFit:
    fraction: float
    """Best-shape throughput over the dense peak."""
    bandwidth_GBps: float
    """Bandwidth GEMM operands and products move at (1e9 bytes/s)."""
    fixed_us: float
    """Fixed cost per GEMM (microseconds)."""
    shapes: int
    """Shapes fitted (the layer-sized ones)."""
    rms_log_error: float
    """Root mean square of log(model / measured time) over them."""
    worst_log_error: float
    """The largest |log(model / measured time)| among them."""


def load_table(path: Path = TABLE) -> pd.DataFrame:
    """The measured table with each shape's FLOPs, bytes and time."""
    table = pd.read_csv(path, comment="#")
    table["flops"] = 2.0 * table.b * table.m * table.n * table.k
    table["bytes"] = OPERAND_BYTES * table.b * (table.m * table.k + table.k * table.n + table.m * table.n)
    table["seconds"] = table.flops / table.flops_per_s
    return table


def layer_sized(table: pd.DataFrame) -> pd.Series:
    """The shapes a transformer layer runs: every dimension (m·b for m) at least LAYER_SIZED."""
    return (table.m * table.b >= LAYER_SIZED) & (table.n >= LAYER_SIZED) & (table.k >= LAYER_SIZED)


def model_seconds(x: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, peak: float = PEAK_FLOPS) -> np.ndarray:
    """The step model's GEMM time (`fitted_gemm_s`) at x = (fraction, bandwidth GB/s, fixed us)."""
    fraction, bandwidth_GBps, fixed_us = x
    return np.asarray(fitted_gemm_s(flops, nbytes, fraction * peak, bandwidth_GBps * 1e9, fixed_us * 1e-6))


def fit(table: pd.DataFrame, waves: bool = False) -> GemmFit:
    """The three constants over the layer-sized shapes (`fit_gemm_timing`, as `twin bench` fits a GPU); with
    `waves`, each shape's compute slowed by one fixed tile's wave efficiency (`Device.wave_efficiency`, the model for
    accelerators without a table), the alternative the table rules out."""
    rows = table[layer_sized(table)]
    flops, nbytes, measured = (rows[c].to_numpy() for c in ("flops", "bytes", "seconds"))
    if waves:  # the compute term only: bytes stay as moved
        device = Device.of(H100, "bf16", H100.node.gpus)
        flops = flops / np.array([device.wave_efficiency(r.m, r.n, r.b) for r in rows.itertuples()])
    (fraction, bandwidth, fixed), r = fit_gemm_timing(flops, nbytes, measured, PEAK_FLOPS)
    return GemmFit(fraction, bandwidth, fixed, len(rows), float(np.sqrt(np.mean(r**2))), float(np.abs(r).max()))


def main() -> None:
    table = load_table()
    result = fit(table)
    x = np.array([result.fraction, result.bandwidth_GBps, result.fixed_us])
    table["model_error"] = model_seconds(x, table.flops.to_numpy(), table.bytes.to_numpy()) / table.seconds - 1
    print(
        f"H100 bf16 GEMM timing from XLA's sm_90 table ({result.shapes} layer-sized shapes of {len(table)}): "
        f"fraction {result.fraction:.3f}, bandwidth {result.bandwidth_GBps:,.0f} GB/s, fixed {result.fixed_us:.2f} us; "
        f"rms log error {result.rms_log_error:.3f}, worst {result.worst_log_error:.3f}"
    )
    sized = table[layer_sized(table)].assign(size=lambda t: t.model_error.abs())
    print("worst layer-sized shapes (model time over measured, less one):")
    print(sized.nlargest(8, "size")[["b", "m", "n", "k", "flops_per_s", "model_error"]].to_string(index=False))
    small = table[~layer_sized(table)]
    print(f"smaller shapes, not fitted: {len(small)}, mean |error| {small.model_error.abs().mean():.2f}")
    waves = fit(table, waves=True)
    print(
        f"the same fit with one {TILE[0]}x{TILE[1]} tile's waves on {H100.accelerator.sm_count} SMs: fraction "
        f"{waves.fraction:.3f}, rms log error {waves.rms_log_error:.3f}, worst {waves.worst_log_error:.3f}"
    )
    out = ROOT / "benchmarks" / "results" / "fit_gemm_table.json"
    record = {"table": str(TABLE.relative_to(ROOT)), **asdict(result), "with_one_tile_waves": asdict(waves)}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
