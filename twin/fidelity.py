"""How close the twin has come to published training runs of a plan's kind.

benchmarks/published_figures.py predicts every row of the published tables it holds (README, Fidelity) and writes,
beside its results, twin/published_fidelity.json: the rows no fit used, grouped by accelerator, precision and
whether the model is a mixture of experts, with their mean and 90th-percentile absolute error, how many the twin
over-predicts, and the worst. `published_fidelity` finds a plan's group, so that a prediction can say what its kind
of prediction has been worth; a plan on an accelerator or precision no published run checks gets none, and the
command line says that its figures rest on datasheets and kernel benchmarks alone.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plan.cluster import Cluster
from plan.schema import Plan

FILE = Path(__file__).with_name("published_fidelity.json")

PRECISION = {"bf16": "16-bit", "fp16": "16-bit", "fp8": "fp8"}
"""bf16 and fp16 run the same tensor-core path, so their rows are one group."""


def plan_class(plan: Plan, cluster: Cluster) -> dict[str, Any]:
    """The group a plan's predictions are checked in: its accelerator, precision and whether it routes experts."""
    dtype = plan.training.dtype
    return {"accelerator": cluster.accelerator.name, "precision": PRECISION.get(dtype, dtype), "moe": plan.model.is_moe}


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

    @property
    def kind(self) -> str:
        return _kind(self.accelerator, self.precision, self.moe)

    def describe(self) -> str:
        return (
            f"{self.rows} published {self.kind} runs ({len(self.tables)} tables): mean |error| "
            f"{self.mean_abs_error:.1%}, nine in ten within {self.p90_abs_error:.1%}, {self.optimistic_rows} "
            f"optimistic; worst {self.worst_error:+.1%} ({self.worst})"
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tables": list(self.tables)}


def summarise(tables: Mapping[str, Iterable[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The groups of benchmarks/published_figures.py's rows (table name to rows): each validation row that carries
    its plan's class (`plan_class`), worst group first."""
    groups: dict[tuple[str, str, bool], list[tuple[str, Mapping[str, Any]]]] = {}
    for table, rows in tables.items():
        for row in rows:
            if row.get("kind") == "validation" and "class" in row:
                c = row["class"]
                groups.setdefault((c["accelerator"], c["precision"], c["moe"]), []).append((table, row))
    out = []
    for (accelerator, precision, moe), members in groups.items():
        errors = np.array([r["error"] for _, r in members])
        worst = max(members, key=lambda m: abs(m[1]["error"]))[1]
        fid = Fidelity(
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
        )
        out.append(fid.to_json())
    return sorted(out, key=lambda g: -g["mean_abs_error"])


@functools.cache
def _groups() -> tuple[Fidelity, ...]:
    if not FILE.exists():
        return ()
    data = json.loads(FILE.read_text())
    return tuple(Fidelity(**{**g, "tables": tuple(g["tables"])}) for g in data["groups"])


def published_fidelity(plan: Plan, cluster: Cluster) -> Fidelity | None:
    """The twin's record on published runs of the plan's kind (`plan_class`), or None where none was checked."""
    want = plan_class(plan, cluster)
    return next(
        (
            g
            for g in _groups()
            if (g.accelerator, g.precision, g.moe) == (want["accelerator"], want["precision"], want["moe"])
        ),
        None,
    )


def record_line(plan: Plan, cluster: Cluster) -> str:
    """One line for a prediction's readers: the record of its kind, or that no published run of its kind is
    checked."""
    found = published_fidelity(plan, cluster)
    if found is not None:
        return found.describe()
    kind = _kind(**plan_class(plan, cluster))
    if cluster.accelerator.kind == "cpu":
        return f"no published {kind} run is checked; `twin calibrate` on runs of your own is the check"
    return f"no published {kind} run is checked: its figures rest on datasheets and kernel benchmarks alone"
