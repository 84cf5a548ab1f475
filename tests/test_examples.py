"""The README's simulate-then-execute example runs end to end, through the public API, and reports what the
records say."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from plan.records import StepRecord, iter_records

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a real 8-rank gang for a few steps: about 30 s on 2 cores
@pytest.mark.timeout(600)
def test_simulate_then_execute_example(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "examples" / "simulate_then_execute.py"), "--steps", "4", "--out", str(out)]
    proc = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=500, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    # the measured step is the slowest rank's step, averaged over the steps after the two warm-up steps
    steps: dict[int, list[float]] = {}
    for r in iter_records(out / "records.jsonl"):
        if isinstance(r, StepRecord) and r.step >= 2:
            steps.setdefault(r.step, []).append(r.step_s)
    assert rows["measured_s"] == pytest.approx(statistics.mean(max(v) for v in steps.values()), rel=1e-9)
    assert rows["error_calibrated"] == pytest.approx(rows["predicted_calibrated_s"] / rows["measured_s"] - 1)
    # on CPU the plan runs in fp32: priced as it ran, it costs more than as written (bf16)
    assert rows["predicted_as_ran_s"] > rows["predicted_as_written_s"] > 0
