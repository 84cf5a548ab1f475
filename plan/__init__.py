"""The shared plan format: schema, presets, rank grid and run records. Imports nothing of twin/ or executor/."""

from plan.cluster import Cluster
from plan.limits import Limits
from plan.loader import PlanError, load, load_cluster, plan_cluster
from plan.model_math import model_flops_per_token, param_count
from plan.rank_grid import RankGrid
from plan.reliability import Reliability
from plan.schema import Layout, ModelSpec, Plan, Training

__all__ = [
    "Cluster",
    "Layout",
    "Limits",
    "ModelSpec",
    "Plan",
    "PlanError",
    "RankGrid",
    "Reliability",
    "Training",
    "load",
    "load_cluster",
    "model_flops_per_token",
    "param_count",
    "plan_cluster",
]
