"""Collective costs: pure functions of (operation, bytes, group span) -> seconds.

Conventions are nccl-tests' (doc/PERFORMANCE.md): `size` is the per-rank buffer the test names (the full vector for
all-reduce, the gathered output for all-gather, the input for reduce-scatter, the send buffer for all-to-all), and
bus bandwidth is algbw times the operation's factor — 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
reduce-scatter and all-to-all, 1 for broadcast and point-to-point. So a measured busbw plugs into a tier's
bandwidth x efficiency directly, and time = latency term + factor · size / busbw.

Algorithms, after NCCL's (Jeaugey, NCCL 2.4 double binary trees, 2019; NCCL 2.17 NVLS; NVIDIA SHARP docs):
ring (2(n-1) latency steps for all-reduce), double binary tree (2·log2 n steps, all-reduce and broadcast),
hierarchical (reduce-scatter inside the node, all-reduce of 1/m of the data across nodes, all-gather inside),
NVLS (the NVSwitch reduces: every GPU sends and receives the vector once) and SHARP (the IB switches reduce the
cross-node part). Like NCCL's tuner, `collective_time` evaluates the applicable ones and takes the fastest
unless one is forced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from plan.bench import bus_factor
from twin.step.fabric import GroupSpan

if TYPE_CHECKING:
    from plan.accelerator import DispatchKernel

Op = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p"]
Algorithm = Literal["ring", "tree", "hierarchical", "nvls", "sharp", "direct"]


TREE_BW_FACTOR = 0.92
"""NCCL's tuner rates a tree all-reduce at 92% of the bus bandwidth a ring gets on the same channels
(NVIDIA/nccl src/graph/tuning.cc, `busBw * .92` for NCCL_ALGO_TREE), which is why rings win at large sizes."""


def busbw_factor(op: Op, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth for `n` ranks (plan.bench.BUS_FACTORS, the
    table the executor's benchmark uses too)."""
    return bus_factor(op, n)


@dataclass(frozen=True)
class InNetwork:
    """In-network reduction a fabric offers, in bus-bandwidth terms (None: not offered)."""

    nvls_link_Bps: float | None = None
    """Link bandwidth per GPU an NVLS collective achieves inside a node (link x nvls_efficiency, bytes/s)."""
    sharp: bool = False
    """InfiniBand SHARP reduces the cross-node part of an all-reduce in the switches."""


@dataclass(frozen=True)
class CollectiveCost:
    """The time of one collective, the algorithm that gives it, and the bus bandwidth it achieves."""

    seconds: float
    algorithm: str
    busbw_Bps: float


def ring_time(op: Op, size: float, span: GroupSpan) -> float:
    """Ring: factor · size / busbw plus one latency per step (2(n-1) for all-reduce, n-1 otherwise)."""
    n = span.size
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else (1 if op == "p2p" else n - 1)
    return steps * span.latency_s + busbw_factor(op, n) * size / span.busbw_Bps


def tree_time(op: Op, size: float, span: GroupSpan) -> float:
    """Double binary tree across nodes (all-reduce, broadcast): log-depth latency, TREE_BW_FACTOR of the ring's bus
    bandwidth (Jeaugey 2019; NCCL's tuner)."""
    n = span.size
    if n <= 1:
        return 0.0
    depth = math.ceil(math.log2(n))
    steps = 2 * depth if op == "all_reduce" else depth
    return steps * span.latency_s + busbw_factor(op, n) * size / (TREE_BW_FACTOR * span.busbw_Bps)


def _sub_span(span: GroupSpan, inside: bool) -> GroupSpan:
    """The intra-node part (the m members of one node) or the inter-node part (one member per node)."""
    if inside:
        return replace(
            span,
            size=span.per_node,
            nodes=1,
            level=0,
            tier="intra",
            busbw_Bps=span.intra_busbw_Bps,
            inter_busbw_Bps=float("inf"),
            latency_s=span.intra_latency_s,
            hops=1,
        )
    per_nic = span.inter_busbw_Bps / span.per_node
    return replace(span, size=span.nodes, per_node=1, inter_busbw_Bps=per_nic, busbw_Bps=per_nic)


def hierarchical_time(op: Op, size: float, span: GroupSpan) -> float:
    """Reduce-scatter inside the node, all-reduce 1/m of the vector across nodes, all-gather inside the node."""
    inside, across = _sub_span(span, True), _sub_span(span, False)
    inner = ring_time("reduce_scatter", size, inside) + ring_time("all_gather", size, inside)
    outer = size / span.per_node
    return inner + min(ring_time("all_reduce", outer, across), tree_time("all_reduce", outer, across))


