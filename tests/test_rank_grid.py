"""The rank grid: coordinates round-trip, groups partition the ranks, TP stays on consecutive ranks."""

from __future__ import annotations

import numpy as np
import pytest

from plan.rank_grid import RankGrid

REFERENCE = RankGrid(dp=781, tp=8, pp=16, cp=1, ep=1)  # the seeds' 100k-GPU layout: 99,968 ranks

LAYOUTS = [
    REFERENCE,
    RankGrid(dp=2, tp=2, pp=2, cp=1, ep=1),
    RankGrid(dp=4, tp=2, pp=3, cp=2, ep=2),
    RankGrid(dp=8, tp=1, pp=2, cp=1, ep=8),
    RankGrid(dp=6, tp=4, pp=1, cp=2, ep=3, order=("cp", "tp", "pp", "dp")),
    RankGrid(dp=128, tp=8, pp=16, cp=1, ep=1, order=("tp", "cp", "pp", "dp")),  # Llama 3's [TP, CP, PP, DP]
]


def test_reference_world_size() -> None:
    assert REFERENCE.world_size == 99_968


@pytest.mark.parametrize("grid", LAYOUTS, ids=lambda g: f"{g.dp}x{g.tp}x{g.pp}x{g.cp}e{g.ep}")
def test_every_rank_round_trips(grid: RankGrid) -> None:
    coords = grid.all_coords()
    ranks = np.arange(grid.world_size)
    # vectorised round trip over every rank, then a scalar check on a sample (and the ends)
    back = [
        grid.rank(int(d), int(p), int(c), int(t))
        for d, p, c, t in zip(coords["dp"], coords["pp"], coords["cp"], coords["tp"], strict=True)
    ]
    assert np.array_equal(np.array(back), ranks)
    for r in (0, grid.world_size - 1, grid.world_size // 3):
        c = grid.coords(r)
        assert grid.rank(c.dp, c.pp, c.cp, c.tp) == r
        assert c.ep == c.dp % grid.ep


@pytest.mark.parametrize("grid", LAYOUTS, ids=lambda g: f"{g.dp}x{g.tp}x{g.pp}x{g.cp}e{g.ep}")
@pytest.mark.parametrize(
    "axes", [("tp",), ("cp",), ("pp",), ("dp",), ("ep",), ("edp",), ("dp", "cp"), ("tp", "cp", "dp", "pp")]
)
def test_groups_partition_the_ranks(grid: RankGrid, axes: tuple[str, ...]) -> None:
    groups = grid.groups(*axes)
    assert groups.shape[1] == int(np.prod([grid.size(a) for a in axes]))
    flat = np.sort(groups.ravel())
    assert np.array_equal(flat, np.arange(grid.world_size)), "every rank in exactly one group"
    # inside a group only the named axes vary
    coords = grid.all_coords()
    fixed = {"tp", "cp", "pp", "dp"} - ({"dp"} if {"dp", "ep", "edp"} & set(axes) else set()) - set(axes)
    for row in groups[:: max(1, len(groups) // 50)]:
        for axis in fixed:
            assert len(set(coords[axis][row].tolist())) == 1, (axes, axis)


@pytest.mark.parametrize("grid", LAYOUTS[1:], ids=lambda g: f"{g.dp}x{g.tp}x{g.pp}x{g.cp}e{g.ep}")
@pytest.mark.parametrize("axes", [("tp",), ("pp",), ("dp",), ("ep",), ("edp",), ("dp", "cp"), ("pp", "tp")])
def test_group_of_is_the_rank_s_row_of_groups(grid: RankGrid, axes: tuple[str, ...]) -> None:
    # group_of indexes the rank's own row directly; it must be the row of groups() that holds the rank, in order
    for row in grid.groups(*axes):
        for rank in row.tolist():
            assert grid.group_of(rank, *axes) == tuple(row.tolist())


def test_tp_groups_are_consecutive_ranks_inside_a_node() -> None:
    tp = REFERENCE.groups("tp")
    assert np.array_equal(tp, np.arange(REFERENCE.world_size).reshape(-1, 8))


def test_default_order_is_megatrons_tp_cp_dp_pp() -> None:
    # dp replicas are one 8-GPU node apart; pipeline stages are a whole dp·tp slab apart
    assert REFERENCE.group_of(0, "dp")[:3] == (0, 8, 16)
    assert REFERENCE.group_of(0, "pp")[:3] == (0, 781 * 8, 2 * 781 * 8)


def test_expert_parallel_folds_into_dp() -> None:
    grid = RankGrid(dp=8, tp=2, pp=1, cp=1, ep=4)
    coords = grid.all_coords()
    for group in grid.groups("ep"):
        assert sorted(coords["ep"][group].tolist()) == [0, 1, 2, 3]
        assert len(set((coords["dp"][group] // 4).tolist())) == 1  # same expert-data-parallel replica
    assert grid.groups("edp").shape == (2 * 4, 2)
    assert sorted(grid.group_of(0, "dp")) == sorted(
        np.concatenate([grid.group_of(0, "ep"), grid.group_of(2 * 4, "ep")]).tolist()
    )


def test_mesh_matches_groups() -> None:
    grid = RankGrid(dp=2, tp=2, pp=2, cp=2, ep=1)
    mesh = grid.mesh(["pp", "dp", "cp", "tp"])
    assert mesh.shape == (2, 2, 2, 2)
    # the last mesh dim varies tp only: its rows are the tp groups
    assert sorted(map(tuple, mesh.reshape(-1, 2).tolist())) == sorted(map(tuple, grid.groups("tp").tolist()))
    dp_rows = np.moveaxis(mesh, 1, -1).reshape(-1, 2)
    assert sorted(map(tuple, dp_rows.tolist())) == sorted(map(tuple, grid.groups("dp").tolist()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp": 3, "tp": 1, "pp": 1, "cp": 1, "ep": 2}, "ep=2 does not divide dp=3"),
        ({"dp": 0, "tp": 1, "pp": 1, "cp": 1, "ep": 1}, "dp=0"),
        ({"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "order": ("tp", "dp")}, "order"),
    ],
)
def test_invalid_grids_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RankGrid(**kwargs)


def test_out_of_range_queries_raise() -> None:
    with pytest.raises(ValueError, match="outside"):
        REFERENCE.coords(REFERENCE.world_size)
    with pytest.raises(ValueError, match="tp=8 outside"):
        REFERENCE.rank(tp=8)
    with pytest.raises(ValueError, match="unknown axis"):
        REFERENCE.groups("xx")


FOLDED = [
    RankGrid(dp=32, tp=2, pp=4, cp=1, ep=64, etp=1),  # DeepSeek-V3's TP2 EP64 over 32 dp replicas (dgxc v25.05)
    RankGrid(dp=4, tp=2, pp=2, cp=2, ep=4, etp=1, order=("tp", "dp", "cp", "pp")),
    RankGrid(dp=6, tp=4, pp=1, cp=1, ep=3, etp=4, order=("cp", "tp", "pp", "dp")),
]


@pytest.mark.parametrize("grid", FOLDED, ids=lambda g: f"{g.dp}x{g.tp}x{g.pp}x{g.cp}e{g.ep}t{g.etp}")
def test_folded_experts_split_each_stage_in_rank_order(grid: RankGrid) -> None:
    # Megatron-Core's expert grid: a stage's tp·cp·dp ranks in grid order, etp innermost, then ep, then edp
    coords = grid.all_coords()
    stage_ranks = grid.groups("tp", "cp", "dp")  # innermost of the three fastest in the default order
    ep, edp = grid.groups("ep"), grid.groups("edp")
    assert ep.shape[1] == grid.ep and edp.shape[1] == grid.stage_ranks // (grid.ep * (grid.etp or 1))
    for axes in (("ep",), ("edp",)):
        groups = grid.groups(*axes)
        assert np.array_equal(np.sort(groups.ravel()), np.arange(grid.world_size)), "a partition"
        for row in groups:
            assert len(set(coords["pp"][row].tolist())) == 1, "inside one pipeline stage"
            assert grid.group_of(int(row[-1]), *axes) == tuple(row.tolist())
    for row in ep:
        assert coords["ep"][row].tolist() == list(range(grid.ep))
        assert all(grid.coords(int(r)).ep == e for e, r in enumerate(row[:3]))
    assert stage_ranks.shape == (grid.pp, grid.stage_ranks)


def test_folded_at_etp_tp_is_the_unfolded_grid() -> None:
    # with experts split as the MLP and no context parallelism, folding changes no group
    for order in (("tp", "cp", "dp", "pp"), ("cp", "tp", "pp", "dp")):
        plain = RankGrid(dp=8, tp=2, pp=2, cp=1, ep=4, order=order)
        folded = RankGrid(dp=8, tp=2, pp=2, cp=1, ep=4, order=order, etp=2)
        for axes in (("ep",), ("edp",)):
            assert sorted(map(tuple, plain.groups(*axes).tolist())) == sorted(map(tuple, folded.groups(*axes).tolist()))


def test_folded_expert_groups_cross_tensor_parallel_ranks() -> None:
    grid = FOLDED[0]
    assert grid.group_of(0, "ep") == tuple(range(64)), "64 consecutive ranks: tp pairs of 32 dp replicas"
    assert grid.groups("edp").shape == (grid.world_size, 1), "one copy of each expert per stage"
    with pytest.raises(ValueError, match="combine with no other axis"):
        grid.groups("edp", "cp")
    with pytest.raises(ValueError, match="ep=64 · etp=1 does not divide tp·cp·dp=32"):
        RankGrid(dp=16, tp=2, pp=1, cp=1, ep=64, etp=1)
