"""How close the twin has come to published training runs of a plan's kind.

benchmarks/published_figures.py predicts every row of the published tables it holds (README, Fidelity) and writes,
beside its results, twin/published_fidelity.json: the rows no fit used, grouped by accelerator, precision and
whether the model is a mixture of experts, with their mean and 90th-percentile absolute error, how many the twin
over-predicts, and the worst. `record` finds a plan's group, so that a prediction can say what its kind of
prediction has been worth, and says why where none applies: no published run of the kind (its figures rest on
datasheets and kernel benchmarks alone), a calibrated profile, what-ifs that change the figures the runs checked,
or a missing record file.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plan.cluster import Cluster
from plan.schema import Plan

FILE = Path(__file__).with_name("published_fidelity.json")

PRECISION = {"bf16": "16-bit", "fp16": "16-bit", "fp8": "fp8"}
"""bf16 and fp16 run the same tensor-core path, so their rows are one group."""


GROUP = ("accelerator", "precision", "moe")
"""What a group is keyed by; within it, the record of each software stack (`Fidelity.stacks`)."""


def plan_class(plan: Plan, cluster: Cluster) -> dict[str, Any]:
    """The group a plan's predictions are checked in (its accelerator, precision and whether it routes experts), and
    its software stack."""
    dtype = plan.training.dtype
    return {
        "accelerator": cluster.accelerator.name,
        "precision": PRECISION.get(dtype, dtype),
        "moe": plan.model.is_moe,
        "stack": plan.stack.name,
    }


def _kind(accelerator: str, precision: str, moe: bool) -> str:
    return f"{accelerator} {precision} {'MoE' if moe else 'dense'}"


@dataclass(frozen=True)
class Fidelity:
    """The twin's error on the published runs of one group (validation rows only: no fit used them)."""

    accelerator: str
    precision: str
    moe: bool
    rows: int
    tables: tuple[str, ...]
    mean_abs_error: float
    p90_abs_error: float
    """Nine rows in ten are within this."""
    optimistic_rows: int
    """Rows the twin predicts faster than published."""
    worst: str
    worst_error: float
    """Signed: the twin's figure over the published, less one."""
    stacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The same by software stack: rows, mean absolute error, the worst row and its error."""

    @property
    def kind(self) -> str:
        return _kind(self.accelerator, self.precision, self.moe)

    def describe(self, stack: str | None = None) -> str:
        """One line; where the group holds rows of several stacks and `stack` is one of them, its own record too."""
        line = (
            f"{self.rows} published {self.kind} runs ({len(self.tables)} tables): mean |error| "
            f"{self.mean_abs_error:.1%}, nine in ten within {self.p90_abs_error:.1%}, {self.optimistic_rows} "
            f"optimistic; worst {self.worst_error:+.1%} ({self.worst})"
        )
        own = self.stacks.get(stack or "")
        if own is None or len(self.stacks) < 2:
            return line
        runs = "1 run" if own["rows"] == 1 else f"{own['rows']} runs"
        return f"{line}; on {stack}: {runs}, mean |error| {own['mean_abs_error']:.1%}, worst {own['worst_error']:+.1%}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tables": list(self.tables)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fidelity:
        return cls(**{**data, "tables": tuple(data["tables"])})


def summarise(tables: Mapping[str, Iterable[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The groups of benchmarks/published_figures.py's rows (table name to rows): each validation row that carries
    its plan's class (`plan_class`), worst group first. A row's `error` is the twin's figure over the published,
    less one, of a figure where more is better (throughput, TFLOP/s, MFU), so a positive error is optimistic."""
    groups: dict[tuple[str, str, bool], list[tuple[str, Mapping[str, Any]]]] = {}
    for table, rows in tables.items():
        for row in rows:
            if row.get("kind") == "validation" and "class" in row:
                c = row["class"]
                groups.setdefault((c["accelerator"], c["precision"], c["moe"]), []).append((table, row))
    return sorted((_group(key, members) for key, members in groups.items()), key=lambda g: -g["mean_abs_error"])


