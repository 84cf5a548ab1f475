"""`twin search`: pruning never changes the top K, bounds are bounds, every candidate is a valid plan, and the
command's front door (twin/search/)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import pytest
from typer.testing import CliRunner

from plan import loader
from plan.errors import PlanError
from twin import api
from twin.cli.app import app
from twin.search import front
from twin.search.engine import objective_of, search
from twin.search.evaluate import WALK_MARGIN, Bounds, _longest_path, _walk
from twin.search.space import Space, neutral, shapes
from twin.step import schedules
from twin.step.compute import Device


class Inline(Executor):
    """Simulations in this process: the tests' executor (the process pool is the command's)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


SMALL = Space(gpus=(1, 32), batch_sequences=(128, 128), tp=(1, 2, 4), cp=(1, 2), pp=(1, 2, 4), microbatch_size=(1, 2))


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return front.base_of("llama3-8b", "dgx-h100-superpod", []).data


@pytest.fixture(scope="module")
def brute(base: dict[str, Any]) -> Any:
    return search(base, SMALL, top_k=5, executor=Inline(), exhaustive=True)


@pytest.mark.parametrize("objective", ["time", "cost", "mfu"])
def test_pruning_keeps_the_brute_force_top_k(base: dict[str, Any], brute: Any, objective: str) -> None:
    probe = loader.validate_plan(neutral(base))
    cluster = loader.plan_cluster(probe)
    peak = Device.of(cluster, probe.training.dtype, cluster.node.gpus).peak_flops
    price = cluster.economics.usd_per_gpu_hour
    ranked = sorted(brute.simulated, key=lambda c: objective_of(objective, c.plan, c.outcome.step_time_s, price, peak))
    pruned = search(base, SMALL, objective, 5, executor=Inline())
    assert [c.label for c in pruned.top] == [c.label for c in ranked[:5]]
    assert pruned.tally.simulated < brute.tally.simulated / 2  # and the bounds did prune
    assert pruned.tally.pruned > 0


def test_bounds_never_exceed_the_simulated_step(base: dict[str, Any], brute: Any) -> None:
    probe = loader.validate_plan(neutral(base))
    bounds = Bounds(base, loader.plan_cluster(probe), loader.plan_stack(probe))
    assert len(brute.simulated) > 50
    for c in brute.simulated:
        cheap, tight = bounds.step_s(c.shape, c.knobs), bounds.pipeline_s(c.plan)
        assert cheap is not None
        assert cheap <= tight * (1 + 1e-9) and tight <= c.outcome.step_time_s * (1 + 1e-9), c.label


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_the_bounds_walk_extended_past_its_warm_up_is_the_walk_of_every_microbatch(schedule: str, v: int) -> None:
    """The bound's longest path through a long step is walked for three short ones and grown by its steady state
    (evaluate._walk) where they show one: equal to walking every microbatch to within rounding, far inside the
    margin the bound is lowered by, on stages and transfers that all cost differently."""
    rng = random.Random(7)
    extended = 0
    for pp, m in ((4, 256), (8, 512), (16, 1024)):
        stages = pp * v
        durations = {(k, s): rng.uniform(0.5, 2.0) for k in "FBW" for s in range(stages)}
        owner = schedules.stage_ranks(schedule, pp, stages)
        p2p = {(a, b): rng.uniform(0.0, 0.3) for a in range(stages) for b in (a - 1, a + 1)}
        free, last, exact = _walk(schedule, pp, v, m, durations, owner, p2p)
        every, every_last = _longest_path(schedules.build(schedule, pp, v, m), durations, owner, p2p)
        extended += not exact
        assert free == pytest.approx(every, rel=WALK_MARGIN / 100)
        assert last == pytest.approx(every_last, rel=WALK_MARGIN / 100)
    assert extended >= 2


def test_every_candidate_is_a_plan_validate_accepts(brute: Any) -> None:
    for c in brute.simulated[:40]:
        check = api.validate(c.plan)
        assert check.ok, (c.label, check.reasons)
        assert c.plan.layout.world_size <= SMALL.gpus[1]
        assert c.plan.training.global_batch == SMALL.batch_sequences[0]


def test_shapes_follow_the_rules_they_restate(base: dict[str, Any]) -> None:
    seen = list(shapes(SMALL, base["model"]))
    assert seen and all(s.gpus <= 64 and s.global_batch % (s.dp * s.microbatch_size) == 0 for s in seen)
    assert all(s.microbatches % s.pp == 0 for s in seen if s.schedule == "interleaved-1f1b")
    assert all(s.microbatches >= 2 * s.pp for s in seen if s.schedule in ("zbv", "dualpipe-v"))
    heads = base["model"]["heads"]
    assert all(heads % s.tp == 0 for s in seen)


