"""What every `twin` command shares: its option types, its consoles and its one error path.

Every command takes a plan path or preset name, repeatable `--set section.field=value` overrides and `--json`
(exactly one JSON object on stdout). Bad input prints one line naming the file, field and fix, and exits 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from plan.loader import PlanError
from plan.records import RecordError

console = Console()
err_console = Console(stderr=True)

PlanArg = Annotated[str, typer.Argument(help="A plan YAML path or a preset name (see `twin presets`).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a field: section.field=value (repeatable), e.g. layout.tp=4 or cluster.nodes=560.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]
BenchOpt = Annotated[Path | None, typer.Option("--bench", help="A bench.json from `twin bench`: where the fit starts.")]

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F) -> F:
    """Turn bad input into one line on stderr (or a JSON error object with --json) and exit code 2."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (PlanError, RecordError) as exc:
            if kwargs.get("as_json"):
                print(json.dumps({"ok": False, "error": str(exc)}))
            else:
                err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _plain(value: Any) -> Any:
    """JSON for what json cannot write: numpy numbers as numbers, anything else (paths) as text."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def emit_json(obj: Any) -> None:
    """Write one JSON object to stdout."""
    sys.stdout.write(json.dumps(obj, default=_plain) + "\n")
