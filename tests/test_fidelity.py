"""A prediction's record on published runs of its kind (twin/fidelity.py): the grouping, the lookup, and what the
command line shows. That the committed file matches today's tables is tests/test_published.py's."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from twin import api
from twin.cli.app import app
from twin.fidelity import published_fidelity, record_line, summarise

H100_DENSE = {"accelerator": "H100 SXM5 80GB", "precision": "16-bit", "moe": False}
H100_MOE = {**H100_DENSE, "moe": True}


def _row(what: str, error: float, cls: dict[str, Any] | None, kind: str = "validation") -> dict[str, Any]:
    row: dict[str, Any] = {"what": what, "error": error, "kind": kind}
    if cls is not None:
        row["class"] = cls
    return row


def test_groups_hold_validation_rows_only_and_the_worst_group_comes_first() -> None:
    dense = [0.02, -0.10, 0.04, 0.01]
    groups = summarise(
        {
            "a": [_row(f"dense {i}", e, H100_DENSE) for i, e in enumerate(dense)]
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


def test_a_plan_finds_its_group_and_a_precision_or_accelerator_without_one_finds_none() -> None:
    plan = api.load_plan("llama3-405b-16k")
    found = published_fidelity(plan, api.cluster_of(plan))
    assert found is not None
    assert (found.accelerator, found.precision, found.moe) == ("H100 SXM5 80GB", "16-bit", False)
    assert found.rows >= 20 and found.mean_abs_error < found.p90_abs_error
    assert record_line(plan, api.cluster_of(plan)) == found.describe()
    fp8 = api.load_plan("llama3-405b-16k", ["training.dtype=fp8"])
    got = published_fidelity(fp8, api.cluster_of(fp8))
    assert got is not None and got.precision == "fp8" and got.rows != found.rows
    b200 = api.load_plan("gpt-1b-h100", ["cluster=hgx-b200-superpod"])
    assert published_fidelity(b200, api.cluster_of(b200)) is None
    assert "no published" in record_line(b200, api.cluster_of(b200))
    assert "datasheets" in record_line(b200, api.cluster_of(b200))
    cpu = api.load_plan("cpu-tiny")
    assert "twin calibrate" in record_line(cpu, api.cluster_of(cpu))


def test_predict_shows_the_record_and_puts_it_in_its_json() -> None:
    runner = CliRunner()
    text = runner.invoke(app, ["predict", "gpt-1b-h100"])
    assert text.exit_code == 0, text.output
    assert "checked on" in text.stdout and "published H100 SXM5 80GB" in text.stdout
    obj = json.loads(runner.invoke(app, ["predict", "gpt-1b-h100", "--json"]).stdout)
    record = obj["published_fidelity"]
    assert record["accelerator"] == "H100 SXM5 80GB" and record["rows"] > 0
    cpu = json.loads(runner.invoke(app, ["predict", "cpu-tiny", "--json"]).stdout)
    assert cpu["published_fidelity"] is None
