"""What every `twin` command shares: its option types, its consoles and its one error path.

Every command takes a plan path or preset name, repeatable `--set section.field=value` overrides and `--json`
(exactly one JSON object on stdout). Bad input prints one line naming the file, field and fix, and exits 2.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from plan.limits import Limits
from plan.loader import PlanError
from plan.records import RecordError

# User text (plan names, paths, messages that quote what the user wrote) is never read as Rich markup or emoji
# codes: `[/]` or `a:b:` prints as written. Styled words are `Text` spans (see `styled`).
# Piped or redirected, Rich would lay tables out in 80 columns and cut their cells to "1,…"; a file has no width,
# so it gets one wide enough for the widest table (the search's), unless COLUMNS says otherwise.
WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
console = Console(markup=False, emoji=False, highlight=False, width=WIDTH)
err_console = Console(stderr=True, markup=False, emoji=False, highlight=False, width=WIDTH)


def styled(*parts: str | tuple[str, str]) -> Text:
    """A line of plain parts and (text, style) parts; no part is parsed as markup."""
    return Text.assemble(*parts)


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
LimitOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--limit",
        help="Raise a limit on what the command reads or simulates: NAME=VALUE (repeatable), e.g. step_actions=200000; "
        "names: " + ", ".join(f"{k} ({v:,})" for k, v in Limits().__dict__.items()) + ".",
    ),
]
AllowOomOpt = Annotated[
    bool,
    typer.Option("--allow-oom", help="Go on with a plan that does not fit in memory (it is reported, not refused)."),
]
BenchOpt = Annotated[Path | None, typer.Option("--bench", help="A bench.json from `twin bench`: where the fit starts.")]

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F) -> F:
    """Turn bad input into one line on stderr (or a JSON error object with --json) and exit code 2."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (PlanError, RecordError) as exc:
            fail(str(exc), bool(kwargs.get("as_json")))
        except OSError as exc:  # a file the command writes or reads outside the plan loader: name it, no traceback
            where = f"{exc.filename}: " if exc.filename else ""
            fail(f"{where}{exc.strerror or exc}; check the path and its permissions", bool(kwargs.get("as_json")))

    return wrapper  # type: ignore[return-value]


def fail(message: str, as_json: bool) -> NoReturn:
    """Report `message` as the command's one error line (or one JSON object) and exit 2."""
    message = message.replace("\r", "\\r").replace("\n", "\\n")
    if as_json:
        print(json.dumps({"ok": False, "error": message}))
    else:
        err_console.print(styled(("error:", "bold red"), " ", message), soft_wrap=True)
    raise typer.Exit(2)


def limits_from(items: list[str] | None) -> Limits:
    """The limits `--limit NAME=VALUE` items set (the defaults for the rest)."""
    return Limits.parse(items or [])


def _plain(value: Any) -> Any:
    """JSON for what json cannot write: numpy numbers as numbers, anything else (paths) as text."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def emit_json(obj: Any) -> None:
    """Write one JSON object to stdout."""
    sys.stdout.write(json.dumps(obj, default=_plain) + "\n")
