"""The stack catalogue (`plan/presets/stacks/`): software stacks by name or path, with what-if overrides applied as
cluster what-ifs are (plan/clusters.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from plan.clusters import WhatIf, load_what_if
from plan.files import resolve_file
from plan.stack import Stack

STACK_DIR = Path(__file__).resolve().parent / "presets" / "stacks"


def stack_names() -> list[str]:
    """Names of the stacks in plan/presets/stacks/."""
    return sorted(p.stem for p in STACK_DIR.glob("*.yaml"))


def resolve_stack_path(name: str, relative_to: Path | None = None) -> Path:
    """The file of a stack name (plan/presets/stacks/NAME.yaml) or path (absolute, or relative to the plan)."""

    def unknown() -> str:
        return f"stack: unknown stack {name!r}; name one of {', '.join(stack_names())} or give a path to a stack YAML"

    return resolve_file(name, STACK_DIR, relative_to, unknown)


def load_stack_what_if(
    name: str, overrides: Mapping[str, Any] | None = None, relative_to: Path | None = None
) -> tuple[Stack, WhatIf]:
    """A stack by name or path with what-if overrides applied, and what they did."""
    return load_what_if(Stack, resolve_stack_path(name, relative_to), overrides)


def load_stack(name: str, overrides: Mapping[str, Any] | None = None, relative_to: Path | None = None) -> Stack:
    """Load and validate a stack by name or path, with optional what-if overrides."""
    return load_stack_what_if(name, overrides, relative_to)[0]
