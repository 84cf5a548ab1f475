"""What a run writes: the manifest, one record line per step per rank, and rank 0's job-wide figures.

Every rank appends to the same `records.jsonl` through an O_APPEND descriptor with one `write` per line, so
lines from different ranks never interleave (Linux appends a single write to a regular file atomically with
respect to other appenders) and each step is on disk before the next begins: a crash loses nothing written.
"""

from __future__ import annotations

import hashlib
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from executor.contract import what_runs
from plan.cluster import Cluster
from plan.model_math import mfu
from plan.records import DataVersion, EventRecord, LayerStatsRecord, RunManifest, StepRecord
from plan.schema import Plan

STRAGGLER_THRESHOLD = 0.2  # 20% slower than its cohort's median; shared 2-core VMs jitter by ~5% (localhost-cpu)
REPO_ROOT = Path(__file__).resolve().parent.parent

Record = StepRecord | EventRecord | LayerStatsRecord


class RecordWriter:
    """Appends records to `records.jsonl`, one whole line per write."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: Record) -> None:
        os.write(self.fd, (record.model_dump_json() + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


def peak_flops_per_rank(cluster: Cluster, dtype: str, ranks_on_node: int) -> float:
    """The peak FLOP/s one rank can reach (FLOP/s).

    For a GPU, the accelerator's dense peak for the dtype. For a `cpu` accelerator the peak is per core and the
    node's cores are shared: a rank gets peak × min(1, cores / ranks on the node) — the twin's convention.
    """
    peaks = cluster.accelerator.peak_tflops
    peak = peaks.get(dtype, peaks["bf16"]) * 1e12
    if cluster.accelerator.kind == "cpu":
        peak *= min(1.0, cluster.node.cpu_cores / max(1, ranks_on_node))
    return peak


def stragglers(busy_s: list[float], cohorts: list[int], threshold: float = STRAGGLER_THRESHOLD) -> tuple[int, ...]:
    """Ranks whose busy time exceeds their cohort's median by more than `threshold` (a fraction).

    Cohorts are ranks doing the same work (the same pipeline stage). Busy time, not wall time, is compared:
    the step's collectives make every rank wait for the slowest, so wall times come out equal.
    """
    out: list[int] = []
    for cohort in sorted(set(cohorts)):
        members = [r for r, c in enumerate(cohorts) if c == cohort]
        median = statistics.median(busy_s[r] for r in members)
        out.extend(r for r in members if busy_s[r] > median * (1 + threshold) and len(members) > 1)
    return tuple(sorted(out))


def job_figures(plan: Plan, step_s: list[float], peak_per_rank: float) -> dict[str, float]:
    """Rank 0's job-wide figures of one step: tokens/s (over the slowest rank's step time), MFU and spread."""
    slowest = max(step_s)
    tokens_per_s = plan.tokens_per_step / slowest if slowest > 0 else 0.0
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, plan.model, len(step_s), peak_per_rank),
        "step_spread_s": slowest - min(step_s),
    }


def peak_memory_MB(device: torch.device) -> float:
    """Peak device memory allocated (CUDA), or the process's peak resident set (CPU) (1e6 bytes)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # Linux reports KiB


def git_state() -> tuple[str | None, bool]:
    """(commit, dirty) of the checkout the code runs from, or (None, False) outside git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, False
    return commit or None, bool(status.strip())


def build_manifest(
    run_id: str,
    plan: Plan,
    device: str,
    world: int,
    hosts: list[str],
    data: DataVersion,
    command: list[str],
    mixed: bool | None = None,
) -> RunManifest:
    commit, dirty = git_state()
    canonical = plan.model_dump_json().encode()
    return RunManifest(
        run_id=run_id,
        created_unix=time.time(),
        plan=plan,
        ran=what_runs(plan, device, mixed),
        plan_sha256=hashlib.sha256(canonical).hexdigest(),
        git_commit=commit,
        git_dirty=dirty,
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        device="cuda" if device == "cuda" else "cpu",
        backend="nccl" if device == "cuda" else "gloo",
        world_size=world,
        hosts=tuple(hosts),
        data=data,
        command=tuple(command),
    )


def write_manifest(manifest: RunManifest, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "manifest.json.tmp"
    tmp.write_text(manifest.model_dump_json(indent=1))
    tmp.replace(run_dir / "manifest.json")


def hostname() -> str:
    return socket.gethostname()


def command_line() -> list[str]:
    return [sys.executable, *sys.argv]
