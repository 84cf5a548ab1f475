"""Where commands write: a path the user gave, resolved against the directory they ran the command in and checked
before any work starts, so a bad `--out` or `--trace` is one line at once instead of a traceback (or eight ranks'
tracebacks) after the work is done."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from plan.errors import PlanError


def output_dir(path: Path, option: str) -> Path:
    """`path` as an absolute directory, created if missing and proven writable (a file is written and removed);
    PlanError naming `option` otherwise."""
    path = Path(os.path.abspath(path))  # absolute against the user's directory, symlinks kept as given
    if path.exists() and not path.is_dir():
        raise PlanError(f"{option} {path}: exists and is not a directory; give a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".twin-write-check-"):
            pass
    except OSError as exc:
        raise PlanError(
            f"{option} {path}: cannot write there ({exc.strerror or exc}); choose a writable directory"
        ) from None
    return path


def output_file(path: Path, option: str) -> Path:
    """`path` as an absolute file path whose directory exists and is writable; PlanError naming `option` otherwise.
    Nothing is created."""
    path = Path(os.path.abspath(path))
    if path.is_dir():
        raise PlanError(f"{option} {path}: is a directory; give a file path, e.g. {path / 'step.json'}")
    parent = path.parent
    if not parent.is_dir():
        raise PlanError(f"{option} {path}: directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PlanError(f"{option} {path}: not writable; choose a path you can write")
    return path