def nvls_time(op: Op, size: float, span: GroupSpan, link_Bps: float) -> float:
    """NVLink SHARP inside one node: the switch reduces (multimem.ld_reduce) and multicasts (multimem.st), so each
    GPU moves its vector once plus its 1/n shard each way — S·(1+1/n) against a ring's 2(n-1)/n·S — at the link
    bandwidth NVLS achieves. All-gather and reduce-scatter move (n-1)/n·S as a ring does, at that rate."""
    n = span.size
    volume = size * (1 + 1 / n) if op == "all_reduce" else size * (n - 1) / n
    return 2 * span.latency_s + volume / link_Bps


def sharp_time(op: Op, size: float, span: GroupSpan) -> float:
    """IB SHARP: intra-node reduce-scatter, the switches reduce 1/m of the vector (each NIC sends and receives it
    once, so the cross-node volume is half a ring's), intra-node all-gather."""
    inside, across = _sub_span(span, True), _sub_span(span, False)
    inner = ring_time("reduce_scatter", size, inside) + ring_time("all_gather", size, inside)
    cross = 2 * span.level * span.latency_s + (size / span.per_node) / across.busbw_Bps
    return inner + cross


def all_to_all_time(size: float, span: GroupSpan, cross_share: float | None = None) -> float:
    """Pairwise exchange: (n-m)/n of the buffer leaves the node over the NICs, (m-1)/n stays on NVLink; both run
    at once, and each of the n-1 peers costs a message latency. `cross_share`: the share of the buffer that
    crosses nodes where a dispatcher forwards (node_forwarded_share); every copy that leaves the GPU still moves
    once over NVLink, on the sending node or, forwarded, on the receiving one."""
    n, m = span.size, span.per_node
    if n <= 1:
        return 0.0
    if cross_share is None:
        inside = (m - 1) / n * size / span.intra_busbw_Bps if m > 1 else 0.0
        outside = (n - m) / n * size / (span.inter_busbw_Bps / m) if n > m else 0.0
    else:
        inside = (n - 1) / n * size / span.intra_busbw_Bps if m > 1 else 0.0
        outside = cross_share * size / (span.inter_busbw_Bps / m) if n > m else 0.0
    return (n - 1) * span.latency_s + max(inside, outside)


Groups = tuple[int, int] | None
"""Group-limited routing, (expert groups, groups a token draws from), or None (ModelSpec.expert_groups)."""


def node_forwarded_share(top_k: int, nodes: int, experts: int | None = None, groups: Groups = None) -> float:
    """Share of an MoE dispatch buffer (top_k copies of each token) that crosses nodes when a token goes once to
    each remote node holding any of its experts and is fanned out over NVLink there (DeepEP's normal kernels,
    Megatron-Core's HybridEP; DeepSeek-V3 §3.2.2): the remote nodes a token reaches (routed_reach, its own node
    reached with the same chance as any other) against top_k·(nodes - 1)/nodes copies sent one by one."""
    if nodes <= 1 or top_k <= 0:
        return 0.0
    return routed_reach(nodes, nodes, top_k, experts, groups)[1] * (1 - 1 / nodes) / top_k


def _distinct(units: float, experts: int | None, picks: int) -> float:
    """Expected units of `units` holding any of `picks` distinct experts drawn evenly from `experts` spread evenly
    over them: units·(1 - C(E - E/units, k) / C(E, k)), or with independent picks units·(1 - (1 - 1/units)^k) where
    the expert count is not given or does not split evenly."""
    if units <= 1:
        return 1.0
    per = experts / units if experts else 0.0
    if experts and per.is_integer() and picks <= experts:
        return units * (1 - math.comb(experts - int(per), picks) / math.comb(experts, picks))
    return units * (1 - (1 - 1 / units) ** picks)


