"""One step under torch.profiler (`--profile-step N`), for a look at what the ranks did in it.

Every rank records step N (CPU activity, and CUDA's on a GPU) inside a `step N` span that marks the step's start
and end, and exports it as a Chrome / Perfetto trace, `<run>/profile/rank{R}.json` (R the global rank). Rank 0
also writes `<run>/profile/ranks.json` (`plan.records.ProfileIndex`: the step and every rank's grid coordinates),
from which `twin trace` picks the ranks to lay beside the twin's prediction. Only the one step is recorded: the
profiler's cost (up to a quarter of a cpu-tiny step) lands on it alone, and the export after it is not timed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from executor.parallel import Topology
from plan.records import ProfiledRank, ProfileIndex, RankCoords


class StepProfiler:
    """Profiles step `step` of this rank (None: no step) into `run_dir/profile/`."""

    def __init__(self, step: int | None, run_dir: Path, topo: Topology, device: torch.device) -> None:
        self.step, self.dir, self.topo, self.device = step, run_dir / "profile", topo, device

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        """Run the body (one training step) under the profiler if it is the step to profile."""
        if step != self.step:
            yield
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof, record_function(f"step {step}"):
            yield
        self.dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.dir / trace_name(self.topo.rank)))
        if self.topo.rank == 0:
            self._write_index(step)

    def _write_index(self, step: int) -> None:
        coords = self.topo.grid.all_coords()
        ranks = tuple(
            ProfiledRank(rank=r, coords=RankCoords(**{a: int(c[r]) for a, c in coords.items()}), trace=trace_name(r))
            for r in range(self.topo.grid.world_size)
        )
        device = "cuda" if self.device.type == "cuda" else "cpu"
        index = ProfileIndex(step=step, device=device, ranks=ranks)
        (self.dir / "ranks.json").write_text(index.model_dump_json(indent=1))


def trace_name(rank: int) -> str:
    return f"rank{rank}.json"
