"""Fit a cluster profile's parameters to measured runs, and predict with the fitted profile (`twin calibrate`).

The twin predicts each measured plan on a candidate profile; `scipy.optimize.least_squares` moves the profile's
calibratable fields (the knobs) to minimise the relative error of every pipeline rank's phases — forward,
backward, exposed TP/DP communication, pipeline waiting, optimizer — and of the step itself, each as a fraction of
the measured step time. Scale knobs are fitted in log space (a latency of 20 or 200 us is the same kind of
guess). A knob whose residuals barely move (no run exercises it) is left at its base value and reported as not
identifiable, rather than wandering to a bound. Parameter uncertainty comes from the Jacobian at the solution
(covariance ≈ s²·(JᵀJ)⁻¹), and a prediction's interval adds, to that, the fit's own step-time error.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from plan.cluster import Cluster
from plan.fitted import Calibration, FittedParameter
from plan.schema import Plan
from twin.calibrate.measured import Measurement
from twin.step.predict import StepPrediction, predict

STEP_WEIGHT = 2.0  # the step time is what users plan with: it counts twice as much as any one phase
Z95 = 1.959964  # two-sided 95% normal quantile
IDENTIFIABLE = 1e-3  # a knob moving no residual by 0.1% of a step per e-fold change is not identified

# Phases compared, as sums of the executor's record phases. A rank blocked in a collective or a receive waits for
# the transfer, for the pipeline, and for peers that the host's scheduler has not run yet (rank-to-rank skew: the
# twin's stragglers); the records cannot tell these apart (the executor charges a blocked interval to the axis
# whose group carried it), so they are compared as one: synchronisation.
PHASE_GROUPS: dict[str, tuple[str, ...]] = {
    "forward": ("forward",),
    "backward": ("backward",),
    "sync": ("comm_tp", "comm_cp", "comm_ep", "comm_dp", "comm_pp", "bubble"),
    "optimizer": ("optimizer",),
}
SKEW_GROUP = "sync"  # where the twin's straggler time goes when compared with records


@dataclass(frozen=True)
class Knob:
    """One calibratable cluster field."""

    path: str
    """Dotted path in the cluster file."""
    lower: float
    upper: float
    log: bool = True
    """Fit the logarithm (scale parameters) rather than the value (fractions)."""
    exercised: Callable[[Plan], bool] = field(default=lambda plan: True, compare=False)
    """Whether a run of this plan can say anything about the knob."""
    start: float | None = None
    """Where the fit starts when the base value is zero (a log knob cannot start at 0)."""

    @property
    def bounds(self) -> tuple[float, float]:
        """Lower and upper bound in fit space."""
        return (math.log(self.lower), math.log(self.upper)) if self.log else (self.lower, self.upper)

    def to_fit(self, value: float) -> float:
        """A field value in fit space, clamped to the bounds (a zero starts at `start`)."""
        if value <= 0 and self.start is not None:
            value = self.start
        value = min(max(value, self.lower), self.upper)
        return math.log(value) if self.log else value

    def from_fit(self, x: float) -> float:
        return float(math.exp(x) if self.log else x)

    def step(self, x: float, size: float) -> float:
        """A finite-difference step of `size` from `x` in fit space, turned back where it would leave the bounds."""
        return size if x + size <= self.bounds[1] else -size


KNOBS: tuple[Knob, ...] = (
    Knob("compute.kernel_overhead_us", 0.05, 1e5),
    Knob("compute.layer_overhead_us", 0.05, 1e6, start=100.0),
    Knob("compute.sharded_kernel_overhead_us", 0.05, 1e5, exercised=lambda p: p.layout.tp > 1, start=10.0),
    Knob("node.intra.latency_us", 0.05, 1e6, exercised=lambda p: p.layout.world_size > 1),
    # node.effective_cores is not fitted: step times trade it against per-layer host cost. What separates them is
    # the CPU a layout burns, and on this VM dp2 (a rank per core) and dp8 (four per core) spend the same
    # forward+backward CPU-seconds per sequence: 2 ranks x 0.065 s at a full core, 8 x 0.066 s at a quarter.
    # A host whose SMT or hypervisor gives more than its cores says so in its profile.
    Knob("node.wakeup_latency_us", 1.0, 1e5, start=2000.0, exercised=lambda p: p.layout.world_size > 1),
    # node.intra.bandwidth_GBps comes from the collective sweep (`twin bench`): the tiny calibration models move
    # kilobytes, which say little about bandwidth and let it absorb latency-bound costs.
    # ZeRO 0's reduction overlaps by construction or not at all (the executor: not at all; the base profile says
    # which); FSDP2's bucketed reduce-scatter under ZeRO 1-3 overlaps by an amount only measurement tells.
    Knob(
        "compute.dp_overlap_fraction",
        0.0,
        1.0,
        log=False,
        exercised=lambda p: p.layout.zero >= 1 and p.layout.dp * p.layout.cp > 1,
    ),
    # the GEMM curve's half-efficiency size (hosts without an SM count): a microbenchmark of square matmuls says
    # little about a training step's skinny ones, and one fraction cannot serve models of several widths
    Knob("compute.gemm_half_gflop", 1e-5, 10.0, start=3e-4),
    Knob("compute.elementwise_bandwidth_fraction", 0.005, 1.0, start=0.5),
    Knob("compute.gemm_peak_fraction.bf16", 0.01, 1.0, exercised=lambda p: p.training.dtype == "bf16"),
    Knob("compute.gemm_peak_fraction.fp32", 0.01, 1.0, exercised=lambda p: p.training.dtype == "fp32"),
    # stragglers.jitter_cv is measured (the spread of compute time among ranks doing the same work), not fitted
)


def get_field(cluster: Cluster, path: str) -> float:
    node: Any = cluster.model_dump()
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return float(node or 0.0)  # an unset optional field reads as 0: the knob's `start` applies


def with_fields(cluster: Cluster, values: dict[str, float]) -> Cluster:
    """A copy of `cluster` with the given dotted fields set (validated like a file)."""
    data = cluster.model_dump()
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(leaf) if isinstance(node, list) else leaf] = value
    return Cluster.model_validate(data)


def measured_vector(m: Measurement) -> list[float]:
    """The measured step and per-rank phase groups, each as a fraction of the measured step."""
    out = [STEP_WEIGHT]
    for phases in m.stage_phases:
        out += [sum(phases[p] for p in group) / m.step_s for group in PHASE_GROUPS.values()]
    return out


def predicted_vector(pred: StepPrediction, m: Measurement) -> list[float]:
    out = [STEP_WEIGHT * pred.step_time_s / m.step_s]
    for phases in pred.stage_phases_s:
        for name, group in PHASE_GROUPS.items():
            seconds = sum(phases.get(p, 0.0) for p in group)
            seconds += pred.breakdown_s["straggler"] if name == SKEW_GROUP else 0.0
            out.append(seconds / m.step_s)
    return out


@dataclass(frozen=True)
class Fit:
    """A fitted profile and how it was reached."""

    cluster: Cluster
    base: Cluster
    knobs: tuple[Knob, ...]
    """The knobs that were fitted."""
    values: dict[str, float]
    std: dict[str, float]
    """One standard deviation of each fitted value (its unit)."""
    fixed: tuple[str, ...]
    """Knobs left at their base value: no run exercises them, or they move no residual."""
    covariance: np.ndarray
    """Covariance of the fitted parameters in fit space (log for log knobs)."""
    step_rms: float
    """Root-mean-square relative error of the fitted plans' step times."""
    residual_rms: float
    """Root-mean-square of every residual (fractions of step time)."""