def test_fix_pins_an_axis_and_the_pareto_front_is_undominated(base: dict[str, Any]) -> None:
    space = Space(**{**SMALL.__dict__, "fixed": {"layout.tp": 2}})
    result = search(base, space, top_k=3, executor=Inline())
    assert result.top and all(c.shape.tp == 2 for c in result.simulated)
    for a in result.pareto:
        for b in result.simulated:
            better = (b.outcome.days_to_train, b.shape.gpus, -b.headroom_GiB)
            mine = (a.outcome.days_to_train, a.shape.gpus, -a.headroom_GiB)
            assert not (all(x <= y for x, y in zip(better, mine, strict=True)) and better != mine)


def test_a_plan_that_cannot_run_is_reported_and_searched_past() -> None:
    pins = ["layout.tp=8", "layout.cp=1", "layout.microbatch_size=1", "layout.pp=16", "layout.virtual_stages=8",
            "layout.schedule=interleaved-1f1b"]  # fmt: skip
    result, _ = front.run(
        "llama3-405b-16k", overrides=["training.global_batch=1000"], gpus=16384, batch_tokens=(8e6, 17e6), top=2,
        workers=1, fixes=pins,
    )  # fmt: skip
    assert isinstance(result.given, str) and "not a multiple of dp" in result.given
    assert result.top and all(c.plan.layout.pp == 16 and c.plan.layout.dp == 128 for c in result.top)


def test_the_command_prints_json_and_refuses_bad_input() -> None:
    runner = CliRunner()
    args = ["search", "llama3-8b", "--cluster", "dgx-h100-superpod", "--gpus", "16", "--batch-tokens", "1048576",
            "--top", "2", "--workers", "1", "--fix", "layout.cp=1", "--fix", "layout.microbatch_size=1",
            "--json"]  # fmt: skip
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert len(data["top"]) == 2 and data["top"][0]["objective"] <= data["top"][1]["objective"]
    assert data["top"][0]["beats_next_by"] and data["tally"]["simulated"] >= 2
    text = runner.invoke(app, args[:-1])  # the tables end with the record of the best plan's kind
    assert text.exit_code == 0 and "checked on: " in text.stdout and "published H100 SXM5 80GB" in text.stdout
    for bad, says in (
        (["search", "llama3-8b"], "--cluster"),
        (["search", "llama3-8b", "--cluster", "dgx-h100-superpod", "--objective", "speed"], "--objective"),
        (["search", "llama3-8b", "--cluster", "dgx-h100-superpod", "--gpus-range", "64:8"], "empty"),
        (["search", "cpu-tiny", "--sweep", "layout.tp"], "section.field=a,b,c"),
    ):
        res = runner.invoke(app, bad)
        assert res.exit_code == 2 and says in res.output, (bad, res.output)


def test_batch_and_gpu_counts_take_the_suffixes_papers_write() -> None:
    assert front.coerce_range("4M", "--batch-tokens") == 512 * 8192  # Llama 3's "4M tokens"
    assert front.coerce_range("4m:64M", "--batch-range") == (2**22, 2**26)
    assert front.coerce_range("16K", "--gpus") == 16_384 and front.coerce_range("2,048", "--gpus") == 2048
    assert front.coerce_range("4.2e6", "--batch-tokens") == 4.2e6
    with pytest.raises(PlanError, match="suffixes k, M, G"):
        front.coerce_range("8.4Q", "--batch-tokens")


def test_a_batch_few_replicas_divide_is_pointed_out() -> None:
    base = front.base_of("llama3-8b", "dgx-h100-superpod", [])
    for tokens, said in ((1e6, True), (2**20, False)):  # 122 sequences of 8,192; 128
        _, notes = front.space_of(base, 16, tokens, [])
        assert any("which few dp divide" in n for n in notes) is said, notes


def test_sweep_compares_variants_and_says_why_one_cannot_run() -> None:
    table = api.sweep("gpt3-175b-1k", ["layout.pp=8,16", "layout.tp=8,7"], ["layout.dp=8"])
    assert len(table) == 4
    ok = table[table["ok"]]
    assert set(ok["layout.pp"]) == {"8", "16"} and (ok["step_time_s"] > 0).all()
    assert table[~table["ok"]]["reason"].str.contains("layout.tp: 7 does not divide").all()
    assert set(ok["gpus"]) == {512, 1024}


