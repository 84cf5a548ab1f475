"""The executor as a user runs it: bad input exits 2 in one line, a diverging run stops naming step and rank,
and the GPU benchmark script runs (its CPU smoke mode here, the real thing where CUDA is present)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plan.records import EventRecord, StepRecord, iter_records
from twin.cli.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
SINGLE = ["--set", "layout.dp=1", "--set", "layout.tp=1", "--set", "layout.pp=1"]


def executor(args: list[str], tmp: Path, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    """`python -m executor.train ...` as a world of one (no torchrun), on a free loopback port."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-m", "executor.train", *args]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_world_size_mismatch_is_one_line_with_the_fix(tmp_path: Path) -> None:
    result = executor(["--plan", "cpu-tiny", "--steps", "1"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: layout: the plan needs dp·tp·pp·cp = 8 ranks but 1 were started; "
        "launch with torchrun --nproc-per-node 8 (twin execute does this)"
    ]


def test_bad_plan_is_one_line(tmp_path: Path) -> None:
    result = executor(["--plan", "cpu-tiny", "--set", "layout.tp=3"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "layout.tp: 3 does not divide model.heads=4" in result.stderr


def test_non_finite_loss_stops_the_run_naming_step_and_rank(tmp_path: Path) -> None:
    # Plain SGD at lr 1e30 without clipping blows the weights up within a couple of updates.
    diverge = ["--set", "training.optimizer=sgd", "--set", "training.lr=1e30", "--set", "training.grad_clip=0"]
    diverge += ["--set", "training.warmup_steps=0"]
    result = executor(["--plan", "cpu-tiny", *SINGLE, *diverge, "--steps", "5", "--out", "run"], tmp_path)
    assert result.returncode == 3, result.stderr[-2000:]
    found = re.search(
        r"error: non-finite (loss|gradient norm) \(.+\) at step (\d+) on rank 0; the run stops", result.stderr
    )
    assert found, result.stderr[-2000:]
    bad_step = int(found.group(2))
    records = list(iter_records(tmp_path / "run" / "records.jsonl"))
    assert [r.step for r in records if isinstance(r, StepRecord)] == list(range(bad_step))  # nothing after it
    events = [r for r in records if isinstance(r, EventRecord) and r.event == "non-finite"]
    assert [(e.step, e.rank) for e in events] == [(bad_step, 0)] and 0 < bad_step < 5


@pytest.mark.slow  # a launch, 4 s
def test_gpu_benchmark_script_smoke_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "executor_gpu.py"), "--device", "cpu", "--tiny"]
    cmd += ["--steps", "2", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["tokens_per_s"] > 0 and 0 < figures["mfu"] < 1 and figures["device"] == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_benchmark_one_billion_bf16(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "executor_gpu.py"), "--steps", "12", "--warmup", "6"]
    result = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=1200, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["tokens_per_s"] > 0 and figures["mfu"] > 0.2  # a floor that catches fp32 or eager fallbacks
