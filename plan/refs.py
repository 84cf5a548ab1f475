"""What a plan names by reference: a cluster and a software stack, each a catalogue entry or a file, with what-if
changes to its fields (applied and validated by plan/clusters.py and plan/stacks.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from plan.section import UserSection


class Ref(UserSection):
    """A file the plan names — a catalogue entry or a path — and what-if changes to its fields."""

    name: str
    overrides: dict[str, Any] = Field(default_factory=dict)
    """What-ifs: dotted field paths of the file and their new values (see plan/clusters.py)."""

    def __str__(self) -> str:
        if not self.overrides:
            return self.name
        return f"{self.name} ({', '.join(f'{k}={v}' for k, v in self.overrides.items())})"


class ClusterRef(Ref):
    """The cluster a plan runs on: a catalogue name or a file, and what-if changes to its fields."""

    name: str
    """A file name in topologies/ (without .yaml), calibrated/NAME, or a path to a cluster file."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """What-ifs: dotted field paths of the cluster file and their new values, e.g. `nodes: 560`,
    `fabric.tiers.leaf.bandwidth_GBps: 100`, `failures.rate_scale: 0.5` (see plan/clusters.py)."""


DEFAULT_STACK = "megatron-core-0.8"


class StackRef(Ref):
    """The software stack a plan runs under (plan/stack.py): a name in plan/presets/stacks/ or a file, and
    what-if changes to its fields."""

    name: str = DEFAULT_STACK
    """A stack in plan/presets/stacks/ (without .yaml) or a path to a stack file; default: Megatron-Core 0.8
    with Transformer Engine."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """What-ifs: dotted field paths of the stack file and their new values, e.g. `tp_overlap: none`."""
