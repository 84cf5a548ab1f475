"""Bounded work and verdicts (issue 14): the YAML reader's bounds, `Limits`, the memory verdict against `predict`,
the step budget, the run outlook against the simulation, and the run simulation's own stops."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from plan import files, loader
from plan.errors import PlanError
from plan.files import parse_override, read_yaml, yaml_value
from plan.limits import Limits
from twin import api, fit
from twin.budget import check_step, run_limits, run_step_actions, step_actions
from twin.run import summary
from twin.run.budget import outlook
from twin.run.sim import RunSim
from twin.step.schedules import build
from twin.step.steady import sample_counts

# --- reading YAML -------------------------------------------------------------------------------------------------


def test_yaml_reads_the_core_schema_that_json_schema_and_editors_read() -> None:
    got = yaml_value("a: 2.0e12\nb: 1e-7\nc: yes\nd: 012\ne: 0x10\nf: true\ng: ~\nh: .inf\ni: 1:30", "t")
    assert got == {
        "a": 2.0e12,
        "b": 1e-7,
        "c": "yes",
        "d": 12,
        "e": 16,
        "f": True,
        "g": None,
        "h": math.inf,
        "i": "1:30",
    }


@pytest.mark.parametrize(("depth", "text"), [(64, "yaml_depth=N"), (5000, "libyaml reads (1,000 levels)")])
def test_libyamls_own_nesting_cap_is_told_as_the_depth_limit(
    monkeypatch: pytest.MonkeyPatch, depth: int, text: str
) -> None:
    """PyYAML 6.0.4's libyaml refuses nesting past 1,000 in its scanner, ahead of the walk that enforces
    `yaml_depth`: under the limit that is the limit's own message; past it, libyaml's cap is named."""

    def refuse(*_: object) -> None:
        raise yaml.scanner.ScannerError("while increasing flow level", None, "exceeded maximum nesting depth", None)

    monkeypatch.setattr(files, "_load", refuse)
    with pytest.raises(PlanError, match=re.escape(text)):
        yaml_value("deep: [[[1]]]", "t.yaml", Limits(yaml_depth=depth))


def test_small_aliases_and_merge_keys_still_work() -> None:
    got = yaml_value("base: &b {dp: 2, tp: 2}\nother:\n  <<: *b\n  pp: 4\nlist: [*b, *b]", "t")
    assert got["other"] == {"dp": 2, "tp": 2, "pp": 4} and got["list"] == [{"dp": 2, "tp": 2}] * 2


def test_expanded_values_are_counted_before_anything_is_built() -> None:
    text = "a: &a [1, 2, 3, 4]\nb: &b [*a, *a, *a, *a]\nc: [*b, *b, *b, *b]"  # 1 + 5 + 21 + 85 values and keys
    assert yaml_value(text, "t", Limits(yaml_nodes=200))["c"][3][3] == [1, 2, 3, 4]
    with pytest.raises(PlanError, match="yaml_nodes"):
        yaml_value(text, "t", Limits(yaml_nodes=100))


def test_file_size_is_capped_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("a: " + "x" * 3000)
    assert read_yaml(path, Limits(file_kib=4))["a"].startswith("x")
    with pytest.raises(PlanError, match="file_kib"):
        read_yaml(path, Limits(file_kib=2))


def test_override_values_are_read_as_files_are() -> None:
    assert parse_override("training.tokens=2e12") == (["training", "tokens"], 2e12)
    assert parse_override("cluster=my: odd: name") == (["cluster"], "my: odd: name")  # not YAML: the text itself
    with pytest.raises(PlanError, match="refers to itself"):
        parse_override("layout=&x [*x]")


def test_limits_parse_names_values_and_refuses_the_rest() -> None:
    assert Limits.parse(["layers=20000", "runs=1e4"]) == Limits(layers=20_000, runs=10_000)
    for bad in ("layer=3", "layers", "layers=0", "layers=lots"):
        with pytest.raises(PlanError, match="--limit"):
            Limits.parse([bad])


# --- memory as a verdict ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", loader.plan_presets())
def test_fit_memory_is_what_predict_reports_and_every_preset_fits(name: str) -> None:
    plan = loader.load(name)
    assert fit.memory(plan) == api.predict(plan).memory
    assert fit.check_fit(plan).fits


@pytest.mark.parametrize(
    "overrides",
    [
        ["layout.zero=0", "layout.recompute=none"],
        ["layout.schedule=1f1b", "layout.virtual_stages=1", "layout.microbatch_size=2"],
        ["layout.tp=4", "layout.pp=8", "layout.stage_layers=null"],
    ],
)
def test_fit_memory_matches_predict_for_plans_that_do_not_fit(overrides: list[str]) -> None:
    plan = loader.load("llama3-405b-16k", overrides)
    assert fit.memory(plan) == api.predict(plan).memory


def test_a_plan_over_memory_says_by_how_much_and_which_change_fits() -> None:
    over = ["layout.tp=4"]  # half the paper's TP: 24 GiB over
    plan = loader.load("llama3-405b-16k", over)
    with pytest.raises(PlanError) as info:
        fit.check_fit(plan)
    message = str(info.value)
    assert "does not fit in memory" in message and "over by" in message and "--allow-oom" in message
    fixes = fit.fixes_that_fit(plan, loader.plan_cluster(plan))
    assert fixes and all(fit.memory(loader.load("llama3-405b-16k", [*over, f.split()[0]])).fits for f in fixes)
    assert not api.validate(plan).ok and api.validate(plan, allow_oom=True).ok
    with pytest.raises(PlanError, match="does not fit"):
        api.simulate_run(plan)


# --- the step budget ----------------------------------------------------------------------------------------------


def test_step_actions_count_what_the_pipeline_simulates() -> None:
    for name in loader.plan_presets():
        plan = loader.load(name)
        lay = plan.layout
        counts = sample_counts(lay.schedule, lay.pp, plan.num_microbatches) or (plan.num_microbatches,)
        expected = sum(len(order) for n in counts for order in build(lay.schedule, lay.pp, lay.virtual_stages, n))
        assert step_actions(plan) == expected, name
    long = loader.load("gpt3-175b-1k", ["training.global_batch=49152"])  # 3,072 microbatches, 32 simulated
    assert step_actions(long) == 16 * 2 * (16 + 24 + 32)


def test_step_budget_refuses_before_simulating() -> None:
    plan = loader.load("cpu-tiny", ["training.global_batch=400000", "layout.schedule=zb-h1"])  # 100,000 microbatches
    with pytest.raises(PlanError, match="step_actions=600000"):  # on 2 stages, F, B and W, simulated whole
        api.predict(plan)
    check_step(plan, Limits(step_actions=600_000))  # raised explicitly, it would go on
    with pytest.raises(PlanError, match="--limit layers"):
        check_step(loader.load("cpu-tiny", ["model.layers=20000"]), Limits())


def test_a_run_counts_every_step_it_predicts() -> None:
    plan = loader.load("reference-100k")  # elastic: the step and the doubled batch; no node outside job and spares
    assert run_step_actions(plan, loader.plan_cluster(plan)) == 3 * step_actions(plan)
    plan = loader.load("llama3-405b-16k")  # not elastic, with nodes outside the job: the step and a relocated one
    assert run_step_actions(plan, loader.plan_cluster(plan)) == 2 * step_actions(plan)


# --- the run outlook and the simulation's stops -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama3-405b-16k", "gpt3-175b-1k", "deepseek-v3-2k"])
def test_outlook_goodput_is_near_the_simulated_mean(name: str) -> None:
    """Daly's complete model against the simulation, 8 seeds, within 6% relative (it leaves out slow nodes'
    degraded time and treats a wait for a repair as a fixed recovery). Not for elastic runs, whose shrunk
    replicas it does not model."""
    setup = summary.setup(loader.load(name))
    simulated = np.mean([r.goodput for r in summary.run_seeds(setup, range(8))])
    assert outlook(setup).goodput == pytest.approx(simulated, rel=0.06)


def test_outlook_without_failures_is_the_work_and_its_checkpoints() -> None:
    setup = summary.setup(
        loader.load("cpu-tiny", ["reliability.checkpoint_interval_min=1", "cluster.failures.rate_scale=0"])
    )
    ahead = outlook(setup)
    assert not setup.rates and ahead.interruptions == 0
    assert ahead.wall_s == pytest.approx(setup.useful_s * (1 + setup.ckpt.stall_s / setup.interval_s))


def test_a_run_whose_failures_outpace_it_stops_before_simulating() -> None:
    setup = summary.setup(loader.load("llama3-405b-16k", ["reliability.failure_rates={gpu: 0.5}"]))
    assert outlook(setup).goodput < 0.01
    with pytest.raises(PlanError, match=r"failures outpace progress.*every 1.4 min.*recovery takes 8"):
        summary.simulate_run(setup)


def test_the_simulation_stops_past_its_own_limits() -> None:
    setup = summary.setup(loader.load("llama3-405b-16k"))
    with pytest.raises(PlanError, match="run_interruptions"):
        RunSim(setup, 0, Limits(run_interruptions=20)).run()
    with pytest.raises(PlanError, match="run_checkpoints"):
        RunSim(setup, 0, Limits(run_checkpoints=20)).run()


def test_a_job_that_can_never_gather_its_nodes_again_stops() -> None:
    """Fenced nodes never replaced (rma_days null) strand a job that fills its cluster; with the vendor's
    replacement (the default) the same run fences nodes, waits for their replacements and finishes."""
    over = ["cluster.nodes=256", "reliability.hot_spares=0"]
    plan = loader.load("deepseek-v3-2k", [*over, "reliability.rma_days=null"])
    with pytest.raises(PlanError, match=r"cannot finish.*fenced off for good.*set reliability.rma_days"):
        summary.simulate_run(summary.setup(plan), 0)
    sim = RunSim(summary.setup(loader.load("deepseek-v3-2k", over)), 0)
    sim.run()
    assert sim.fenced > 0 and sim.done


def test_a_shrunk_elastic_job_fails_only_on_the_nodes_it_still_runs() -> None:
    """The failure rates are the whole job's: once an elastic shrink leaves out three quarters of its replicas,
    only failures striking the quarter it still runs interrupt it (Poisson thinning)."""
    plan = loader.load("reference-100k", ["reliability.elastic=true"])
    sim = RunSim(summary.setup(plan), 0)
    sim.dp = plan.layout.dp // 4
    struck: list[str] = []
    sim.strike = lambda hit: struck.append(hit.cause)  # type: ignore[method-assign]
    sim.env.process(sim.failures("probe", 1.0))  # a cause of its own beside the job's, drawn once a second
    sim.env.run(until=4000.0)
    assert struck.count("probe") == sim.t.causes["probe"]
    assert struck.count("probe") / 4000 == pytest.approx(1 / 4, abs=0.03)


def test_a_shrunk_elastic_job_has_slow_nodes_only_among_the_nodes_it_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The slow-node rate is the whole job's too: after a shrink to a quarter of the replicas, a quarter of the
    slow nodes drawn are in the job (the quarantine window set to nothing, so every draw is counted)."""
    monkeypatch.setattr("twin.run.sim.STRAGGLER_WINDOW_STEPS", 0)
    plan = loader.load(
        "reference-100k", ["reliability.elastic=true", "cluster.stragglers.slow_node_rate_per_node_day=0"]
    )
    for share in (1, 4):
        sim = RunSim(summary.setup(plan), 0)
        sim.dp = plan.layout.dp // share
        sim.strike = lambda hit: None  # type: ignore[method-assign]
        sim.env.process(sim.slow_nodes(1.0))  # the only slow nodes: one a second for the whole job
        sim.env.run(until=4000.0)
        assert sim.t.causes["straggler"] / 4000 == pytest.approx(1 / share, rel=0.1), share  # 3 sigma at 1/4


