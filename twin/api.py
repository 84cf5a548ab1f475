"""The public Python API (first cut; grown in the same issue): predict a step and simulate a run of a plan."""

from __future__ import annotations

from plan.schema import Plan
from twin.predict import StepPrediction
from twin.predict import predict as _predict
from twin.runs import RunPrediction
from twin.runs import run as _run


def predict(plan: Plan) -> StepPrediction:
    """One optimizer step of `plan`, predicted."""
    return _predict(plan)


def simulate_run(plan: Plan, seed: int = 0) -> RunPrediction:
    """The whole run of `plan`, simulated once with `seed`."""
    return _run(plan, seed)
