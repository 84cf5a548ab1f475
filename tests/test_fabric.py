"""The fabric: group spans answered arithmetically agree with the networkx graph; tiers and bandwidths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pydantic import ValidationError

from plan.cluster import Cluster
from plan.loader import load_cluster
from plan.rank_grid import RankGrid
from twin.step import fabric as fabric_module
from twin.step.collectives import collective_time
from twin.step.context import fabric_of
from twin.step.fabric import Fabric


@pytest.fixture(scope="module")
def h100() -> Fabric:
    return Fabric(load_cluster("dgx-h100-superpod"))


@pytest.mark.parametrize(
    ("ranks", "level", "tier"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 7], 0, "nvlink4"),
        ([0, 8], 1, "leaf"),  # same rail, same scalable unit of 32 nodes
        ([0, 8 * 32], 2, "spine"),  # next scalable unit
        ([0, 8 * 128], 3, "core"),  # next spine group of 128 nodes
    ],
)
def test_span_levels(h100: Fabric, ranks: list[int], level: int, tier: str) -> None:
    s = h100.span(ranks)
    assert (s.level, s.tier) == (level, tier)


def test_arithmetic_hops_match_graph_shortest_paths(h100: Fabric) -> None:
    rng = np.random.default_rng(0)
    pairs = [(0, 8), (0, 256), (0, 1024), (0, 16383), (3, 3 + 8 * 200), (0, 7), (0, 9)]
    pairs += [tuple(int(x) for x in rng.choice(16384, 2, replace=False)) for _ in range(20)]
    for a, b in pairs:
        if a % 8 != b % 8 and a // 8 != b // 8:
            continue  # cross-rail pairs hop through an NVSwitch first (PXN); checked below
        assert h100.span([a, b]).hops == h100.graph_hops(a, b), (a, b)


@pytest.mark.parametrize("group", [[0, 1, 8 * 40, 8 * 40 + 1], [0, 1, 8 * 3, 8 * 3 + 1], [0, 8, 16, 24]])
def test_group_hops_are_the_farthest_pair(h100: Fabric, group: list[int]) -> None:
    worst = max(h100.graph_hops(a, b) for a, b in itertools.combinations(group, 2))
    assert h100.span(group).hops == worst


def test_dp_group_of_rail_optimized_layout_runs_at_nic_speed(h100: Fabric) -> None:
    grid = RankGrid(dp=64, tp=8, pp=4, cp=1, ep=1)
    dp = h100.span(grid.group_of(0, "dp"))
    cluster = load_cluster("dgx-h100-superpod")
    nic = cluster.fabric.tiers[0].bandwidth_GBps * cluster.fabric.tiers[0].efficiency * 1e9
    assert dp.per_node == 1 and dp.busbw_Bps == pytest.approx(nic)
    tp = h100.span(grid.group_of(0, "tp"))
    assert tp.level == 0 and tp.busbw_Bps > 5 * dp.busbw_Bps


def test_oversubscription_divides_cross_pod_bandwidth() -> None:
    meta = Fabric(load_cluster("meta-24k-h100-roce"))
    in_pod = meta.span([0, 8 * 100])
    across = meta.span([0, 8 * 400])  # pods are 384 nodes; aggregation is 1:7
    assert across.busbw_Bps == pytest.approx(in_pod.busbw_Bps / 7)


def test_torus_span_counts_dimensions_and_hops() -> None:
    tpu = Fabric(load_cluster("tpu-v5p-pod"))
    line = tpu.span(list(range(16)))  # one full x ring
    plane = tpu.span([x + 16 * y for y in range(4) for x in range(16)])
    assert plane.busbw_Bps == pytest.approx(2 * line.busbw_Bps)
    assert line.hops == 8  # the farthest chip on a 16-ring is 8 hops away
    assert tpu.graph_hops(0, 8) == 8


def test_graph_of_a_16k_fabric(h100: Fabric) -> None:
    g = h100.graph
    assert sum(1 for v in g if v[0] == "gpu") == 16384
    assert sum(1 for v in g if v[0] == "leaf") == 8 * 64  # a rail leaf per rail per scalable unit


def test_span_is_cached(h100: Fabric) -> None:
    group = list(range(0, 8 * 64, 8))
    assert h100.span(group) is h100.span(group)


@pytest.mark.parametrize(
    ("name", "overrides", "expected_TBps"),
    [
        ("dgx-a100-superpod", {}, 1120 / 2 * 25 / 1e3),  # non-blocking: half the GPUs at their NIC bandwidth
        ("dgx-a100-superpod", {"nodes": 280}, 2240 / 2 * 25 / 1e3),  # a what-if: twice the nodes, twice the cut
        ("dgx-a100-superpod", {"nodes": 160, "fabric.tiers.spine.oversubscription": 4}, 1280 / 2 * 25 / 1e3 / 4),
        ("meta-24k-h100-roce", {}, 24576 / 2 * 50 / 1e3 / 7),  # Meta's 1:7 aggregation layer (Gangidi et al. 2024)
        ("dgx-h100-superpod", {"fabric.tiers.*.bandwidth_GBps": 100}, 16384 / 2 * 100 / 1e3),  # 800G NICs
    ],
)
def test_bisection_bandwidth_is_the_closed_form(name: str, overrides: dict, expected_TBps: float) -> None:
    cluster = load_cluster(name, overrides=overrides)
    assert Fabric(cluster).bisection_Bps() / 1e12 == pytest.approx(expected_TBps, rel=1e-9)


def test_bisection_of_a_torus_cuts_its_longest_dimension() -> None:
    cluster = load_cluster("tpu-v5p-pod")
    torus = cluster.fabric.torus
    assert torus is not None
    cut = cluster.gpus // max(torus.dims) * (2 if torus.wraparound else 1)
    assert Fabric(cluster).bisection_Bps() == pytest.approx(cut * torus.link_bandwidth_GBps * 1e9)


def _two_pods(dcn_GBps: float = 6.25) -> Cluster:
    """Two v5p pods joined by a data-centre network tier (the multi-pod arrangement of TPU fleets)."""
    pod = load_cluster("tpu-v5p-pod")
    tier = {
        "name": "dcn",
        "source": "test fixture: two pods over one DCN tier",
        "bandwidth_GBps": dcn_GBps,
        "latency_us": 20.0,
        "efficiency": 1.0,
        "span_nodes": 2 * pod.nodes,
    }
    data = pod.model_dump()
    data["nodes"] = 2 * pod.nodes
    data["fabric"]["tiers"] = [tier]
    return Cluster.model_validate(data)


def test_a_group_over_two_pods_runs_its_pod_part_on_ici_and_the_rest_on_the_dcn() -> None:
    cluster = _two_pods()
    fabric = Fabric(cluster)
    pod = cluster.pod_chips
    dcn = 6.25e9
    one_each = fabric.span([0, pod])
    assert (one_each.level, one_each.tier, one_each.per_node, one_each.nodes) == (1, "dcn", 1, 2)
    assert one_each.busbw_Bps == pytest.approx(dcn)
    ring = list(range(16))  # a full x ring in each pod: 16 members per pod share 16 hosts' worth of DCN
    both = fabric.span(ring + [pod + r for r in ring])
    inside = fabric.span(ring)
    assert both.intra_busbw_Bps == pytest.approx(inside.busbw_Bps)
    assert both.inter_busbw_Bps == pytest.approx(16 * dcn)
    # 16 rings, each crossing the DCN once per pod on its own host's share, beat the hierarchical algorithm (ICI
    # reduce-scatter, DCN all-reduce of 1/16, ICI all-gather): the DCN-bound closed form
    cost = collective_time("all_reduce", 1e9, both)
    n = both.size
    assert cost.algorithm == "ring"
    assert cost.seconds == pytest.approx(2 * (n - 1) / n * 1e9 / (16 * dcn) + 2 * (n - 1) * 20e-6)
    assert fabric.graph_hops(0, pod) == 2  # chip -> DCN -> chip
    assert fabric.bisection_Bps() == pytest.approx(cluster.gpus // 2 * dcn)


def test_pods_need_a_network_between_them_and_must_tile_the_fleet() -> None:
    data = load_cluster("tpu-v5p-pod").model_dump()
    data["nodes"] *= 2
    with pytest.raises(ValidationError, match="data-centre network"):
        Cluster.model_validate(data)
    data = load_cluster("tpu-v5p-pod").model_dump()
    data["fabric"]["torus"]["dims"] = [16, 20, 27]
    with pytest.raises(ValidationError, match="pod of 8640 chips"):
        Cluster.model_validate(data)


def test_predictions_of_one_cluster_share_its_fabric_and_its_span_cache_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Predictions of one cluster share its fabric and the spans it has worked out (context.fabric_of); a fabric
    shared so keeps only the recent groups, and what it works out again is what it had."""
    cluster = load_cluster("dgx-h100-superpod")
    shared = fabric_of(cluster, ())
    assert fabric_of(cluster, ()) is shared
    assert fabric_of(cluster, ((0, 5),)) is not shared
    assert fabric_of(load_cluster("dgx-h100-superpod", overrides={"nodes": 64}), ()) is not shared
    monkeypatch.setattr(fabric_module, "SPANS_KEPT", 2)
    groups = [np.arange(8), np.arange(0, 64, 8), np.arange(16)]
    first = [shared.span(g) for g in groups]
    assert len(shared._spans) <= 2
    assert [shared.span(g) for g in groups] == first
