"""The fabric: where the plan's ranks sit, and what any group of them has to cross to talk.

Ranks fill accelerators in rank order (the rank grid keeps a TP group on consecutive ranks, so inside a node).
A group's span is answered arithmetically from that placement — the tier whose domain holds every member, the
members per node, the bottleneck bus bandwidth per rank and the switch hops — which is what keeps a 100k-GPU
`predict` under a second. networkx does what arithmetic does not: `bisection_Bps` is a maximum flow over the
tree of switch domains (what `twin show` reports), and the GPU-level graph of the fabric (GPUs, NVSwitches, rail
leaves, spine and core switch groups, or the torus), built on demand, is what the tests check the arithmetic's
hop counts against with shortest paths.

Bandwidth model (nccl-tests bus-bandwidth convention, NCCL's ring and tree topologies): inside a node a rank gets
the intra-node link's bus bandwidth. A group with `m` members per node runs `m` rings (channels) whose
node-crossing hops each use a different rail NIC, so across nodes each rank gets `m` NICs' worth of bandwidth shared
by `m` ranks, yet only one ring hop in `m` crosses a node; so the group runs at `m · B_nic` of bus bandwidth per
rank, capped by the intra-node link
(Jeaugey, "Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA blog 2019, and NCCL's PXN: data
bound for another rail first hops over NVLink). A tier with oversubscription k above the leaf divides what crosses
it by k.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import networkx as nx
import numpy as np

from plan.cluster import Cluster
from plan.rank_grid import RankGrid

GB = 1e9
US = 1e-6


@dataclass(frozen=True)
class Tier:
    """One level of the fabric in SI units: level 0 is inside a node."""

    name: str
    level: int
    span_nodes: int
    busbw_Bps: float
    """Bus bandwidth one GPU reaches through this tier (link bandwidth x efficiency), bytes/s."""
    link_Bps: float
    """Raw link bandwidth per GPU through this tier, one direction, bytes/s."""
    latency_s: float
    oversubscription: float


@dataclass(frozen=True)
class GroupSpan:
    """What a group of ranks spans on the fabric."""

    size: int
    """Ranks in the group."""
    per_node: int
    """Members inside one node (the group is regular: every node holds the same number)."""
    nodes: int
    """Distinct nodes the group touches."""
    level: int
    """Outermost tier crossed: 0 inside a node, 1 a leaf, 2 a spine, ..."""
    tier: str
    intra_busbw_Bps: float
    """Bus bandwidth per rank inside the node (NVLink), bytes/s."""
    inter_busbw_Bps: float
    """Bus bandwidth per rank across nodes (m NICs' worth shared over m ranks, over-subscription applied)."""
    busbw_Bps: float
    """Bottleneck bus bandwidth per rank for a flat ring over the whole group, bytes/s."""
    latency_s: float
    """One-way small-message latency across the outermost tier crossed, seconds."""
    intra_latency_s: float
    """One-way small-message latency inside the node, seconds."""
    hops: int
    """Switch hops between the two farthest members (0 for a single rank)."""

    @property
    def single(self) -> bool:
        return self.size == 1


def _counts(values: np.ndarray) -> np.ndarray:
    """How many times each distinct value occurs. Ranks come sorted, so their nodes usually do too: then the runs
    between changes are the counts (linear, where np.unique sorts again — at 400k ranks that is most of a predict)."""
    if len(values) > 1 and _ascending(values):
        edges = np.flatnonzero(values[1:] != values[:-1]) + 1
        return np.diff(np.concatenate(([0], edges, [len(values)])))
    return np.unique(values, return_counts=True)[1]


def _ascending(values: np.ndarray) -> bool:
    return bool((values[1:] >= values[:-1]).all())


def _distinct(values: np.ndarray) -> int:
    """Distinct values in `values` (see _counts)."""
    return len(_counts(values)) if len(values) else 0


def _tier(name: str, level: int, span: int, bw_GBps: float, eff: float, lat_us: float, oversub: float) -> Tier:
    """A tier in SI units from the cluster file's figures."""
    return Tier(name, level, span, bw_GBps * eff * GB, bw_GBps * GB, lat_us * US, oversub)


SPANS_KEPT = 4096
"""Groups whose spans a fabric keeps before it starts afresh (a choice: a search's layouts need a few hundred; keys
run up to a whole fleet's ranks, 3 MB at 385k): predictions share a cluster's fabric (twin/step/context.py
fabric_of), and a search's worker predicts thousands of layouts."""


class Fabric:
    """A cluster's fabric with the plan's ranks placed on it."""

    def __init__(self, cluster: Cluster, relocated: dict[int, int] | None = None) -> None:
        self.cluster = cluster
        self.relocated = dict(relocated or {})
        """Job node -> the cluster node it actually runs on, for nodes swapped in from elsewhere."""
        self.gpus_per_node = cluster.node.gpus
        intra = cluster.node.intra
        self.tiers: tuple[Tier, ...] = (
            _tier(intra.name, 0, 1, intra.bandwidth_GBps, intra.efficiency, intra.latency_us, 1.0),
            *(
                _tier(t.name, i + 1, t.span_nodes, t.bandwidth_GBps, t.efficiency, t.latency_us, t.oversubscription)
                for i, t in enumerate(cluster.fabric.tiers)
            ),
        )
        self._spans: dict[bytes, GroupSpan] = {}
        self._group_spans: dict[tuple[RankGrid, tuple[str, ...]], GroupSpan] = {}

    # --- placement -------------------------------------------------------------------------------------------

    def node_of(self, ranks: np.ndarray) -> np.ndarray:
        """Node index of each rank: ranks fill accelerators in rank order, unless their node was relocated."""
        nodes = np.asarray(ranks) // self.gpus_per_node
        if self.relocated:
            nodes = np.array([self.relocated.get(int(n), int(n)) for n in np.atleast_1d(nodes)])
        return nodes

    def local_of(self, ranks: np.ndarray) -> np.ndarray:
        """Accelerator index inside its node (which rail its NIC is on)."""
        return np.asarray(ranks) % self.gpus_per_node

    # --- group queries ---------------------------------------------------------------------------------------

    def span(self, ranks: np.ndarray | list[int] | tuple[int, ...]) -> GroupSpan:
        """The span of a group of ranks (cached per group)."""
        arr = np.asarray(ranks, dtype=np.int64)
        if not _ascending(arr):
            arr = np.sort(arr)
        key = arr.tobytes()  # hashing the buffer, not a tuple of 400k ints: a whole-fleet group stays cheap
        cached = self._spans.get(key)
        if cached is None:
            if len(self._spans) >= SPANS_KEPT:  # a fabric shared by many predictions keeps the recent groups
                self._spans.clear()
                self._group_spans.clear()
            cached = self._spans[key] = self._torus_span(arr) if self.cluster.fabric.torus else self._tree_span(arr)
        return cached

    def group_span(self, grid: RankGrid, axes: tuple[str, ...]) -> GroupSpan:
        """The span of rank 0's group along `axes` of `grid` (cached per layout: candidates of one search that share
        a layout share its spans, whose groups can hold a whole 100k-GPU fleet's replicas)."""
        key = (grid, axes)
        cached = self._group_spans.get(key)
        if cached is None:
            whole = math.prod(grid.size(a) for a in axes) == grid.world_size  # every rank: no need to list them
            ranks = np.arange(grid.world_size) if whole else grid.group_of(0, *axes)
            cached = self._group_spans[key] = self.span(ranks)
        return cached

    def _level(self, nodes: np.ndarray) -> int:
        if _distinct(nodes) == 1:
            return 0
        for tier in self.tiers[1:]:
            if _distinct(nodes // tier.span_nodes) == 1:
                return tier.level
        raise ValueError(f"ranks span nodes beyond the outermost tier of {self.cluster.name}")

    def _tree_span(self, arr: np.ndarray) -> GroupSpan:
        nodes = self.node_of(arr)
        n_nodes = _distinct(nodes)
        per_node = len(arr) // n_nodes
        level = self._level(nodes)
        intra = self.tiers[0]
        if level == 0:
            bw = intra.busbw_Bps if len(arr) > 1 else float("inf")
            hops = 1 if len(arr) > 1 else 0
            return GroupSpan(
                len(arr), per_node, 1, 0, intra.name, bw, float("inf"), bw, intra.latency_s, intra.latency_s, hops
            )
        crossed = self.tiers[1 : level + 1]
        # m rings, each crossing nodes on its own rail NIC. Above the leaf a ring leaves each domain of the tier
        # below once per group, so if the group has k members in every such domain, the domain's uplinks (its
        # GPUs' bandwidth / over-subscription) carry 1/k of its GPUs' traffic: they slow the ring only when k is
        # smaller than the over-subscription.
        inter = min(per_node * t.busbw_Bps / self._crowding(arr, t) for t in crossed)
        ring = min(inter, intra.busbw_Bps) if per_node > 1 else inter
        return GroupSpan(
            size=len(arr),
            per_node=per_node,
            nodes=n_nodes,
            level=level,
            tier=crossed[-1].name,
            intra_busbw_Bps=intra.busbw_Bps,
            inter_busbw_Bps=inter,
            busbw_Bps=ring,
            # leaf = 1 switch hop, leaf-spine-leaf = 3, ...; rails meet at the spine, so only under one leaf does a
            # member on another rail cost an extra NVSwitch hop (PXN)
            latency_s=crossed[-1].latency_s,
            intra_latency_s=intra.latency_s,
            hops=2 * level - 1 + (1 if per_node > 1 and level == 1 else 0),
        )

    def _crowding(self, arr: np.ndarray, tier: Tier) -> float:
        """How much tier `tier`'s over-subscription slows a ring over `arr` (>= 1; see _tree_span)."""
        if tier.level < 2 or tier.oversubscription <= 1:
            return 1.0
        below = self.tiers[tier.level - 1].span_nodes
        return max(1.0, tier.oversubscription / float(_counts(self.node_of(arr) // below).min()))

    def _torus_span(self, arr: np.ndarray) -> GroupSpan:
        """A group inside one pod is a sub-block of its torus. A group over several pods is priced as the
        hierarchical algorithms treat a node: its members in one pod form the torus sub-block, and the pods talk
        over the data-centre network, each member on its own host's share of DCN bandwidth (MaxText multislice:
        reduce-scatter over ICI, the DCN all-reduce of 1/m of the data, all-gather over ICI)."""
        pod = self.cluster.pod_chips
        pods = _distinct(arr // pod)
        inner = self._pod_span(arr[arr // pod == arr[0] // pod] % pod)
        if pods == 1:
            return inner
        m = len(arr) // pods
        level = self._level(self.node_of(arr))
        dcn = self.tiers[level]
        inter = m * dcn.busbw_Bps / self._crowding(arr, dcn)
        return GroupSpan(
            size=len(arr),
            per_node=m,
            nodes=pods,
            level=level,
            tier=dcn.name,
            intra_busbw_Bps=inner.busbw_Bps,
            inter_busbw_Bps=inter,
            busbw_Bps=min(inter, inner.busbw_Bps) if m > 1 else inter,
            latency_s=dcn.latency_s,
            intra_latency_s=inner.latency_s,
            hops=inner.hops + 2 * (level - 1) + 1,
        )

    def _pod_span(self, arr: np.ndarray) -> GroupSpan:
        """A group inside one pod (chip indices within it): rings along each spanned dimension run at once."""
        torus = self.cluster.fabric.torus
        assert torus is not None
        dims = np.array(torus.dims)
        coords = np.stack(np.unravel_index(arr, tuple(dims[::-1])), axis=1)[:, ::-1]  # x fastest
        extent = coords.max(axis=0) - coords.min(axis=0) + 1
        spanned = int((extent > 1).sum())
        link = torus.link_bandwidth_GBps * GB * self.cluster.node.intra.efficiency
        # a ring along a wrapped dimension uses both directions' links; several dimensions add up
        per_dim = 2 * link if torus.wraparound else link
        bw = per_dim * max(1, spanned) if len(arr) > 1 else float("inf")
        half = np.where(torus.wraparound, np.minimum(extent - 1, dims // 2), extent - 1)
        hops = int(half.sum())
        nodes = len(np.unique(self.node_of(arr)))
        latency = torus.latency_us * US
        return GroupSpan(
            size=len(arr),
            per_node=len(arr) // nodes,
            nodes=nodes,
            level=min(spanned, 1),
            tier="ici",
            intra_busbw_Bps=bw,
            inter_busbw_Bps=bw,
            busbw_Bps=bw,
            latency_s=latency * max(1, hops),
            intra_latency_s=latency,
            hops=hops,
        )

    # --- the graph ---------------------------------------------------------------------------------------------

    @cached_property
    def graph(self) -> nx.Graph:
        """The fabric as a graph: vertices are GPUs and switch groups, edges are links."""
        return self._torus_graph() if self.cluster.fabric.torus else self._tree_graph()

    def _tree_graph(self) -> nx.Graph:
        g = nx.Graph()
        gpn, n_nodes = self.gpus_per_node, self.cluster.nodes
        rails = self.cluster.fabric.rails if self.cluster.fabric.rail_optimized else 1
        for node in range(n_nodes):
            switch = ("nvswitch", node)
            g.add_edges_from(((("gpu", node * gpn + i), switch) for i in range(gpn)), tier=0)
            if len(self.tiers) == 1:
                continue
            leaf_domain = node // self.tiers[1].span_nodes
            for i in range(gpn):  # GPU i's NIC sits on rail i (or all share rail 0 when not rail-optimized)
                g.add_edge(("gpu", node * gpn + i), ("leaf", i % rails, leaf_domain), tier=1)
        for tier in self.tiers[2:]:
            lower = self.tiers[tier.level - 1]
            for domain in range(-(-n_nodes // lower.span_nodes)):
                upper = domain * lower.span_nodes // tier.span_nodes
                for rail in range(rails):
                    below = ("leaf", rail, domain) if lower.level == 1 else (lower.name, domain)
                    g.add_edge(below, (tier.name, upper), tier=tier.level)
        return g

    def _torus_graph(self) -> nx.Graph:
        """Each pod's torus; between pods every chip reaches the data-centre network through its host."""
        torus = self.cluster.fabric.torus
        assert torus is not None
        grid = nx.grid_graph(dim=list(torus.dims), periodic=torus.wraparound)
        pod = self.cluster.pod_chips
        g = nx.Graph()
        for first in range(0, self.cluster.gpus, pod):
            g.update(nx.relabel_nodes(grid, {c: ("gpu", first + self._torus_index(c)) for c in grid.nodes}))
            if pod < self.cluster.gpus:
                g.add_edges_from(((("gpu", first + i), ("dcn", 0)) for i in range(pod)), tier=1)
        return g

    def _torus_index(self, coord: tuple[int, ...]) -> int:
        torus = self.cluster.fabric.torus
        assert torus is not None
        # networkx grid_graph lists dims in reverse: its first coordinate is the last dim
        return int(np.ravel_multi_index(coord, tuple(reversed(torus.dims))))

    def bisection_Bps(self) -> float:
        """Bisection bandwidth of the scale-out fabric (bytes/s, one direction): the most traffic the first half of
        the nodes can send the second half at once, as a maximum flow (networkx) over the tree of switch domains.

        Each tier's domains are vertices; a domain's uplink into the tier above carries its GPUs' bandwidth through
        that tier divided by the tier's over-subscription; a leaf domain split by the halving is two vertices, one
        per side. A non-blocking fat tree gives half the GPUs times their NIC bandwidth; over-subscription k above
        the leaves divides what crosses it by k. On one torus pod: the links a cut through the longest dimension
        crosses; across pods: half the chips' share of the data-centre network.
        """
        cluster = self.cluster
        if cluster.fabric.torus is not None:
            torus = cluster.fabric.torus
            if cluster.pod_chips < cluster.gpus:  # pods split in halves: half the chips' DCN share crosses
                dcn = self.tiers[-1]
                return cluster.gpus // 2 * dcn.link_Bps / dcn.oversubscription
            cut_links = cluster.pod_chips // max(torus.dims) * (2 if torus.wraparound else 1)
            return cut_links * torus.link_bandwidth_GBps * GB
        tiers = self.tiers[1:]
        if not tiers:
            return 0.0
        g = nx.DiGraph()
        half = cluster.nodes // 2
        gpn = self.gpus_per_node
        for node_lo in range(0, cluster.nodes, tiers[0].span_nodes):  # leaf domains, each split by the halving
            leaf = node_lo // tiers[0].span_nodes
            node_hi = min(cluster.nodes, node_lo + tiers[0].span_nodes)
            for side, lo, hi in (("a", node_lo, min(node_hi, half)), ("b", max(node_lo, half), node_hi)):
                if hi <= lo:
                    continue
                part = ("part", leaf, side)
                inject = (hi - lo) * gpn * tiers[0].link_Bps / tiers[0].oversubscription
                if side == "a":
                    g.add_edge("src", part, capacity=inject)
                else:
                    g.add_edge(part, "dst", capacity=inject)
                self._link(g, part, (1, leaf), inject)
        for lower, upper in itertools.pairwise(tiers):
            for domain in range(-(-cluster.nodes // lower.span_nodes)):
                nodes = min(cluster.nodes, (domain + 1) * lower.span_nodes) - domain * lower.span_nodes
                parent = domain * lower.span_nodes // upper.span_nodes
                uplink = nodes * gpn * upper.link_Bps / upper.oversubscription
                self._link(g, (lower.level, domain), (upper.level, parent), uplink)
        if not (g.has_node("src") and g.has_node("dst")):
            return 0.0
        return float(nx.maximum_flow_value(g, "src", "dst"))

    @staticmethod
    def _link(g: nx.DiGraph, a: object, b: object, capacity: float) -> None:
        """A full-duplex link: `capacity` each way."""
        g.add_edge(a, b, capacity=capacity)
        g.add_edge(b, a, capacity=capacity)

    def graph_hops(self, a: int, b: int) -> int:
        """Switch hops between ranks a and b along the graph's shortest path."""
        path = nx.shortest_path(self.graph, ("gpu", a), ("gpu", b))
        if self.cluster.fabric.torus:
            return len(path) - 1
        return sum(1 for v in path if v[0] != "gpu")