def routed_reach(
    ranks: int, nodes: int, top_k: int, experts: int | None = None, groups: Groups = None
) -> tuple[float, float]:
    """Expected (ranks, nodes) holding any of one token's top_k experts, its own among them, with the experts spread
    evenly and in order over `ranks` on `nodes` and picked evenly (_distinct). Group-limited routing (G groups in
    order, a token's experts from its best g < G) keeps the picks inside the g groups, and as a group is chosen for
    its best scores each chosen group holds at least one: 1 + Binomial(top_k - g, 1/g) of them. Where a group spans
    whole units that is g groups' worth over units/G each; else the units holding any chosen group,
    units·(1 - C(G - G/units, g) / C(G, g)). A seeded simulation of Megatron-Core's group_limited_topk agrees within
    1.5% (tests/test_grouped_gemm.py)."""

    def reach(units: int) -> float:
        if groups is None or groups[1] >= groups[0]:
            return _distinct(units, experts, top_k)
        total, chosen = groups
        if total > units:
            per = total // units
            return units * (1 - math.comb(total - per, chosen) / math.comb(total, chosen))
        span, held = units / total, (experts // total if experts else None)
        if top_k <= chosen:
            return top_k * _distinct(span, held, 1)
        rest = top_k - chosen
        return chosen * sum(
            math.comb(rest, j) * (1 / chosen) ** j * (1 - 1 / chosen) ** (rest - j) * _distinct(span, held, 1 + j)
            for j in range(rest + 1)
        )

    return reach(ranks), reach(nodes)


def node_forwarded_time(
    size: float, span: GroupSpan, top_k: int, kernel: DispatchKernel, sms: int, experts: int | None = None,
    groups: Groups = None,
) -> float:  # fmt: skip
    """A node-forwarding dispatch or combine of `size` bytes (top_k copies of each token) at its kernels' measured
    rates (plan.accelerator.DispatchKernel): each token crosses once to each remote node holding any of its experts
    (routed_reach), at the RDMA stage's share of the NIC, while the NVLink stage hands one copy to each rank holding
    any, its own included, at the kernel's NVLink rate scaled by the `sms` it runs on over those it was measured on
    (SM-driven copies), at most NCCL's NVLink bandwidth; the two stages pipeline, so the slower sets the time, and
    each pays a message latency per peer it talks to: the other nodes' ranks on its rail, the node's other ranks.
    A group inside one node runs the intranode kernels, at their own measured rate where the accelerator has one
    (DispatchKernel.intranode_GBps)."""
    n, m = span.size, span.per_node
    token = size / top_k
    ranks, nodes = routed_reach(n, span.nodes, top_k, experts, groups)
    wire = nodes * (1 - 1 / span.nodes) * token / (kernel.nic_fraction * span.inter_busbw_Bps / m)
    rate = kernel.nvlink_GBps
    if span.nodes == 1 and kernel.intranode_GBps is not None:  # the intranode kernels: no RDMA stage
        rate = kernel.intranode_GBps
    forward = ranks * token / min(rate * 1e9 * sms / kernel.sms, span.intra_busbw_Bps)
    latency = (span.nodes - 1) * span.latency_s + (m - 1) * span.intra_latency_s
    return latency + max(wire, forward)


def p2p_time(size: float, span: GroupSpan) -> float:
    """One point-to-point message: latency plus size over the slowest tier's per-GPU bandwidth."""
    if span.size <= 1:
        return 0.0
    bw = span.intra_busbw_Bps if span.level == 0 else span.inter_busbw_Bps / span.per_node
    return span.latency_s + size / bw


def candidates(op: Op, span: GroupSpan, net: InNetwork) -> dict[str, Callable[[float], float]]:
    """The algorithms NCCL could run for this operation on this span, as size -> seconds."""
    if op == "p2p":
        return {"direct": lambda s: p2p_time(s, span)}
    if op == "all_to_all":
        return {"direct": lambda s: all_to_all_time(s, span)}
    algos: dict[str, Callable[[float], float]] = {"ring": lambda s: ring_time(op, s, span)}
    if op in ("all_reduce", "broadcast") and span.level > 0:  # inside a node NCCL's tree is a chain
        algos["tree"] = lambda s: tree_time(op, s, span)
    if op == "all_reduce" and span.level > 0 and span.per_node > 1:
        algos["hierarchical"] = lambda s: hierarchical_time(op, s, span)
        if net.sharp:
            algos["sharp"] = lambda s: sharp_time(op, s, span)
    if op in ("all_reduce", "all_gather", "reduce_scatter") and span.level == 0 and net.nvls_link_Bps:
        bw = net.nvls_link_Bps
        algos["nvls"] = lambda s: nvls_time(op, s, span, bw)
    return algos


def collective_time(
    op: Op, size: float, span: GroupSpan, net: InNetwork = InNetwork(), algorithm: str | None = None
) -> CollectiveCost:
    """Time of one collective of `size` bytes over `span`: the fastest applicable algorithm, or the forced one."""
    if span.size <= 1 or size <= 0:
        return CollectiveCost(0.0, "none", float("inf"))
    algos = candidates(op, span, net)
    if algorithm is not None:
        if algorithm not in algos:
            raise ValueError(f"algorithm {algorithm!r} cannot run {op} here; choose from {', '.join(algos)}")
        algos = {algorithm: algos[algorithm]}
    name, seconds = min(((a, f(size)) for a, f in algos.items()), key=lambda kv: kv[1])
    factor = busbw_factor(op, span.size)
    return CollectiveCost(seconds, name, factor * size / seconds if seconds > 0 else float("inf"))
