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
