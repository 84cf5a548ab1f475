"""DeepEP's normal kernels, the node-forwarding dispatch and combine the twin prices for DeepEP and HybridEP
(`Stack.ep_dispatch` node-forwarding), against their published bandwidths: kernel-level rows.

DeepEP's internode test (tests/legacy/test_internode.py: 4,096 tokens of 7,168, 256 experts, top-8 within the top
min(nodes, 4) of one expert group a node, 24 SMs) reports a run's time as two bandwidths: "RDMA", the (token, node)
pairs it sends, its own node included, and "NVL", the (token, rank) pairs a rank receives, each in bytes over the
kernel's time; a token is 7,168 bf16 values, or dispatched in FP8, 7,168 bytes and a 4-byte scale per 128 (the
test's fp8_factor, (1 + 4/128) / 2 of bf16's). The twin prices the same dispatch (twin/step/collectives.
node_forwarded_time at the accelerator's `compute.ep_dispatch`) and reads it back the same two ways.

- docs/legacy.md, H800 with CX7 400 Gb/s (the `deepseek-h800-2048` cluster): its EP16 row set the NVLink stage's
  rate and its EP32 and EP64 rows the RDMA stage's share of a NIC (topologies/accelerators/h100-sxm5-80gb.yaml), so
  they are the fit.
- DeepEP issue #493, H200 (H100's NVLink) with CX7 400 Gb/s on two nodes (the `dgx-h100-superpod` cluster): a user's
  tuning run, used by no fit: two timings (dispatch, combine), each read both ways.

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from plan.loader import load_cluster
from twin.step.collectives import node_forwarded_time, routed_reach
from twin.step.fabric import Fabric

README = "deepseek-ai/DeepEP docs/legacy.md, normal kernels (H800, CX7 400 Gb/s, 24 SMs)"
ISSUE_493 = "deepseek-ai/DeepEP issue #493 (H200, CX7 400 Gb/s, two nodes, 24 SMs, bf16 dispatch)"
TOKENS, HIDDEN, TOP_K, EXPERTS = 4096, 7168, 8, 256
"""test_internode.py's defaults."""


@dataclass(frozen=True)
class DeepEpRow:
    cluster: str
    ep: int
    op: str
    """dispatch or combine."""
    metric: str
    """RDMA: (token, node) pairs sent; NVL: (token, rank) pairs received."""
    gbps: float
    """Published bandwidth (1e9 bytes/s)."""
    source: str
    kind: str
    fp8: bool = False
    """Dispatched in FP8 (the README's dispatch rows: "FP8 dispatching and BF16 combining")."""


DEEPEP_ROWS = (
    DeepEpRow("deepseek-h800-2048", 16, "dispatch", "RDMA", 43, README, "fit", fp8=True),
    DeepEpRow("deepseek-h800-2048", 16, "combine", "RDMA", 43, README, "fit"),
    DeepEpRow("deepseek-h800-2048", 32, "dispatch", "RDMA", 58, README, "fit", fp8=True),
    DeepEpRow("deepseek-h800-2048", 32, "combine", "RDMA", 57, README, "fit"),
    DeepEpRow("deepseek-h800-2048", 64, "dispatch", "RDMA", 51, README, "fit", fp8=True),
    DeepEpRow("deepseek-h800-2048", 64, "combine", "RDMA", 50, README, "fit"),
    DeepEpRow("dgx-h100-superpod", 16, "dispatch", "RDMA", 40.89, ISSUE_493, "validation"),
    DeepEpRow("dgx-h100-superpod", 16, "dispatch", "NVL", 133.78, ISSUE_493, "validation"),
    DeepEpRow("dgx-h100-superpod", 16, "combine", "RDMA", 44.37, ISSUE_493, "validation"),
    DeepEpRow("dgx-h100-superpod", 16, "combine", "NVL", 145.16, ISSUE_493, "validation"),
)


def deepep_gbps(row: DeepEpRow) -> float:
    """The twin's figure for the row: its time for the test's dispatch over `ep` ranks (8 a node), read back as the
    row's bandwidth."""
    cluster = load_cluster(row.cluster)
    kernel = cluster.compute.ep_dispatch
    if kernel is None:
        raise ValueError(f"{row.cluster}: its accelerator has no measured dispatcher rates (compute.ep_dispatch)")
    span = Fabric(cluster).span(list(range(row.ep)))
    groups = (span.nodes, min(span.nodes, 4))
    token_bytes = TOKENS * HIDDEN * (1 + 4 / 128 if row.fp8 else 2)
    seconds = node_forwarded_time(TOP_K * token_bytes, span, TOP_K, kernel, kernel.sms, EXPERTS, groups)
    ranks, nodes = routed_reach(span.size, span.nodes, TOP_K, EXPERTS, groups)
    pairs = nodes if row.metric == "RDMA" else ranks
    return pairs * token_bytes / seconds / 1e9
