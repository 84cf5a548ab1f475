"""The microbenchmark result schema: what `twin bench` (run by the executor) writes and `twin calibrate` reads.

Collective figures follow nccl-tests' conventions (PERFORMANCE.md): `bytes` is the size of the whole buffer the
operation produces or reduces (all-gather: the gathered output; reduce-scatter: the input), algorithm bandwidth
is bytes / time, and bus bandwidth is that times the operation's factor — 2(n−1)/n for all-reduce, (n−1)/n for
all-gather, reduce-scatter and all-to-all, 1 for point-to-point — so it compares with link bandwidth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Literal

from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt

from plan.records import read_json_file
from plan.section import Section

BENCH_SCHEMA_VERSION: Final = 1
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


BUS_FACTORS: dict[str, str] = {
    "all_reduce": "2(n-1)/n",
    "all_gather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "broadcast": "1",
    "reduce": "1",
    "p2p": "1",
}
"""nccl-tests' bus-bandwidth factor of each operation over n ranks (doc/PERFORMANCE.md): busbw = algbw · factor.
The one table the executor's benchmark and the twin's collective costs share."""


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor of `op` over `ranks` ranks (BUS_FACTORS); 0 for a single rank."""
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(BUS_FACTORS)}")
    if ranks <= 1:
        return 0.0
    n = ranks
    return {"2(n-1)/n": 2 * (n - 1) / n, "(n-1)/n": (n - 1) / n, "1": 1.0}[BUS_FACTORS[op]]


class GemmPoint(Section):
    """One matrix multiply (M×K)·(K×N), timed."""

    m: PositiveInt
    n: PositiveInt
    k: PositiveInt
    dtype: str
    seconds: PositiveFloat
    """Median time of one multiply (seconds)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


class OpPoint(Section):
    """The fixed host cost of one tiny op: eager, or on a DTensor (sharding propagation and dispatch)."""

    kind: Literal["eager", "dtensor"]
    seconds: PositiveFloat
    """Median time of one op on a one-element tensor (seconds)."""


class CollectivePoint(Section):
    """One collective at one size over one group, timed as nccl-tests does."""

    op: str
    ranks: PositiveInt
    """Ranks in the group (count)."""
    bytes: PositiveInt
    """nccl-tests' size convention (see the module docstring) (bytes)."""
    seconds: PositiveFloat
    """Median over iterations of the slowest rank's time (seconds)."""
    algbw_GBps: NonNegativeFloat
    busbw_GBps: NonNegativeFloat


class BenchResult(Section):
    """One `twin bench` run on one host."""

    schema_version: Literal[1] = BENCH_SCHEMA_VERSION
    device: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    world_size: PositiveInt
    host: str
    torch_version: str
    threads_per_rank: PositiveInt
    """Intra-op threads of each rank (torchrun sets 1 unless OMP_NUM_THREADS says otherwise)."""
    gemm: tuple[GemmPoint, ...] = ()
    ops: tuple[OpPoint, ...] = ()
    collectives: tuple[CollectivePoint, ...] = ()
    skipped: tuple[str, ...] = ()
    """What could not be measured here, and why."""


def read_bench(path: Path) -> BenchResult:
    """Read and validate a `bench.json`; a bad file raises RecordError naming it and the field."""
    return read_json_file(path, BenchResult, f"run `twin bench --out {path.parent}` first")