def _group(key: tuple[str, str, bool], members: list[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    accelerator, precision, moe = key
    by_stack: dict[str, list[Mapping[str, Any]]] = {}
    for _, row in members:
        by_stack.setdefault(row["class"].get("stack", ""), []).append(row)
    stacks = {}
    for stack, rows in sorted(by_stack.items()):
        worst_row = max(rows, key=lambda r: abs(r["error"]))
        stacks[stack] = {
            "rows": len(rows),
            "mean_abs_error": float(np.mean([abs(r["error"]) for r in rows])),
            "worst": worst_row["what"],
            "worst_error": float(worst_row["error"]),
        }
    errors = np.array([r["error"] for _, r in members])
    worst = max(members, key=lambda m: abs(m[1]["error"]))[1]
    return Fidelity(
        accelerator=accelerator,
        precision=precision,
        moe=moe,
        rows=len(members),
        tables=tuple(sorted({t for t, _ in members})),
        mean_abs_error=float(np.mean(np.abs(errors))),
        p90_abs_error=float(np.percentile(np.abs(errors), 90)),
        optimistic_rows=int(np.sum(errors > 0)),
        worst=worst["what"],
        worst_error=float(worst["error"]),
        stacks=stacks,
    ).to_json()


@functools.cache
def _groups() -> tuple[Fidelity, ...] | None:
    """The committed groups; None where the file is missing (a broken install or checkout)."""
    if not FILE.exists():
        return None
    data = json.loads(FILE.read_text())
    return tuple(Fidelity.from_json(g) for g in data["groups"])


def recorded() -> tuple[Fidelity, ...] | None:
    """Every group of the record, worst first; None where the file is missing."""
    return _groups()


UNCHECKED_WHAT_IFS = ("accelerator.", "compute.")
"""What-if paths that change the kernel figures the published runs checked (a swap to a named chip, `accelerator:
NAME`, is that chip's record; the memory and power fields change no speed)."""

SPEED_NEUTRAL = frozenset({"accelerator.hbm_GB", "accelerator.device_memory_GiB", "accelerator.tdp_W"})


@dataclass(frozen=True)
class Record:
    """What a prediction can say of its kind's published record: the group (`found`), or none and why (`line`)."""

    found: Fidelity | None
    line: str

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "group": self.found.to_json() if self.found else None}


def record(plan: Plan, cluster: Cluster) -> Record:
    """The twin's record on published runs of the plan's kind (`plan_class`). None is found where the cluster is a
    calibrated profile (its record is the calibration's report), where its what-ifs change the accelerator's or
    the kernels' figures, where no published run of the kind is checked, or where the record file is missing."""
    want = plan_class(plan, cluster)
    kind = _kind(*(want[k] for k in GROUP))
    changed = sorted(k for k in plan.cluster.overrides if k.startswith(UNCHECKED_WHAT_IFS) and k not in SPEED_NEUTRAL)
    if cluster.calibration is not None:
        return Record(None, "a calibrated profile: its record is its calibration's (`twin calibrate`'s report)")
    if changed:
        return Record(None, f"what-ifs change the figures the published {kind} runs checked ({', '.join(changed)})")
    groups = _groups()
    if groups is None:
        return Record(None, f"no record: {FILE} is missing (`python benchmarks/published_figures.py` writes it)")
    found = next((g for g in groups if (g.accelerator, g.precision, g.moe) == tuple(want[k] for k in GROUP)), None)
    if found is not None:
        return Record(found, found.describe(want["stack"]))
    if cluster.accelerator.kind == "cpu":
        return Record(None, f"no published {kind} run is checked; `twin calibrate` on runs of your own is the check")
    alone = "its figures rest on datasheets and kernel benchmarks alone"
    return Record(None, f"no published {kind} run is checked: {alone}")
