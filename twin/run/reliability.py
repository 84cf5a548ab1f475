"""Reliability arithmetic for a whole run: failure rates of the job, checkpoint costs, Young/Daly intervals.

Pure functions; the SimPy model of the run (twin/run/sim.py) draws on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plan.cluster import Cluster
from plan.model_math import param_count
from plan.schema import Plan
from twin.step.memory import OPTIMIZER_BYTES

DCP_OVERHEAD_S = {"sync": 10.0, "async": 0.7, "in-memory": 0.7}
"""Fixed cost of one checkpoint beyond moving bytes (state-dict collection, planning, metadata, barrier). Async and
in-memory pay only the staging hand-off, measured at 0.59 s for a 405B model on 8,960 GPUs (ByteCheckpoint, Wan
et al. NSDI'25, Table 8) and 0.78 s for Llama 3 70B on 1,856 H200 (PyTorch blog, "6x faster async checkpointing",
2025). The sync figure is an assumption: planning plus a metadata write and barrier across the job, which no
source separates from the data write."""

HANG_CAUSES = frozenset({"software"})
"""Failures that hang collectives instead of killing a process: found only by the collective watchdog."""

NODE_LOSS = frozenset({"gpu", "hbm", "sram", "nic", "host", "thermal", "sdc"})
"""Causes that take the node out for repair; software faults and planned maintenance restart on the same nodes."""

CORRELATED = {"switch": "leaf"}
"""Causes that can take down every node under one switch of a fabric tier."""

LEAF_SWITCH_SHARE = 0.05
"""Share of switch/cable interruptions that are a whole leaf switch rather than one link (cable, transceiver,
port). Derived: Alibaba's HPN (Qian et al., SIGCOMM'24) reports NIC-ToR links and ToR switches failing at similar
monthly rates per component, and a leaf has ~32 links, so about one network fault in 20-30 is a switch."""


@dataclass(frozen=True)
class CheckpointCost:
    """What one checkpoint costs, in seconds, and how big it is."""

    size_bytes: float
    """Model and optimizer state of the whole job: bf16 weights plus fp32 master weights and moments."""
    stall_s: float
    """Training time lost while the checkpoint is taken."""
    write_s: float
    """Time until the checkpoint is durable on storage (after the stall, for async and in-memory)."""
    restore_s: float
    """Time to read it back on restart (from storage)."""
    restore_memory_s: float
    """Time to restore from a peer's memory (in-memory checkpoints)."""


def checkpoint_cost(plan: Plan, cluster: Cluster) -> CheckpointCost:
    """Checkpoint size and costs for the plan's checkpoint kind on the cluster's storage.

    Every rank writes its own shard at once (distributed checkpoint), so the job writes at the storage's aggregate
    bandwidth or what its nodes can drive, whichever is lower; a rank's shard is the state over the world size.
    """
    world = plan.layout.world_size
    nodes = -(-world // cluster.node.gpus)
    size = param_count(plan.model).total * (2 + OPTIMIZER_BYTES[plan.training.optimizer])
    write_bw = min(cluster.storage.write_GBps, nodes * cluster.storage.per_node_write_GBps) * 1e9
    read_bw = cluster.storage.read_GBps * 1e9
    shard = size / world
    to_host = shard / (cluster.node.d2h_bandwidth_GBps * 1e9)
    kind = plan.reliability.checkpoint
    write = size / write_bw
    overhead = DCP_OVERHEAD_S[kind]
    if kind == "sync":
        stall, background = overhead + write, 0.0
    elif kind == "async":
        stall, background = overhead + to_host, write
    else:  # in-memory: a copy to host memory and one to a peer node over the fabric, both off the GPU's path
        peer = shard / (cluster.fabric.tiers[0].bandwidth_GBps * 1e9) if cluster.fabric.tiers else 0.0
        stall, background = overhead + to_host, peer
    return CheckpointCost(size, stall, background, size / read_bw, to_host + overhead)


def job_failure_rates(plan: Plan, cluster: Cluster) -> dict[str, float]:
    """Failures per second of the whole job, by cause: the cluster's per-node-day rates times its what-if
    `rate_scale` (the plan's own per-component rates winning), times the job's nodes."""
    nodes = -(-plan.layout.world_size // cluster.node.gpus)
    scale = cluster.failures.rate_scale
    rates = {cause: rate * scale for cause, rate in cluster.failures.rates_per_node_day.items()}
    rates.update(plan.reliability.failure_rates or {})
    return {cause: rate * nodes / 86400.0 for cause, rate in rates.items() if rate > 0}


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young (1974), "A first order approximation to the optimum checkpoint interval": sqrt(2·δ·M)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps", eq. (37):
    sqrt(2δM)·[1 + (1/3)·sqrt(δ/2M) + (1/9)·(δ/2M)] − δ for δ < 2M, else M."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s
