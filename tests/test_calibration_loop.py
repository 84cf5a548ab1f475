"""`twin bench` and `twin loop` end to end on this machine's gloo ranks (slow: they start torchrun gangs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plan.bench import COLLECTIVES, bus_factor, read_bench
from twin.cli.app import app

PLANS = Path(__file__).resolve().parent.parent / "plans" / "cpu-calibration"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_measures_every_collective_in_the_nccl_tests_convention(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "--ranks", "2", "--quick", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    bench = read_bench(tmp_path / "bench.json")
    assert {p.op for p in bench.collectives} == set(COLLECTIVES)
    for p in bench.collectives:
        assert p.algbw_GBps == pytest.approx(p.bytes / p.seconds / 1e9)
        assert p.busbw_GBps == pytest.approx(p.algbw_GBps * bus_factor(p.op, p.ranks))
    kinds = {p.kind: p.seconds for p in bench.ops}
    assert 0 < kinds["eager"] < kinds["dtensor"]  # DTensor's sharding propagation costs more than a plain op
    fitted = json.loads(result.output.strip().splitlines()[-1])["fitted"]
    assert 0 < fitted["compute.gemm_peak_fraction.fp32"] <= 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_loop_executes_calibrates_and_reports(tmp_path: Path) -> None:
    plans = [str(PLANS / "01-dp2.yaml"), str(PLANS / "03-pp2-1f1b.yaml"), str(PLANS / "02-tp2.yaml")]
    args = ["loop", *plans, "--holdout", "1", "--repeats", "1", "--steps", "4", "--out", str(tmp_path), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["role"] for r in rows["rows"]] == ["fit", "fit", "held out"]
    assert all(r["measured_s"] > 0 and r["low_s"] <= r["after_s"] <= r["high_s"] for r in rows["rows"])
    assert "held out" in (tmp_path / "report.md").read_text()
    assert "plotly" in (tmp_path / "report.html").read_text()
    assert (tmp_path / "localhost-cpu.yaml").exists()
