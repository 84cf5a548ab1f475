"""A prediction's record on published runs of its kind (twin/fidelity.py): the grouping, the lookup, when no record
applies and why, and what the command line shows. That the committed file matches today's tables is
tests/test_published.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from twin import api, fidelity
from twin.cli.app import app
from twin.fidelity import summarise

H100_DENSE = {"accelerator": "H100 SXM5 80GB", "precision": "16-bit", "moe": False, "stack": "nemo-24.12"}
H100_MOE = {**H100_DENSE, "moe": True}
ON_MCORE = {**H100_DENSE, "stack": "megatron-core-0.8"}


def _row(what: str, error: float, cls: dict[str, Any] | None, kind: str = "validation") -> dict[str, Any]:
    row: dict[str, Any] = {"what": what, "error": error, "kind": kind}
    if cls is not None:
        row["class"] = cls
    return row


def _strict(text: str) -> Any:
    """JSON as strict parsers (jq, browsers) read it: NaN and Infinity are not JSON."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_groups_hold_validation_rows_only_and_the_worst_group_comes_first() -> None:
    dense = [0.02, -0.10, 0.04, 0.01]
    groups = summarise(
        {
            "a": [_row(f"dense {i}", e, H100_DENSE if i < 2 else ON_MCORE) for i, e in enumerate(dense)]
            + [_row("fitted", 0.5, H100_DENSE, kind="fit"), _row("bus bandwidth", 0.5, None, kind="consistency")],
            "b": [_row("moe 0", 0.2, H100_MOE), _row("no class", 0.9, None)],
        }
    )
    assert [g["moe"] for g in groups] == [True, False]  # 20% mean before 4.25%
    moe, d = groups
    assert moe["rows"] == 1 and moe["tables"] == ["b"] and moe["worst_error"] == pytest.approx(0.2)
    assert d["rows"] == 4 and d["tables"] == ["a"]
    assert d["mean_abs_error"] == pytest.approx(np.mean(np.abs(dense)))
    assert d["p90_abs_error"] == pytest.approx(np.percentile(np.abs(dense), 90))
    assert d["optimistic_rows"] == 3
    assert (d["worst"], d["worst_error"]) == ("dense 1", pytest.approx(-0.10))  # by size, sign kept
    nemo, mcore = d["stacks"]["nemo-24.12"], d["stacks"]["megatron-core-0.8"]  # the same, stack by stack
    assert (nemo["rows"], nemo["mean_abs_error"], nemo["worst"]) == (2, pytest.approx(0.06), "dense 1")
    assert (mcore["rows"], mcore["mean_abs_error"], mcore["worst"]) == (2, pytest.approx(0.025), "dense 2")
    group = fidelity.Fidelity.from_json(d)
    assert group.describe("megatron-core-0.8").endswith("on megatron-core-0.8: 2 runs, mean |error| 2.5%, worst +4.0%")
    assert group.describe("executor") == group.describe()  # a stack no row ran adds nothing
    single = fidelity.Fidelity.from_json({**d, "stacks": {**d["stacks"], "llama3": {**mcore, "rows": 1}}})
    assert "; on llama3: 1 run, mean |error| 2.5%" in single.describe("llama3")
    one = fidelity.Fidelity.from_json(moe)
    assert one.describe("nemo-24.12") == one.describe()  # one stack: the group's record is its own


def test_a_plan_finds_its_group_and_a_precision_or_accelerator_without_one_finds_none() -> None:
    checked = api.published_fidelity("llama3-405b-16k")
    found = checked.found
    assert found is not None
    assert (found.accelerator, found.precision, found.moe) == ("H100 SXM5 80GB", "16-bit", False)
    assert found.rows >= 20 and found.mean_abs_error < found.p90_abs_error
    assert checked.line == found.describe("llama3") and "; on llama3: 3 runs" in checked.line  # Table 4's rows
    fp8 = api.published_fidelity(api.load_plan("llama3-405b-16k", ["training.dtype=fp8"])).found
    assert fp8 is not None and fp8.precision == "fp8" and fp8.rows != found.rows
    b200 = api.published_fidelity(api.load_plan("gpt-1b-h100", ["cluster=hgx-b200-superpod"]))
    assert b200.found is None and "no published B200" in b200.line and "datasheets" in b200.line
    assert "twin calibrate" in api.published_fidelity("cpu-tiny").line