class Calibrator:
    """Least-squares fit of a base profile's knobs to measurements."""

    def __init__(self, base: Cluster, knobs: Sequence[Knob] = KNOBS) -> None:
        self.base = base
        self.knobs = tuple(knobs)

    @staticmethod
    def _decode(knobs: Sequence[Knob], x: np.ndarray) -> dict[str, float]:
        return {k.path: k.from_fit(v) for k, v in zip(knobs, x, strict=True)}

    @staticmethod
    def _bounds(knobs: Sequence[Knob]) -> tuple[list[float], list[float]]:
        return [k.bounds[0] for k in knobs], [k.bounds[1] for k in knobs]

    def residuals(self, knobs: Sequence[Knob], x: np.ndarray, data: Sequence[Measurement]) -> np.ndarray:
        cluster = with_fields(self.base, self._decode(knobs, x))
        out: list[float] = []
        for m in data:
            pred = predict(m.plan, cluster)
            out += [p - q for p, q in zip(predicted_vector(pred, m), measured_vector(m), strict=True)]
        return np.asarray(out)

    def fit(self, data: Sequence[Measurement]) -> Fit:
        knobs = [k for k in self.knobs if any(k.exercised(m.plan) for m in data)]
        x0 = np.array([k.to_fit(get_field(self.base, k.path)) for k in knobs])
        lo, hi = self._bounds(knobs)
        x0 = np.clip(x0, np.array(lo) + 1e-9, np.array(hi) - 1e-9)
        jac0 = self._jacobian(knobs, x0, data)
        live = [i for i in range(len(knobs)) if np.abs(jac0[:, i]).max() > IDENTIFIABLE]
        fixed = tuple(k.path for i, k in enumerate(knobs) if i not in live)
        knobs = [knobs[i] for i in live]
        x0 = x0[live]
        lo, hi = self._bounds(knobs)
        sol = least_squares(
            lambda x: self.residuals(knobs, x, data), x0, bounds=(lo, hi), x_scale="jac", diff_step=1e-4
        )
        dof = max(1, sol.fun.size - len(knobs))
        s2 = float(sol.fun @ sol.fun) / dof
        cov = np.linalg.pinv(sol.jac.T @ sol.jac) * s2
        values = self._decode(knobs, sol.x)
        std = {
            k.path: float(values[k.path] * math.sqrt(max(0.0, cov[i, i])) if k.log else math.sqrt(max(0.0, cov[i, i])))
            for i, k in enumerate(knobs)
        }
        cluster = with_fields(self.base, values)
        step_res = [self._step_error(cluster, m) for m in data]
        return Fit(
            cluster=cluster,
            base=self.base,
            knobs=tuple(knobs),
            values=values,
            std=std,
            fixed=fixed,
            covariance=cov,
            step_rms=float(np.sqrt(np.mean(np.square(step_res)))),
            residual_rms=float(np.sqrt(np.mean(np.square(sol.fun)))),
        )

    def _jacobian(self, knobs: Sequence[Knob], x: np.ndarray, data: Sequence[Measurement]) -> np.ndarray:
        """Coarse forward differences, one e-fold (log knobs) or 0.3 (fractions): does the knob matter at all?"""
        base = self.residuals(knobs, x, data)
        cols = []
        for i, knob in enumerate(knobs):
            step = knob.step(x[i], 1.0 if knob.log else 0.3)
            moved = x.copy()
            moved[i] += step
            cols.append((self.residuals(knobs, moved, data) - base) / step)
        return np.stack(cols, axis=1) if cols else np.zeros((base.size, 0))

    @staticmethod
    def _step_error(cluster: Cluster, m: Measurement) -> float:
        return predict(m.plan, cluster).step_time_s / m.step_s - 1


