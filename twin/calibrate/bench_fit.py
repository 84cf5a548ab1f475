"""Profile fields straight from microbenchmarks (`twin bench`): the GEMM curve, per-op costs, the host link.

These are the starting point `twin calibrate` refines against whole training steps: a microbenchmark sees one
kernel or one collective alone, a training step sees them contend (on a CPU host, with every other rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import curve_fit, least_squares

from plan.bench import BenchResult
from plan.cluster import Cluster
from twin.calibrate.fit import with_fields
from twin.step.collectives import collective_time
from twin.step.compute import OPERAND_BYTES, fitted_gemm_s
from twin.step.fabric import Fabric

GEMM_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class BenchFit:
    """Fields a microbenchmark determines, and how well its own points fit them."""

    values: dict[str, float]
    gemm_rms: dict[str, float]
    """Per dtype: RMS relative error of the fitted GEMM curve over the sweep."""
    link_rms: float
    """RMS relative error of the fitted link over the collective sweep."""


def fit_gemm_timing(
    flops: np.ndarray, nbytes: np.ndarray, seconds: np.ndarray, peak: float
) -> tuple[tuple[float, float, float], np.ndarray]:
    """(fraction, bandwidth GB/s, fixed us) of the GPU GEMM model (twin/step/compute.py `fitted_gemm_s`) that fit
    measured GEMMs best in log time, and the log residuals: `twin bench`'s GPU sweep and
    benchmarks/fit_gemm_table.py (XLA's H100 table) both fit with it, so what is fitted is what is priced."""

    def log_error(x: np.ndarray) -> np.ndarray:
        return np.log(np.asarray(fitted_gemm_s(flops, nbytes, x[0] * peak, x[1] * 1e9, x[2] * 1e-6)) / seconds)

    sol = least_squares(
        log_error, [0.7, 3000.0, 5.0], bounds=([1e-3, 1.0, 0.0], [1.0, 1e5, 1e4]), x_scale=[0.1, 1000.0, 1.0]
    )
    return (float(sol.x[0]), float(sol.x[1]), float(sol.x[2])), np.asarray(sol.fun)


def fit_gemm_gpu(bench: BenchResult, cluster: Cluster, dtype: str) -> tuple[dict[str, float], float]:
    """On a GPU: the profile fields of `fit_gemm_timing` over the sweep's points of `dtype`, and the RMS relative
    error (the bandwidth and fixed cost are the bf16 fit's, as for the H100 table)."""
    points = [p for p in bench.gemm if p.dtype == dtype]
    if len(points) < 4:
        raise ValueError(f"{dtype}: {len(points)} GEMM points; the GPU model's three constants need at least 4")
    peak = cluster.accelerator.peak_tflops.get(dtype, cluster.accelerator.peak_tflops["bf16"]) * 1e12
    width = OPERAND_BYTES.get(dtype, 2)
    flops = np.array([p.flops for p in points])
    nbytes = np.array([width * (p.m * p.k + p.k * p.n + p.m * p.n) for p in points], dtype=float)
    (fraction, bandwidth, fixed), log_error = fit_gemm_timing(
        flops, nbytes, np.array([p.seconds for p in points]), peak
    )
    fields = {f"compute.gemm_peak_fraction.{dtype}": fraction}
    if dtype == "bf16":
        fields |= {"compute.gemm_bandwidth_GBps": bandwidth, "compute.gemm_fixed_us": max(fixed, 1e-3)}
    return fields, float(np.sqrt(np.mean(np.square(np.expm1(log_error)))))


def fit_gemm(bench: BenchResult, cluster: Cluster, dtype: str, kernel_s: float) -> tuple[float, float, float]:
    """On a CPU host: (peak fraction, half-efficiency size in GFLOP, RMS relative error) of the twin's GEMM curve
    t = (f + f_half) / (fraction · peak) + kernel (twin/step/compute.py `Device.flops_s`) over the sweep's points."""
    points = [p for p in bench.gemm if p.dtype == dtype]
    if len(points) < 3:
        raise ValueError(f"{dtype}: {len(points)} GEMM points; the curve needs at least 3")
    peak = cluster.accelerator.peak_tflops.get(dtype, cluster.accelerator.peak_tflops["bf16"]) * 1e12
    flops = np.array([p.flops for p in points])
    seconds = np.array([p.seconds for p in points])

    def model(f: np.ndarray, fraction: float, half_gflop: float) -> np.ndarray:
        return (f + half_gflop * 1e9) / (fraction * peak) + kernel_s

    # relative errors (sigma ∝ t): a 32³ GEMM's microseconds matter as much as a 1024³ one's milliseconds
    (fraction, half), _ = curve_fit(
        model, flops, seconds, p0=(0.5, 1e-3), sigma=seconds, bounds=([1e-4, 0.0], [1.0, 1e3])
    )
    rms = float(np.sqrt(np.mean(np.square(model(flops, fraction, half) / seconds - 1))))
    return float(fraction), float(half), rms


def fit_link(bench: BenchResult, cluster: Cluster) -> tuple[float, float, float]:
    """(latency in us, bandwidth in GB/s, RMS relative error) of the node's link that make the twin's collective
    costs match the sweep: one intra-node tier explains every op and group size, as in the twin."""
    points = [p for p in bench.collectives if p.ranks <= cluster.node.gpus]
    if not points:
        raise ValueError("no collective points inside one node; run `twin bench` with --ranks 2 or more")

    # On a CPU host every rank of the group is busy in the collective: they share the node's cores (twin/step/host.py)
    cores = cluster.node.cpu_cores if cluster.accelerator.kind == "cpu" else None
    sharing = np.array([max(1.0, p.ranks / cores) if cores else 1.0 for p in points])

    def predicted(x: np.ndarray) -> np.ndarray:
        link = {"node.intra.latency_us": math.exp(x[0]), "node.intra.bandwidth_GBps": math.exp(x[1])}
        fabric = Fabric(with_fields(cluster, link))
        spans = [fabric.span(list(range(p.ranks))) for p in points]
        times = [collective_time(p.op, p.bytes, span).seconds for p, span in zip(points, spans, strict=True)]  # type: ignore[arg-type]
        return sharing * np.array(times)

    measured = np.array([p.seconds for p in points])
    x0 = np.log([cluster.node.intra.latency_us, cluster.node.intra.bandwidth_GBps])
    sol = least_squares(lambda x: np.log(predicted(x) / measured), x0)
    rms = float(np.sqrt(np.mean(np.square(predicted(sol.x) / measured - 1))))
    return float(math.exp(sol.x[0])), float(math.exp(sol.x[1])), rms


def fit_bench(bench: BenchResult, cluster: Cluster) -> BenchFit:
    """Every field the microbenchmark determines, against `cluster`'s peaks and fabric."""
    values: dict[str, float] = {}
    eager = [p.seconds for p in bench.ops if p.kind == "eager"]
    dtensor = [p.seconds for p in bench.ops if p.kind == "dtensor"]
    kernel_s = eager[0] if eager else cluster.compute.kernel_overhead_us * 1e-6
    if eager:
        values["compute.kernel_overhead_us"] = kernel_s * 1e6
    if eager and dtensor:
        values["compute.sharded_kernel_overhead_us"] = max(0.0, dtensor[0] - eager[0]) * 1e6
    gemm_rms = {}
    for dtype in GEMM_DTYPES:
        if cluster.accelerator.sm_count is not None and sum(p.dtype == dtype for p in bench.gemm) >= 4:
            fields, gemm_rms[dtype] = fit_gemm_gpu(bench, cluster, dtype)
            values |= fields
        elif cluster.accelerator.sm_count is None and sum(p.dtype == dtype for p in bench.gemm) >= 3:
            fraction, half, gemm_rms[dtype] = fit_gemm(bench, cluster, dtype, kernel_s)
            values[f"compute.gemm_peak_fraction.{dtype}"] = fraction
            if dtype == "bf16":
                values["compute.gemm_half_gflop"] = max(half, 1e-9)
    link_rms = 0.0
    if any(p.ranks <= cluster.node.gpus for p in bench.collectives):
        latency, bandwidth, link_rms = fit_link(bench, cluster)
        values["node.intra.latency_us"] = latency
        values["node.intra.bandwidth_GBps"] = bandwidth
    return BenchFit(values=values, gemm_rms=gemm_rms, link_rms=link_rms)