@pytest.mark.slow
def test_a_local_ray_instance_finds_what_the_process_pool_finds(base: dict[str, Any]) -> None:
    pytest.importorskip("ray")
    from twin.search.distributed import ray_executor

    space = Space(**{**SMALL.__dict__, "fixed": {"layout.cp": 1, "layout.microbatch_size": 1}})
    local = search(base, space, top_k=3, workers=2)
    executor = ray_executor("local", workers=2)
    try:
        on_ray = search(base, space, top_k=3, executor=executor)
    finally:
        executor.shutdown()
    assert [(c.label, c.objective) for c in on_ray.top] == [(c.label, c.objective) for c in local.top]


def test_goodput_time_reranks_the_finalists_by_whole_run_days(base: dict[str, Any]) -> None:
    space = Space(**{**SMALL.__dict__, "fixed": {"layout.cp": 1, "layout.microbatch_size": 1, "layout.tp": 2}})
    result = search(base, space, "goodput-time", 2, executor=Inline(), seeds=1)
    assert len(result.top) == 2 and all(c.run_wall_days for c in result.top)
    assert result.top[0].objective <= result.top[1].objective
    for c in result.top:  # the run takes at least its failure-free days
        assert c.objective == c.run_wall_days and c.run_wall_days >= c.outcome.days_to_train * (1 - 1e-9)


def test_moe_shapes_fold_experts_over_tp_and_the_bounds_stay_bounds() -> None:
    """An MoE search tries folded experts (layout.expert_tp 1) where tp > 1, so ep may exceed dp; every such
    candidate is a plan the loader accepts, and under a stack whose combined 1F1B hides all-to-alls, with a
    multi-token-prediction module on the last stage, the cheap and the walked bounds still never exceed the
    simulated step."""
    base = front.base_of("qwen3-30b-a3b", "dgx-h100-superpod", []).data
    base = {**base, "stack": {"name": "nemo-25.11", "overrides": {"ep_overlap": True}}}
    base = {**base, "model": {**base["model"], "mtp_layers": 1}}  # and the bound's multi-token prediction
    space = Space(gpus=(16, 16), batch_sequences=(32, 32), tp=(1, 2), cp=(1,), pp=(1, 2), ep=(8, 16),
                  microbatch_size=(1,), schedule=("1f1b", "interleaved-1f1b"), virtual_stages=(2,),
                  zero=(1,), recompute=("none",), sequence_parallel=(True,))  # fmt: skip
    seen = list(shapes(space, base["model"]))
    folded = [s for s in seen if s.expert_tp]
    assert folded and all(s.tp > 1 for s in folded)
    assert any(s.ep > s.dp for s in folded) and not any(s.ep > s.dp for s in seen if not s.expert_tp)
    result = search(base, space, top_k=3, executor=Inline(), exhaustive=True)
    probe = loader.validate_plan(neutral(base))
    bounds = Bounds(base, loader.plan_cluster(probe), loader.plan_stack(probe))
    simulated = [c for c in result.simulated if c.shape.expert_tp]
    assert simulated
    for c in result.simulated:
        assert c.plan.layout.expert_tp == (c.shape.expert_tp or None)
        cheap, tight = bounds.step_s(c.shape, c.knobs), bounds.pipeline_s(c.plan)
        assert cheap is not None
        assert cheap <= tight * (1 + 1e-9) and tight <= c.outcome.step_time_s * (1 + 1e-9), c.label


def test_a_candidate_runs_one_schedule_a_step_whatever_the_base_plans_schedule_runs() -> None:
    # Layout.schedule_runs divides the base plan's microbatches, not a candidate's: the search drops it, as it does
    # the base's stage split
    from twin.search.space import Knobs, Shape, plan_data

    base = loader.load("gpt3-175b-1k", ["layout.schedule_runs=2"]).model_dump(mode="json")
    shape = Shape(dp=8, tp=8, pp=4, cp=1, ep=1, microbatch_size=1, schedule="1f1b", virtual_stages=1, global_batch=24)
    data = plan_data(base, shape, Knobs(sequence_parallel=True, recompute="selective", zero=1))
    assert "schedule_runs" not in data["layout"]
    assert loader.validate_plan(data).layout.schedule_runs == 1  # 3 microbatches a replica: 2 runs could not split them