def test_seeds_are_checked_before_any_run() -> None:
    for bad in (-5, True, 1.5):
        with pytest.raises(PlanError, match="seed"):
            api.simulate_run("cpu-tiny", seed=bad)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="--limit runs=5000"):
        api.simulate_runs("cpu-tiny", 5000)
    with pytest.raises(PlanError, match="--limit runs=2000"):
        api.simulate_runs("cpu-tiny", range(2000))


def test_a_fenced_node_leaves_once_and_a_rack_is_fenced_per_server_of_it() -> None:
    """fence_after counts one physical node's failures: once fenced, the next node in its place starts at none (a
    slot's count once kept growing, fencing "2,369 of 512 racks"); an NVL72 rack, nine servers' worth of GPUs that
    fail nine times as often, is fenced after nine times as many."""
    for cluster, per_fence in (("reference-100k-h100", 3), ("gb300-nvl72-fleet", 27)):
        plan = loader.load("reference-100k", [f"cluster={cluster}", "layout.dp=32", "training.global_batch=1024"])
        sim = RunSim(summary.setup(plan), 0)
        for _ in range(2 * per_fence):
            next(sim.repair(5), None)  # one failure of the node in the job's slot 5 (a repair it may not return from)
        assert sim.fenced == 2, cluster


def test_a_step_within_the_limits_has_its_whole_run_allowed_the_runs_multiple() -> None:
    """A layout a search kept (its step within the limits) is not refused its whole run, which predicts the step
    up to four times over: what the fleet comparison and the goodput re-rank run under."""
    plan = loader.load("llama3-405b-16k", ["reliability.elastic=true"])
    cluster = loader.plan_cluster(plan)
    tight = Limits(step_actions=step_actions(plan))
    check_step(plan, tight)  # the step passes
    assert run_step_actions(plan, cluster) > tight.step_actions
    with pytest.raises(PlanError, match="step_actions"):
        api.simulate_runs(plan, 1, limits=tight)
    widened = run_limits(plan, cluster, tight)
    assert widened.step_actions == run_step_actions(plan, cluster)
    assert api.simulate_runs(plan, 1, limits=widened).runs
