"""What a prediction will cost to simulate, checked against `Limits` before it starts.

The step model simulates one replica's pipeline action by action (shared/DESIGN.md: events grow with
pp × microbatches, not with GPUs) and walks the model layer by layer, so its cost is its pipeline actions plus its
layers. Both are known from the plan alone, so a plan past either limit stops at once with the fix, instead of
running for hours. A whole run predicts the step up to four times over (twin/run/summary.py): the step itself, the
step with a node outside the job's rail group, and for an elastic run the step at twice the batch.
"""

from __future__ import annotations

from dataclasses import replace

from plan import loader
from plan.cluster import Cluster
from plan.limits import Limits, over
from plan.schema import Plan
from twin.step import schedules
from twin.step.host import shares_cores
from twin.step.steady import sample_counts


def step_actions(plan: Plan, cluster: Cluster | None = None) -> int:
    """Pipeline actions of one simulated step: pp · virtual_stages stages × microbatches × passes (F and B, and W
    where the schedule splits the weight gradients off); a long step of GPipe or 1F1B (interleaved or not)
    simulates three short ones instead (twin/step/steady.py; longer ones on a CPU host), which count. A
    zero-bubble step counts whole: it stops early only once its events repeat, which no plan-level figure
    foretells."""
    lay = plan.layout
    passes = 3 if schedules.splits_weight_grad(lay.schedule) else 2
    host = shares_cores(cluster or loader.plan_cluster(plan))
    counts = sample_counts(lay.schedule, lay.pp, plan.schedule_microbatches, host=host)
    return lay.num_stages * (sum(counts) if counts else plan.schedule_microbatches) * passes


def run_step_actions(plan: Plan, cluster: Cluster) -> int:
    """Pipeline actions a whole-run prediction simulates: the step, the step with a relocated node where the
    cluster has nodes outside the job, and the step at twice the batch for an elastic run."""
    actions = step_actions(plan, cluster)
    job_nodes = -(-plan.layout.world_size // cluster.node.gpus) + plan.reliability.hot_spares
    relocated = actions if job_nodes < cluster.nodes else 0
    doubled = 2 * actions if plan.reliability.elastic else 0
    return actions + relocated + doubled


def check_step(plan: Plan, limits: Limits, actions: int | None = None) -> None:
    """PlanError if simulating the plan's step (`actions` pipeline actions, default one step's) or walking its
    layers is past `limits`."""
    if plan.model.layers > limits.layers:
        raise over(
            f"{plan.name}: model.layers",
            plan.model.layers,
            "layers",
            limits,
            "lower model.layers (the largest published models have about 130)",
        )
    actions = step_actions(plan) if actions is None else actions
    if actions > limits.step_actions:
        lay = plan.layout
        raise over(
            f"{plan.name}: simulating it takes pipeline actions (pp·virtual_stages = {lay.num_stages} stages × "
            f"{plan.schedule_microbatches:,} microbatches × passes)",
            actions,
            "step_actions",
            limits,
            "lower training.global_batch or raise layout.microbatch_size or layout.dp (fewer microbatches per replica)",
        )


def run_limits(plan: Plan, cluster: Cluster, limits: Limits) -> Limits:
    """`limits` for the whole run of a plan whose step already passed them (a search's candidate): the run predicts
    that step up to four times over (run_step_actions), so its step-action cap takes that multiple instead of
    refusing a layout the search kept."""
    return replace(limits, step_actions=max(limits.step_actions, run_step_actions(plan, cluster)))