@pytest.mark.parametrize(
    ("what_if", "named"),
    [
        ({"compute.gemm_peak_fraction.bf16": 0.3}, "compute.gemm_peak_fraction.bf16"),
        ({"accelerator.peak_tflops.bf16": 500}, "accelerator.peak_tflops.bf16"),
    ],
)
def test_what_ifs_on_the_kernels_quote_no_record(what_if: dict[str, Any], named: str) -> None:
    checked = api.published_fidelity(_on_h100(what_if))
    assert checked.found is None and named in checked.line
    assert api.published_fidelity(_on_h100({"nodes": 4})).found is not None  # a smaller fleet is the same kind
    assert api.published_fidelity(_on_h100({"accelerator.hbm_GB": 96})).found is not None  # no kernel is faster


def _on_h100(what_if: dict[str, Any]) -> Any:
    """gpt-1b-h100 on the DGX H100 SuperPOD with a what-if on the cluster."""
    data = api.load_plan("gpt-1b-h100").model_dump(mode="json")
    return api.load_plan({**data, "cluster": {"name": "dgx-h100-superpod", "overrides": what_if}})


def test_a_calibrated_profile_quotes_its_calibration() -> None:
    calibrated = sorted((Path(__file__).resolve().parent.parent / "topologies" / "calibrated").glob("*.yaml"))
    assert calibrated, "the repo ships calibrated profiles"
    plan = api.load_plan("cpu-tiny", [f"cluster=calibrated/{calibrated[0].stem}"])
    checked = api.published_fidelity(plan)
    assert checked.found is None and "calibrated profile" in checked.line


def test_a_missing_record_file_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(fidelity, "FILE", tmp_path / "gone.json")
    fidelity._groups.cache_clear()
    try:
        checked = api.published_fidelity("llama3-405b-16k")
        assert checked.found is None and "gone.json is missing" in checked.line and "datasheets" not in checked.line
    finally:
        fidelity._groups.cache_clear()


def test_predict_and_search_show_the_record_and_put_it_in_their_json() -> None:
    runner = CliRunner()
    text = runner.invoke(app, ["predict", "gpt-1b-h100"])
    assert text.exit_code == 0, text.output
    assert "checked on" in text.stdout and "published H100 SXM5 80GB" in text.stdout
    record = _strict(runner.invoke(app, ["predict", "gpt-1b-h100", "--json"]).stdout)["published_fidelity"]
    assert record["group"]["accelerator"] == "H100 SXM5 80GB" and record["group"]["rows"] > 0
    assert record["line"].startswith(f"{record['group']['rows']} published")
    cpu = _strict(runner.invoke(app, ["predict", "cpu-tiny", "--json"]).stdout)["published_fidelity"]
    assert cpu["group"] is None and "twin calibrate" in cpu["line"]
    args = ["search", "llama3-8b", "--cluster", "dgx-h100-superpod", "--gpus", "8", "--batch-tokens", "524288",
            "--top", "1", "--workers", "1", "--fix", "layout.cp=1", "--json"]  # fmt: skip
    found = _strict(runner.invoke(app, args).stdout)["published_fidelity"]
    assert found["group"]["accelerator"] == "H100 SXM5 80GB"


def test_a_whole_run_names_the_record_of_the_step_it_is_built_on() -> None:
    runner = CliRunner()
    one = runner.invoke(app, ["run", "gpt-1b-h100"])
    assert one.exit_code == 0, one.output
    assert "step checked on" in one.stdout and "published H100 SXM5 80GB" in one.stdout
    many = runner.invoke(app, ["run", "cpu-tiny", "--seeds", "2"])
    assert many.exit_code == 0, many.output
    assert "step checked on: no published" in many.stdout and "twin calibrate" in many.stdout


def test_the_fidelity_command_lists_every_group_and_a_plans_record(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runner = CliRunner()
    groups = fidelity.recorded()
    assert groups
    listing = _strict(runner.invoke(app, ["fidelity", "--json"]).stdout)["groups"]
    assert listing == [g.to_json() for g in groups]
    text = runner.invoke(app, ["fidelity"])
    assert text.exit_code == 0 and all(f"{g.mean_abs_error:.1%}" in text.stdout for g in groups)
    mine = _strict(runner.invoke(app, ["fidelity", "llama3-405b-16k", "--set", "training.dtype=fp8", "--json"]).stdout)
    want = api.published_fidelity(api.load_plan("llama3-405b-16k", ["training.dtype=fp8"])).to_json()
    assert {k: mine[k] for k in ("line", "group")} == want and want["group"]["precision"] == "fp8"
    monkeypatch.setattr(fidelity, "FILE", tmp_path / "gone.json")
    monkeypatch.setattr("twin.cli.fidelity_cmd.FILE", tmp_path / "gone.json")
    fidelity._groups.cache_clear()
    try:
        gone = runner.invoke(app, ["fidelity"])
        assert gone.exit_code == 2 and "gone.json is missing" in gone.stderr
    finally:
        fidelity._groups.cache_clear()
