"""One rank grid: global rank <-> (dp, pp, cp, ep, tp) coordinates, and the groups along each axis.

Pure numpy, no torch.distributed: the twin places ranks on the fabric with it and the executor builds its
process groups and DeviceMesh from it, so both see the same layout. (After picotron's process-group grid,
without its global singleton.)

The grid's physical axes follow `layout.rank_order`, innermost (fastest-varying rank) first; the default
`tp-cp-dp-pp` keeps a TP group on consecutive ranks, so inside one NVLink node. Expert parallelism folds into dp
as in Megatron-Core: the dp axis is split into an inner `ep` axis and an outer `edp` axis (dp / ep replicas of each
expert), and a rank's dp coordinate is `edp · ep + ep`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

from plan.schema import Layout

# Axes a group may vary along: the four of the grid, the two halves of dp, and nothing else.
GROUP_AXES = ("tp", "cp", "pp", "dp", "ep", "edp")


class Coords(NamedTuple):
    """Where one rank sits in the grid (each an index along its axis)."""

    dp: int
    pp: int
    cp: int
    ep: int
    tp: int


@dataclass(frozen=True)
class RankGrid:
    """The layout's ranks arranged as an array, one axis per parallel dimension."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    order: tuple[str, ...] = ("tp", "cp", "dp", "pp")

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "cp", "ep"):
            if getattr(self, axis) < 1:
                raise ValueError(f"rank grid: {axis}={getattr(self, axis)} must be >= 1")
        if self.dp % self.ep:
            raise ValueError(f"rank grid: ep={self.ep} does not divide dp={self.dp}")
        if sorted(self.order) != sorted(("tp", "cp", "dp", "pp")):
            raise ValueError(f"rank grid: order {self.order} must name tp, cp, dp and pp once each")

    @classmethod
    def from_layout(cls, layout: Layout) -> RankGrid:
        return cls(layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.axes)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def size(self, axis: str) -> int:
        """Ranks along one axis (edp is dp / ep)."""
        return self.dp // self.ep if axis == "edp" else int(getattr(self, axis))

    @cached_property
    def physical_axes(self) -> tuple[str, ...]:
        """The array's axes, outermost first; dp appears as (edp, ep)."""
        axes: list[str] = []
        for axis in reversed(self.order):
            axes.extend(("edp", "ep") if axis == "dp" else (axis,))
        return tuple(axes)

    @cached_property
    def grid(self) -> np.ndarray:
        """Global ranks laid out with shape [size of each physical axis], outermost first."""
        shape = tuple(self.size(a) for a in self.physical_axes)
        grid = np.arange(self.world_size, dtype=np.int64).reshape(shape)
        grid.flags.writeable = False
        return grid

    def _expand(self, axes: Sequence[str]) -> list[str]:
        out: list[str] = []
        for axis in axes:
            if axis not in GROUP_AXES:
                raise ValueError(f"rank grid: unknown axis {axis!r}; use one of {', '.join(GROUP_AXES)}")
            out.extend(("edp", "ep") if axis == "dp" else (axis,))
        if len(set(out)) != len(out):
            raise ValueError(f"rank grid: axes {tuple(axes)} overlap")
        return out

    def all_coords(self) -> dict[str, np.ndarray]:
        """Coordinates of every rank, vectorised: axis -> array indexed by global rank."""
        idx = np.unravel_index(np.arange(self.world_size), self.grid.shape)
        by_axis = dict(zip(self.physical_axes, idx, strict=True))
        return {
            "dp": by_axis["edp"] * self.ep + by_axis["ep"],
            "pp": by_axis["pp"],
            "cp": by_axis["cp"],
            "ep": by_axis["ep"],
            "tp": by_axis["tp"],
        }

    def coords(self, rank: int) -> Coords:
        """The (dp, pp, cp, ep, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank grid: rank {rank} outside 0..{self.world_size - 1}")
        idx = dict(zip(self.physical_axes, np.unravel_index(rank, self.grid.shape), strict=True))
        return Coords(
            dp=int(idx["edp"] * self.ep + idx["ep"]),
            pp=int(idx["pp"]),
            cp=int(idx["cp"]),
            ep=int(idx["ep"]),
            tp=int(idx["tp"]),
        )

    def rank(self, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates (ep is implied by dp: ep = dp mod ep-degree)."""
        for axis, value in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):
            if not 0 <= value < self.size(axis):
                raise ValueError(f"rank grid: {axis}={value} outside 0..{self.size(axis) - 1}")
        at = {"edp": dp // self.ep, "ep": dp % self.ep, "pp": pp, "cp": cp, "tp": tp}
        return int(np.ravel_multi_index(tuple(at[a] for a in self.physical_axes), self.grid.shape))

    def groups(self, *axes: str) -> np.ndarray:
        """Every group that varies along `axes` with the other coordinates fixed: shape [groups, group size].

        The rows partition all ranks. Within a row, ranks are ordered by the axes as given, the last fastest:
        `groups("dp", "cp")` is the combined group FSDP shards over, `groups("ep")` an all-to-all group,
        `groups("edp")` the replicas of one expert shard.
        """
        varying = self._expand(axes)
        fixed = [a for a in self.physical_axes if a not in varying]
        perm = [self.physical_axes.index(a) for a in fixed + varying]
        size = int(np.prod([self.size(a) for a in varying])) if varying else 1
        return self.grid.transpose(perm).reshape(-1, size)

    def group_of(self, rank: int, *axes: str) -> tuple[int, ...]:
        """The ranks of `rank`'s group along `axes`, in group order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank grid: rank {rank} outside 0..{self.world_size - 1}")
        varying = self._expand(axes)
        at = np.unravel_index(rank, self.grid.shape)
        # the rank's own coordinates on the fixed axes, every coordinate on the varying ones: its row of groups()
        sub = self.grid[tuple(slice(None) if a in varying else at[i] for i, a in enumerate(self.physical_axes))]
        kept = [a for a in self.physical_axes if a in varying]
        return tuple(sub.transpose([kept.index(a) for a in varying]).ravel().tolist())

    def mesh(self, dims: Sequence[str]) -> np.ndarray:
        """The ranks arranged with one array axis per name in `dims` (outermost first), for a DeviceMesh.

        `dims` must cover tp, cp, pp and dp (or edp and ep) exactly once.
        """
        expanded = self._expand(dims)
        if sorted(expanded) != sorted(self.physical_axes):
            raise ValueError(f"rank grid: mesh dims {tuple(dims)} must cover {self.physical_axes} once")
        arr = self.grid.transpose([self.physical_axes.index(a) for a in expanded])
        return arr.reshape([self.size(d) for d in dims])