@dataclass(frozen=True)
class Interval:
    """A predicted step time and its 95% interval (seconds)."""

    step_s: float
    low_s: float
    high_s: float


def predict_with_interval(plan: Plan, fit: Fit) -> Interval:
    """The fitted profile's step time for `plan`, with a 95% interval from the parameters' covariance (delta
    method) and the fit's own step-time error."""
    step = predict(plan, fit.cluster).step_time_s
    grad = []
    for knob in fit.knobs:
        x = knob.to_fit(fit.values[knob.path])
        dx = knob.step(x, 0.05)
        other = predict(plan, with_fields(fit.cluster, {knob.path: knob.from_fit(x + dx)})).step_time_s
        grad.append((other - step) / dx)
    g = np.asarray(grad)
    var = float(g @ fit.covariance @ g) if g.size else 0.0
    sd = math.sqrt(max(0.0, var) + (fit.step_rms * step) ** 2)
    return Interval(step, max(0.0, step - Z95 * sd), step + Z95 * sd)


def calibrated_profile(fit: Fit, name: str, sources: Sequence[str], step_cv: float) -> Cluster:
    """The fitted cluster as a profile a plan can name, with its calibration record."""
    params = tuple(
        FittedParameter(path=k.path, before=get_field(fit.base, k.path), value=fit.values[k.path], std=fit.std[k.path])
        for k in fit.knobs
    )
    record = Calibration(
        base=fit.base.name,
        created_unix=time.time(),
        runs=tuple(sources),
        parameters=params,
        residual_rms=fit.residual_rms,
        step_cv=step_cv,
    )
    description = f"{fit.base.description} Calibrated by `twin calibrate` on {len(sources)} run(s)."
    return fit.cluster.model_copy(update={"name": name, "description": description, "calibration": record})
