"""Fleet comparison (twin/search/fleet.py): each fleet at its own best layout, its whole run, the reasons a fleet
cannot run; a cluster's own software stack; `twin fleet` and `twin search --sweep cluster=...`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from plan import loader
from twin import api
from twin.cli.app import app

MODEL = "llama3-8b"
SEARCH = {"gpus": 16, "batch_tokens": 2**20, "fixes": ["layout.cp=1", "layout.microbatch_size=1"], "workers": 1}


@pytest.fixture(scope="module")
def table() -> object:
    return api.compare_fleets(MODEL, ["dgx-h100-superpod", "dgx-a100-superpod", "single-h100", "no-such"], **SEARCH)


def test_each_fleet_runs_its_own_best_layout_and_its_whole_run(table: object) -> None:
    import pandas as pd

    assert isinstance(table, pd.DataFrame)
    rows = table.set_index("cluster")
    for name in ("dgx-h100-superpod", "dgx-a100-superpod"):
        best = api.search(MODEL, name, gpus=16, batch_tokens=2**20, fix=SEARCH["fixes"], workers=1, top=1).top[0]
        row = rows.loc[name]
        assert row["reason"] == "" and row["layout"] == best.label
        assert row["step_time_s"] == pytest.approx(best.outcome.step_time_s)
        assert row["wall_days"] >= row["ideal_days"] * 0.999 and 0 < row["goodput"] <= 1
        cluster = loader.load_cluster(name)
        # cost and energy are the run's: GPU-hours at the fleet's price, node power times the PUE
        hours = row["wall_days"] * 24
        assert row["cost_usd"] == pytest.approx(hours * row["gpus"] * cluster.economics.usd_per_gpu_hour, rel=0.05)
        assert row["energy_mwh"] > 0
    assert rows.loc["dgx-h100-superpod", "step_time_s"] < rows.loc["dgx-a100-superpod", "step_time_s"]


def test_each_fleet_row_carries_the_record_of_its_best_plans_kind(table: object) -> None:
    rows = table.set_index("cluster")  # type: ignore[attr-defined]
    plans = table.attrs["plans"]  # type: ignore[attr-defined]
    for name in ("dgx-h100-superpod", "dgx-a100-superpod"):
        record = api.published_fidelity(plans[name]).found
        assert record is not None and record.accelerator == loader.load_cluster(name).accelerator.name
        assert rows.loc[name, "published_rows"] == record.rows > 0
        assert rows.loc[name, "published_mean_abs_error"] == pytest.approx(record.mean_abs_error)
    args = ["fleet", MODEL, "--clusters", "dgx-h100-superpod,hgx-b200-superpod,no-such", "--gpus", "16",
            "--batch-tokens", str(2**20), "--fix", "layout.cp=1"]  # fmt: skip
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 0, text.output
    b200 = next(line for line in text.stdout.splitlines() if "hgx-b200-superpod" in line)
    h100 = next(line for line in text.stdout.splitlines() if "dgx-h100-superpod" in line)
    assert "published check" in text.stdout and b200.rstrip(" │").endswith("none")  # no B200 run is checked
    assert f"{int(rows.loc['dgx-h100-superpod', 'published_rows'])} runs" in h100
    # as JSON: a figure a fleet lacks is null, not NaN (which jq and browsers refuse), and counts are whole numbers
    data = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout, parse_constant=_refuse)
    by_name = {f["cluster"]: f for f in data["fleets"]}
    assert by_name["hgx-b200-superpod"]["published_rows"] == 0
    assert by_name["hgx-b200-superpod"]["published_mean_abs_error"] is None
    assert by_name["no-such"]["step_time_s"] is None and by_name["no-such"]["published_rows"] is None
    assert isinstance(by_name["dgx-h100-superpod"]["published_rows"], int)


def _refuse(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_a_fleet_that_cannot_run_says_why_and_the_others_stay(table: object) -> None:
    rows = table.set_index("cluster")  # type: ignore[attr-defined]
    # --gpus 16 is capped at the one GPU single-h100 has; an 8B model with Adam does not fit on it
    one = rows.loc["single-h100"]
    assert (
        one["fleet_gpus"] == 1
        and one["reason"].startswith("no layout fits single-h100")
        and "over memory" in one["reason"]
    )
    assert "unknown cluster 'no-such'" in rows.loc["no-such", "reason"]
    assert rows.loc["dgx-h100-superpod", "reason"] == ""


def test_a_model_compared_across_fleets_runs_elastic_and_a_plan_keeps_its_policy() -> None:
    from twin.search import fleet

    rows = fleet.compare(MODEL, ["dgx-h100-superpod"], **SEARCH)
    assert rows.loc[0, "reason"] == ""
    # what the comparison ran: the model with elastic shrink unless the overrides say otherwise
    best = api.search(MODEL, "dgx-h100-superpod", ["reliability.elastic=true"], gpus=16, batch_tokens=2**20,
                      fix=SEARCH["fixes"], workers=1, top=1).top[0]  # fmt: skip
    assert best.plan.reliability.elastic
    run = api.simulate_runs(best.plan, 1)
    assert rows.loc[0, "wall_days"] == pytest.approx(run.stats["wall_days"]["mean"])


def test_a_plan_that_names_no_stack_takes_its_clusters_own() -> None:
    data = {
        "name": "stackless", "model": MODEL, "cluster": {"name": "dgx-h100-superpod"},
        "layout": {"dp": 8}, "training": {"global_batch": 64, "tokens": 1e9},
    }  # fmt: skip
    assert api.load_plan(data).stack.name == "megatron-core-0.8"
    data["cluster"] = {"name": "dgx-h100-superpod", "overrides": {"stack": "nemo-24.12"}}
    assert api.load_plan(data).stack.name == "nemo-24.12"
    assert api.load_plan({**data, "stack": "megatron-lm-2022"}).stack.name == "megatron-lm-2022"
    data["cluster"] = {"name": "dgx-h100-superpod", "overrides": {"stack": "no-such-stack"}}
    with pytest.raises(loader.PlanError, match="unknown stack 'no-such-stack'"):
        api.load_plan(data)


def test_the_commands_print_the_fleet_table_as_json() -> None:
    runner = CliRunner()
    common = ["--gpus", "16", "--batch-tokens", "1048576", "--fix", "layout.cp=1", "--fix", "layout.microbatch_size=1",
              "--workers", "1", "--json"]  # fmt: skip
    for args in (
        ["fleet", MODEL, "--clusters", "dgx-h100-superpod,no-such", *common],
        ["search", MODEL, "--sweep", "cluster=dgx-h100-superpod,no-such", *common],
    ):
        out = runner.invoke(app, args)
        assert out.exit_code == 0, out.output
        fleets = {r["cluster"]: r for r in json.loads(out.stdout)["fleets"]}
        assert fleets["dgx-h100-superpod"]["gpus"] == 16 and fleets["dgx-h100-superpod"]["mfu"] > 0
        assert "unknown cluster" in fleets["no-such"]["reason"]
    bad = runner.invoke(app, ["fleet", MODEL, "--clusters", "dgx-h100-superpod", "--gpus", "8:16"])
    assert bad.exit_code == 2 and "give one count" in bad.output


def test_a_400k_gpu_fleet_simulates_no_more_events_than_100k() -> None:
    """What a prediction simulates follows the pipeline (pp x microbatches x virtual stages), not the fleet: the same
    1T pipeline at four times the data parallelism draws the same events, and the whole-fleet groups it prices
    (the step's barrier, DP) span all 400k GPUs."""
    small = api.predict("reference-100k")
    big_plan = api.load_plan(
        "reference-100k", ["cluster.nodes=50004", "layout.dp=3125", "training.global_batch=100000"]
    )
    big = api.predict(big_plan)
    assert big.world_size == 400_000 and big.events == small.events
    # more replicas only lengthen the DP collectives' latency terms: the step grows by well under 1%
    assert small.step_time_s < big.step_time_s < small.step_time_s * 1.01


def test_show_takes_a_fleets_name_and_its_what_ifs() -> None:
    out = CliRunner().invoke(app, ["show", "tpu-v7-ironwood", "--set", "nodes=4608", "--json"])
    assert out.exit_code == 0, out.output
    cluster = json.loads(out.stdout)["cluster"]
    assert cluster["nodes"] == 4608 and cluster["stack"] == "maxtext-xla"  # two pods of 9,216 chips
    bad = CliRunner().invoke(app, ["show", "tpu-v7-ironwood", "--set", "nodes=4000"])
    assert bad.exit_code == 2 and "pod of 9216 chips" in bad.output


def test_a_fleet_too_large_to_finish_the_run_is_answered_with_the_share_that_finishes_fastest() -> None:
    """Failures that outpace recovery on two nodes (one every 3 minutes against a restart of 10) but not on one:
    the comparison answers with the one node's run and says why, instead of only refusing the fleet."""
    rates = ["reliability.failure_rates={gpu: 240}", "training.tokens=2e9"]  # per node-day: each node every 6 min
    search = {**SEARCH, "batch_tokens": 2**19}
    row = api.compare_fleets(MODEL, ["dgx-h100-superpod"], rates, **search).loc[0]
    full = api.search(MODEL, "dgx-h100-superpod", [*rates, "reliability.elastic=true"], gpus=16,
                      batch_tokens=2**19, fix=SEARCH["fixes"], workers=1, top=1).top[0]  # fmt: skip
    assert full.shape.gpus == 16
    with pytest.raises(loader.PlanError, match="failures outpace progress"):
        api.simulate_runs(full.plan, 1)
    assert row["reason"] == "" and row["gpus"] == 8 and row["fleet_gpus"] > 16
    assert "16-GPU best layout's whole run cannot finish (failures outpace progress" in row["note"]
    assert "takes 8 of the fleet's GPUs" in row["note"]
    assert row["wall_days"] >= row["ideal_days"] and 0 < row["goodput"] < 1


def test_a_fleet_whose_whole_run_finishes_late_is_answered_with_the_share_that_finishes_sooner() -> None:
    """Failures on two nodes every 12 minutes against a 26-minute recovery: the 16-GPU run finishes, but at 9%
    goodput it takes longer than 8 GPUs do at MFU 1 (`_half_may_win`), and the 8-GPU run is in fact sooner."""
    rates = ["reliability.failure_rates={gpu: 60}", "training.tokens=2e9"]  # per node-day: each node every 24 min
    row = api.compare_fleets(MODEL, ["dgx-h100-superpod"], rates, **{**SEARCH, "batch_tokens": 2**19}).loc[0]
    full = api.search(MODEL, "dgx-h100-superpod", [*rates, "reliability.elastic=true"], gpus=16,
                      batch_tokens=2**19, fix=SEARCH["fixes"], workers=1, top=1).top[0]  # fmt: skip
    whole = api.simulate_runs(full.plan, 1).stats["wall_days"]["mean"]
    assert full.shape.gpus == 16 and 2 * full.outcome.mfu * full.outcome.days_to_train < whole
    assert row["reason"] == "" and row["gpus"] == 8 and row["wall_days"] < whole
    assert f"16-GPU best layout's whole run takes {whole:,.1f} wall days" in row["note"]
    assert "takes 8 of the fleet's GPUs" in row["note"]


def test_the_goodput_ranking_puts_runs_that_cannot_finish_last_instead_of_failing() -> None:
    rates = ["reliability.failure_rates={gpu: 240}", "training.tokens=2e9", "reliability.elastic=true"]
    fixes = [*SEARCH["fixes"], "layout.tp=1", "layout.pp=1", "layout.recompute=none"]  # DP8 or DP16
    result = api.search(MODEL, "dgx-h100-superpod", rates, gpus=(8, 16), batch_tokens=2**19, fix=fixes, workers=1,
                        top=2, objective="goodput-time", seeds=1)  # fmt: skip
    first, second = result.top
    # the 16-GPU layout steps faster but cannot finish its run; the 8-GPU one can, and is ranked first
    assert second.shape.gpus == 16 and second.run_wall_days == float("inf")
    assert first.shape.gpus == 8 and first.run_wall_days < float("inf")
    assert first.outcome.days_to_train > second.outcome.days_to_train
