"""What `twin calibrate` records in a profile it writes: the base profile, the runs, and each fitted field."""

from __future__ import annotations

from pydantic import NonNegativeFloat

from plan.section import UserSection


class FittedParameter(UserSection):
    """One cluster field that `twin calibrate` fitted to measured runs."""

    path: str
    """Dotted field path in the cluster file, e.g. 'compute.kernel_overhead_us'."""
    before: float
    """The value in the base profile (the field's unit)."""
    value: float
    """The fitted value (the field's unit)."""
    std: NonNegativeFloat
    """One standard deviation of the fitted value, from the fit's Jacobian (the field's unit)."""


class Calibration(UserSection):
    """Where a calibrated profile came from: the base profile, the runs it was fitted to, and how well."""

    base: str
    """Name of the catalogue cluster this profile refines."""
    created_unix: float
    """When the fit ran (seconds since the epoch)."""
    runs: tuple[str, ...]
    """Run directories (and microbenchmark files) the fit read."""
    parameters: tuple[FittedParameter, ...]
    """The fitted fields."""
    residual_rms: NonNegativeFloat
    """Root-mean-square relative error of the fitted phases (fraction of each run's step time)."""
    step_cv: NonNegativeFloat = 0.0
    """Run-to-run spread of measured step times: relative standard deviation over repeats and steps."""
