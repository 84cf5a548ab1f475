"""One rank grid: global rank <-> (dp, pp, cp, ep, tp) coordinates, and the groups along each axis.

Pure numpy, no torch.distributed: the twin places ranks on the fabric with it and the executor builds its
process groups and DeviceMesh from it, so both see the same layout. (After picotron's process-group grid,
without its global singleton.)

The grid's physical axes follow `layout.rank_order`, innermost (fastest-varying rank) first; the default
`tp-cp-dp-pp` keeps a TP group on consecutive ranks, so inside one NVLink node. Expert parallelism folds into dp
as in Megatron-Core: the dp axis is split into an inner `ep` axis and an outer `edp` axis (dp / ep replicas of each
expert), and a rank's dp coordinate is `edp · ep + ep`.

With `etp` set (layout.expert_tp, Megatron-Core's MoE parallel folding) the experts have a grid of their own: each
pipeline stage's tp · cp · dp ranks, in grid order, are re-split into `etp` (innermost), `ep` and `edp`, so an
expert-parallel group may cross tp, cp and dp; dp stays one axis of the dense grid. The executor does not run
folded layouts (executor/contract.py), so `mesh` and the combined groups are the dense grid's only.
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
    etp: int | None = None
    """Expert tensor-parallel ranks where the experts fold over tp · cp · dp (layout.expert_tp); None: ep in dp."""

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "cp", "ep"):
            if getattr(self, axis) < 1:
                raise ValueError(f"rank grid: {axis}={getattr(self, axis)} must be >= 1")
        if self.etp is not None and (self.etp < 1 or self.stage_ranks % (self.etp * self.ep)):
            raise ValueError(f"rank grid: ep={self.ep} · etp={self.etp} does not divide tp·cp·dp={self.stage_ranks}")
        if self.etp is None and self.dp % self.ep:
            raise ValueError(f"rank grid: ep={self.ep} does not divide dp={self.dp}")
        if sorted(self.order) != sorted(("tp", "cp", "dp", "pp")):
            raise ValueError(f"rank grid: order {self.order} must name tp, cp, dp and pp once each")

    @classmethod
    def from_layout(cls, layout: Layout) -> RankGrid:
        return cls(layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.axes, layout.expert_tp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage: tp · cp · dp."""
        return self.tp * self.cp * self.dp

    @property
    def folded(self) -> bool:
        """Whether the experts have a grid of their own (etp set) rather than ep inside dp."""
        return self.etp is not None

    def size(self, axis: str) -> int:
        """Ranks along one axis (edp is dp / ep, or tp · cp · dp / (etp · ep) folded)."""
        if axis == "edp":
            return self.stage_ranks // (self.etp * self.ep) if self.etp is not None else self.dp // self.ep
        return int(getattr(self, axis))

    @cached_property
    def physical_axes(self) -> tuple[str, ...]:
        """The array's axes, outermost first; dp appears as (edp, ep) unless the experts are folded."""
        axes: list[str] = []
        for axis in reversed(self.order):
            axes.extend(("edp", "ep") if axis == "dp" and not self.folded else (axis,))
        return tuple(axes)

    @cached_property
    def expert_view(self) -> np.ndarray:
        """Folded: the ranks as [pp, edp, ep, etp], each stage's tp · cp · dp ranks in grid order (Megatron-Core's
        expert rank generator, order tp-ep-dp-pp with tp the expert tensor-parallel size)."""
        assert self.etp is not None
        first = [self.physical_axes.index("pp")] + [i for i, a in enumerate(self.physical_axes) if a != "pp"]
        stages = self.grid.transpose(first).reshape(self.pp, -1)
        return stages.reshape(self.pp, self.size("edp"), self.ep, self.etp)

    def _expert_groups(self, axis: str) -> np.ndarray:
        """Folded: every group along `axis` (ep or edp) of the expert grid, shape [groups, group size]."""
        last = {"ep": 2, "edp": 1}[axis]
        view = self.expert_view
        return view.transpose([a for a in range(4) if a != last] + [last]).reshape(-1, view.shape[last])

    def _folded_axes(self, axes: Sequence[str]) -> str | None:
        """The one expert axis a folded grid's group names, or None where the group is the dense grid's."""
        named = [a for a in axes if a in ("ep", "edp")]
        if not self.folded or not named:
            return None
        if len(axes) != 1:
            raise ValueError(f"rank grid: folded experts: the {named[0]} groups combine with no other axis")
        return named[0]

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
            if self.folded and axis in ("ep", "edp"):
                raise ValueError(f"rank grid: folded experts have no {axis} axis in the dense grid")
            out.extend(("edp", "ep") if axis == "dp" and not self.folded else (axis,))
        if len(set(out)) != len(out):
            raise ValueError(f"rank grid: axes {tuple(axes)} overlap")
        return out

    def all_coords(self) -> dict[str, np.ndarray]:
        """Coordinates of every rank, vectorised: axis -> array indexed by global rank."""
        idx = np.unravel_index(np.arange(self.world_size), self.grid.shape)
        by_axis = dict(zip(self.physical_axes, idx, strict=True))
        if self.folded:
            ep = np.empty(self.world_size, dtype=np.int64)
            ep[self.expert_view] = np.arange(self.ep).reshape(1, 1, -1, 1)
            by_axis["ep"] = ep
        return {
            "dp": by_axis["dp"] if self.folded else by_axis["edp"] * self.ep + by_axis["ep"],
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
        if self.folded:
            ep = int(np.argwhere(self.expert_view == rank)[0][2])
            return Coords(dp=int(idx["dp"]), pp=int(idx["pp"]), cp=int(idx["cp"]), ep=ep, tp=int(idx["tp"]))
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
        at = {"dp": dp, "edp": dp // self.ep, "ep": dp % self.ep, "pp": pp, "cp": cp, "tp": tp}
        return int(np.ravel_multi_index(tuple(at[a] for a in self.physical_axes), self.grid.shape))

    def groups(self, *axes: str) -> np.ndarray:
        """Every group that varies along `axes` with the other coordinates fixed: shape [groups, group size].

        The rows partition all ranks. Within a row, ranks are ordered by the axes as given, the last fastest:
        `groups("dp", "cp")` is the combined group FSDP shards over, `groups("ep")` an all-to-all group,
        `groups("edp")` the replicas of one expert shard.
        """
        expert = self._folded_axes(axes)
        if expert is not None:
            return self._expert_groups(expert)
        varying = self._expand(axes)
        fixed = [a for a in self.physical_axes if a not in varying]
        perm = [self.physical_axes.index(a) for a in fixed + varying]
        size = int(np.prod([self.size(a) for a in varying])) if varying else 1
        return self.grid.transpose(perm).reshape(-1, size)

    def group_of(self, rank: int, *axes: str) -> tuple[int, ...]:
        """The ranks of `rank`'s group along `axes`, in group order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank grid: rank {rank} outside 0..{self.world_size - 1}")
        expert = self._folded_axes(axes)
        if expert is not None:
            rows = self._expert_groups(expert)
            return tuple(rows[np.nonzero((rows == rank).any(axis=1))[0][0]].tolist())
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
