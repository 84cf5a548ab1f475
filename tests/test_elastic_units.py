"""Elastic membership without a process group: the layout re-derived for another world size (global batch kept,
one-line errors), the torchrun command for `--nnodes MIN:MAX`, the restart clock, the gang fence, and the
launcher's summary counting distinct steps and restarts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor.elastic import RestartTimer, fit_world, gang_facts
from executor.health import FAILURE_FILE, Beat, Health, Verdict, diagnose
from executor.parallel import LayoutError
from plan import loader
from plan.loader import PlanError
from plan.records import EventRecord, RankCoords, StepRecord
from twin.cli.launch import parse_nnodes, summarise, summary_line, torchrun_command


def test_fit_world_rederives_dp_and_keeps_the_global_batch() -> None:
    plan = loader.load("cpu-tiny", ["reliability.faults=['crash@3:1', 'crash@4:5']"])  # (2,2,2), B=16, mb=2
    assert fit_world(plan, 8) is plan
    half = fit_world(plan, 4)
    assert (half.layout.dp, half.layout.tp, half.layout.pp) == (1, 2, 2)
    assert half.training.global_batch == 16 and half.layout.microbatch_size == 2 and half.num_microbatches == 8
    assert [f.label() for f in half.reliability.faults] == ["crash@3:1"]  # rank 5 is gone
    wide = fit_world(plan, 64)  # dp=16: one sequence per replica, so the microbatch shrinks to fit
    assert (wide.layout.dp, wide.layout.microbatch_size, wide.num_microbatches) == (16, 1, 1)
    assert gang_facts(half) == {"world_size": 4, "dp": 1, "microbatch_size": 2, "num_microbatches": 8}


@pytest.mark.parametrize(
    ("world", "message"),
    [
        (6, "elastic: the rendezvous gave 6 ranks, not a multiple of tp·pp·cp = 4"),
        (12, "so dp = 12/4 = 3, which does not divide training.global_batch=16"),
        (128, "so dp = 128/4 = 32, which does not divide training.global_batch=16"),
    ],
)
def test_fit_world_impossible_sizes_are_one_line(world: int, message: str) -> None:
    with pytest.raises(LayoutError, match=message) as err:
        fit_world(loader.load("cpu-tiny"), world)
    assert "\n" not in str(err.value)


def test_fit_world_keeps_dp_a_multiple_of_ep() -> None:
    moe = loader.load("cpu-tiny-moe")  # dp4 (ep2) x pp2
    assert (fit_world(moe, 4).layout.dp, fit_world(moe, 4).layout.ep) == (2, 2)
    with pytest.raises(LayoutError, match=r"so dp = 2/2 = 1, which is not a multiple of layout.ep=2"):
        fit_world(moe, 2)


def test_fit_world_shrinks_the_microbatch_for_the_schedule_or_says_why() -> None:
    # zbv needs 2·pp = 4 microbatches per replica: over dp=4, microbatches of 1 (not the plan's 2) give them.
    plan = loader.load("cpu-tiny", ["layout.schedule=zbv", "layout.virtual_stages=2"])
    four = fit_world(plan, 16)
    assert (four.layout.dp, four.layout.microbatch_size, four.num_microbatches) == (4, 1, 4)
    with pytest.raises(LayoutError, match=r"so dp=8, and with microbatch_size=2: training.global_batch: zbv needs"):
        fit_world(plan, 32)  # 2 sequences per replica: never 4 microbatches


def test_nnodes_range_builds_an_elastic_c10d_command() -> None:
    plan = loader.load("cpu-tiny")
    cmd = torchrun_command(
        "cpu-tiny", plan, overrides=[], steps=3, device="cpu", out=Path("runs/x"), nnodes="1:2", master_port=29999,
        rdzv_conf="last_call_timeout=2",
    )  # fmt: skip
    joined = " ".join(cmd)
    assert "--nnodes 1:2 --max-restarts 0 --rdzv-backend c10d --rdzv-id x" in joined
    assert "--rdzv-endpoint 127.0.0.1:29999 --rdzv-conf last_call_timeout=2 --nproc-per-node 4" in joined
    assert cmd[-1] == "--elastic"
    assert "--elastic" not in torchrun_command("cpu-tiny", plan, overrides=[], steps=1, device="cpu", out=Path("r"))
    assert parse_nnodes("2") == (2, 2) and parse_nnodes(3) == (3, 3) and parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "2:1", "a:b", "1:", ":2"):
        with pytest.raises(PlanError, match=f"--nnodes {bad}: write N or MIN:MAX"):
            parse_nnodes(bad)
    with pytest.raises(PlanError, match="--nnodes 1:3: 3 does not divide the plan's world size 8"):
        torchrun_command("cpu-tiny", plan, overrides=[], steps=1, device="cpu", out=Path("r"), nnodes="1:3")
    # 2 ranks a node: one node is not a multiple of tp·pp = 4, and neither are three.
    with pytest.raises(PlanError, match=r"--nnodes 1:4: a gang of 1, 3 node\(s\) of 2 ranks cannot run the plan"):
        torchrun_command("cpu-tiny", plan, overrides=[], steps=1, device="cpu", out=Path("r"), nnodes="1:4")


def _step(step: int, t: float, loss: float) -> StepRecord:
    coords = RankCoords(dp=0, pp=0, cp=0, ep=0, tp=0)
    return StepRecord(step=step, rank=0, coords=coords, time_unix=t, step_s=1.0, tokens=1, loss=loss, mfu=0.1)


def _start(step: int, t: float, world: int) -> EventRecord:
    return EventRecord(event="start", step=step, time_unix=t, detail={"world_size": world})


def test_summary_counts_distinct_steps_and_restarts_separately(tmp_path: Path) -> None:
    """12 steps, a node lost during step 5 and the gang back at half size from the step-4 checkpoint: the summary
    says 12 steps, 1 restart and 1 replayed step (step 4), not 13 steps; records of an earlier launch of the
    same run directory are not this launch's."""
    t = 100.0
    records = [_start(0, t - 50, 8), _step(0, t - 40, 9.0)]  # an earlier launch
    records += [_start(0, t, 8), *(_step(s, t + s, 5.0 - s / 10) for s in range(5))]
    records += [_start(4, t + 20, 4), *(_step(s, t + 20 + s, 5.0 - s / 10) for s in range(4, 12))]
    (tmp_path / "records.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in records))
    summary = summarise(tmp_path, since_unix=t)
    assert (summary["steps"], summary["restarts"], summary["steps_replayed"]) == (12, 1, 1)
    assert summary["world_sizes"] == [8, 4] and summary["loss"] == pytest.approx(3.9)
    line = summary_line(summary, loader.load("cpu-tiny"), tmp_path)
    assert "done: 12 steps of cpu-tiny on 8 → 4 ranks" in line and "1 restart, 1 step(s) replayed" in line


def test_restart_timer_names_both_gangs_and_times_failure_to_first_step(tmp_path: Path) -> None:
    health = Health(tmp_path, 0, 10.0, lambda *a, **k: None, {"world_size": 8, "dp": 2}, token="old")
    health._keep_failure(Verdict(rank=6, step=4, cause="died", silent_s=0.25))
    health._keep_failure(Verdict(rank=1, step=5, cause="died", silent_s=0.1))  # a later one waits its turn
    got: list[tuple[str, int, dict[str, object], float]] = []
    timer = RestartTimer(
        tmp_path, {"world_size": 4, "dp": 1}, lambda n, s, d, duration_s: got.append((n, s, d, duration_s))
    )
    failed_at = json.loads((tmp_path / "health" / FAILURE_FILE).read_text())["time_unix"]
    timer.stepped(4, failed_at + 0.1, attempt=1, resumed_from=4)  # the step began 0.1 s after the death
    timer.stepped(5, failed_at + 0.2, attempt=1, resumed_from=4)  # only the first step of a gang counts
    ((name, step, detail, duration),) = got
    assert (name, step, detail["failed_rank"], detail["failed_step"]) == ("restart", 4, 6, 4)
    assert (detail["from_world_size"], detail["to_world_size"], detail["from_dp"], detail["to_dp"]) == (8, 4, 2, 1)
    assert detail["first_step_start_s"] == pytest.approx(0.1) and detail["detect_s"] == pytest.approx(0.25, abs=0.01)
    assert duration >= 0.25 and duration == pytest.approx(0.1 + detail["first_step_s"])  # failure to first step's end
    assert not (tmp_path / "health" / FAILURE_FILE).exists()


def test_a_gang_sees_a_newer_claim_and_ignores_another_gangs_heartbeats(tmp_path: Path) -> None:
    old = Health(tmp_path, 0, 10.0, lambda *a, **k: None, token="old")
    old.claim()
    assert not old.superseded()
    Health(tmp_path, 0, 10.0, lambda *a, **k: None, token="new").claim()
    assert old.superseded() and not Health(tmp_path, 0, 10.0, lambda *a, **k: None).superseded()
    gone = Beat(rank=2, attempt=0, step=3, pid=99, host="h", time_unix=0.0, gang="old")
    assert diagnose([gone], 0, 100.0, 3.0, "h", lambda pid: False, gang="new") is None
    assert diagnose([gone], 0, 100.0, 3.0, "h", lambda pid: False, gang="old") is not None
