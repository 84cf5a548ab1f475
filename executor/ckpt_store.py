"""Checkpoint directories on storage: staging, atomic commit, a manifest of checksums, retention, latest good.

A checkpoint is written into `<root>/.tmp-step_NNNNNNNN/` and, once every rank's files are there, rank 0 writes
`checkpoint.json` (the step, the layout and a sha256 per file) and renames the directory to `step_NNNNNNNN/`,
where NNNNNNNN is the next step to run. A rename within one file system is atomic, so a crash mid-write leaves a
staging directory that resume ignores and the next start deletes, never a half-committed checkpoint. A
committed one whose files no longer match their checksums is corrupt: resume skips it with a warning naming it.
Plain file operations only, so this module needs no process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "checkpoint.json"
PREFIX = "step_"
STAGING = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read, naming the path and the fix."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: where it is and what its manifest says."""

    path: Path
    step: int
    """The next step to run after loading it."""
    manifest: dict[str, Any]


def final_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    return root / f"{STAGING}{PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_checksums(directory: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under `directory` but the manifest, by relative path."""
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        out[str(path.relative_to(directory))] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
    return out


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staging: Path, final: Path, facts: dict[str, Any]) -> Path:
    """Write the manifest into `staging`, then rename it to `final` (atomic on one file system)."""
    manifest = {**facts, "committed_unix": time.time(), "files": file_checksums(staging)}
    tmp = staging / f"{MANIFEST}.tmp"
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(staging / MANIFEST)
    if final.exists():  # the same step committed by an earlier attempt: the new one replaces it
        shutil.rmtree(final)
    staging.rename(final)
    _fsync_dir(final.parent)
    return final


def verify(directory: Path) -> str | None:
    """None if `directory` is a complete, intact checkpoint; else what is wrong with it."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"no readable manifest ({exc})"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


def committed(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root`, newest (highest step) first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]), reverse=True)


def read_info(directory: Path) -> CheckpointInfo:
    """The manifest of a checkpoint directory, checked; CheckpointError names the directory and the problem."""
    problem = verify(directory)
    if problem:
        raise CheckpointError(f"checkpoint {directory}: {problem}; pick another checkpoint or start afresh")
    manifest = json.loads((directory / MANIFEST).read_text())
    return CheckpointInfo(directory, int(manifest["step"]), manifest)


def latest_good(root: Path) -> CheckpointInfo | None:
    """The newest intact checkpoint under `root`; each corrupt one passed over gets a warning naming it."""
    for directory in committed(root):
        problem = verify(directory)
        if problem is None:
            return read_info(directory)
        print(f"warning: skipping corrupt checkpoint {directory}: {problem}", file=sys.stderr, flush=True)
    return None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints; the ones deleted."""
    old = committed(root)[keep:]
    for directory in old:
        shutil.rmtree(directory, ignore_errors=True)
    return old


def clean_staging(root: Path) -> None:
    """Remove staging directories that a crashed write left behind."""
    if root.is_dir():
        for directory in root.iterdir():
            if directory.name.startswith(STAGING):
                shutil.rmtree(directory, ignore_errors=True)
