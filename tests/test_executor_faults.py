"""The executor under faults, on real gloo ranks: kill-and-resume is bit-identical, a checkpoint reloads under
another dp (and tp) degree with the same losses, and every injected fault kind is detected and survived.

Runs go through `twin.cli.launch.torchrun_command`, the command `twin execute` starts, so torchrun's restarts
(`--max-restarts`, c10d rendezvous) are the real ones. Starting ranks dominates the cost on a 2-core machine, so
each test launches as few gangs as it can and the fault test strikes every kind in one run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from executor.ckpt_store import committed, verify
from plan import loader
from plan.records import EventRecord, StepRecord, iter_records
from twin.cli.launch import child_env, summarise, torchrun_command

ROOT = Path(__file__).resolve().parent.parent
DP2 = ["layout.tp=1", "layout.pp=1", "layout.dp=2"]


def launch(tmp: Path, name: str, overrides: list[str], steps: int, inject: tuple[str, ...] = (), **kw: Any) -> Path:
    """Run cpu-tiny (or the `preset` given) with `overrides` as `twin execute` would; the run directory."""
    out, preset = tmp / name, kw.get("preset", "cpu-tiny")
    plan = loader.load(preset, overrides)
    restarts = sum(not f.startswith(("slow", "bitflip", "disk-full")) for f in inject)
    cmd = torchrun_command(
        preset, plan, overrides=overrides, steps=steps, device="cpu", out=out, inject=list(inject),
        max_restarts=restarts,
    )  # fmt: skip
    cmd += ["--no-progress", "--stats-every", "0", *kw.get("extra", [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(1), capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def rank0_steps(run: Path) -> dict[int, StepRecord]:
    """Rank 0's record of each step; a step run twice (before and after a restart) keeps its last record."""
    return {r.step: r for r in iter_records(run / "records.jsonl") if isinstance(r, StepRecord) and r.rank == 0}


def events(run: Path, name: str) -> list[EventRecord]:
    return [r for r in iter_records(run / "records.jsonl") if isinstance(r, EventRecord) and r.event == name]


def final_state(run: Path, tmp: Path) -> dict[str, Any]:
    newest = committed(run / "checkpoints")[0]
    assert verify(newest) is None
    dcp_to_torch_save(newest, tmp / f"{run.name}.pt")
    state: dict[str, Any] = torch.load(tmp / f"{run.name}.pt", weights_only=False)
    return state


@pytest.mark.slow  # a long 8-rank gang, run twice (70 s on 2 cores): CI's slow step
@pytest.mark.timeout(400)
def test_kill_and_resume_is_bit_identical_on_dp2_tp2_pp2(tmp_path: Path) -> None:
    """A rank killed at step 3 of (2,2,2): the gang restarts from the step-2 checkpoint (written asynchronously)
    and ends with the same losses, gradient norms, weights and optimizer state as a run never interrupted."""
    every2 = ["reliability.checkpoint_every_steps=2"]
    clean = launch(tmp_path, "clean", [*every2, "reliability.checkpoint=sync"], steps=5)
    killed = launch(tmp_path, "killed", [*every2, "reliability.checkpoint=async"], steps=5, inject=("crash@3:5",))
    want, got = rank0_steps(clean), rank0_steps(killed)
    assert sorted(got) == list(range(5))
    assert [(got[s].loss, got[s].grad_norm) for s in got] == [(want[s].loss, want[s].grad_norm) for s in want]
    assert [e.detail["path"].endswith("step_00000002") for e in events(killed, "resume")] == [True]
    (detected,) = events(killed, "detected")
    assert detected.rank == 5 and detected.step == 3 and detected.detail["cause"] == "died"
    assert_same_state(final_state(clean, tmp_path), final_state(killed, tmp_path))


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for part in ("model", "optim"):
        for key, value in a[part].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[part][key]), f"{part}.{key}"


MOE_RESUMED = {
    "replicated": ["layout.tp=1", "layout.dp=2", "layout.ep=2", "layout.zero=0"],
    "fsdp": ["layout.tp=1", "layout.dp=2", "layout.ep=2", "layout.zero=1"],
    "tp2-sp-capacity": [
        "layout.tp=2",
        "layout.sequence_parallel=true",
        "layout.dp=1",
        "layout.ep=1",
        "model.capacity_factor=1.0",
    ],
}


@pytest.mark.slow  # four launches of the MoE preset, about 40 s on 2 cores
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", MOE_RESUMED.values(), ids=MOE_RESUMED.keys())
def test_moe_kill_and_resume_is_bit_identical_and_reshards_over_ep(tmp_path: Path, layout: list[str]) -> None:
    """Two ranks — DP2 with the experts over EP2 (whole, or FSDP2-sharded apart from the dense weights), or TP2
    with sequence parallelism routing each rank's shard under a capacity — a rank killed at step 3: the same
    losses, gradient norms, weights and optimizer state as a run never interrupted; and one rank (every expert)
    resumes its step-2 checkpoint and goes on with the same losses (each expert found by its name)."""
    two = ["layout.pp=1", *layout, "reliability.checkpoint=sync"]
    two += ["reliability.checkpoint_every_steps=2", "reliability.keep_checkpoints=2"]
    clean = launch(tmp_path, "clean", two, steps=4, preset="cpu-tiny-moe")
    killed = launch(tmp_path, "killed", two, steps=4, inject=("crash@3:1",), preset="cpu-tiny-moe")
    want, got = rank0_steps(clean), rank0_steps(killed)
    assert sorted(got) == list(range(4)) and len(events(killed, "resume")) == 1
    assert [(got[s].loss, got[s].grad_norm) for s in got] == [(want[s].loss, want[s].grad_norm) for s in want]
    assert_same_state(final_state(clean, tmp_path), final_state(killed, tmp_path))
    single = ["layout.tp=1", "layout.pp=1", "layout.dp=1", "layout.ep=1", "layout.sequence_parallel=false"]
    single += [x for x in layout if x.startswith("model.")]
    start = ["--resume-from", str(clean / "checkpoints" / "step_00000002")]
    narrow = rank0_steps(launch(tmp_path, "ep1", single, steps=4, preset="cpu-tiny-moe", extra=start))
    assert sorted(narrow) == [2, 3]
    torch.testing.assert_close(
        torch.tensor([narrow[s].loss for s in (2, 3)]),
        torch.tensor([want[s].loss for s in (2, 3)]),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.slow  # three launches, 12 s on 2 cores
@pytest.mark.timeout(300)
def test_resume_under_another_dp_degree_continues_with_matching_loss(tmp_path: Path) -> None:
    """Steps 2-3 of a dp=2 run, resumed from its step-2 checkpoint by one rank (dp=1), give the same losses."""
    every2 = ["reliability.checkpoint_every_steps=2", "reliability.keep_checkpoints=2"]
    wide = launch(tmp_path, "dp2", [*DP2, *every2], steps=4)
    single = ["layout.tp=1", "layout.pp=1", "layout.dp=1"]
    start = wide / "checkpoints" / "step_00000002"
    narrow = launch(tmp_path, "dp1", single, steps=4, extra=["--resume-from", str(start)])
    want, got = rank0_steps(wide), rank0_steps(narrow)
    assert sorted(got) == [2, 3]
    torch.testing.assert_close(
        torch.tensor([got[s].loss for s in (2, 3)]), torch.tensor([want[s].loss for s in (2, 3)]), rtol=1e-5, atol=1e-5
    )
    (resume,) = events(narrow, "resume")
    assert resume.detail["layout"]["dp"] == 2


@pytest.mark.slow  # every fault kind in one long gang (30 s on 2 cores): CI's slow step
@pytest.mark.timeout(500)
def test_every_fault_kind_is_detected_and_the_run_completes(tmp_path: Path) -> None:
    """One dp=2 run struck by all six kinds; each is detected and recovered from, the run reaches its last step,
    and the checkpoint a rank died writing is never committed: the gang resumes from the one before."""
    inject = ("disk-full@1:1", "slow@2:1", "bitflip@4:1", "crash@6:1", "ckpt-crash@7:0", "hang@9:1")
    sets = [*DP2, "reliability.checkpoint_every_steps=2", "reliability.heartbeat_timeout_s=3"]
    run = launch(tmp_path, "faults", sets, steps=12, inject=inject)
    assert sorted(rank0_steps(run)) == list(range(12))
    faults = {e.detail["label"]: e for e in events(run, "fault")}
    assert sorted(faults) == sorted(inject)
    recovered = {e.detail["label"]: e for e in events(run, "recovered")}
    assert sorted(recovered) == sorted(faults)
    detected = events(run, "detected")
    for label, fault in faults.items():
        assert any(d.rank == fault.rank and d.time_unix >= fault.time_unix for d in detected), label
    assert recovered["bitflip@4:1"].detail["steps_lost"] == 1  # rolled back to the checkpoint after step 3
    resumes = [e.detail["path"].rsplit("_", 1)[-1] for e in events(run, "resume")]
    assert resumes == ["00000006", "00000006", "00000008"]  # crash@6, then ckpt-crash while writing step 8, hang@9
    assert [e.detail["to_step"] for e in events(run, "rollback")] == [4]
    (full,) = events(run, "checkpoint-failed")
    assert "rank 1: No space left on device" in full.detail["reason"] and full.step == 2
    assert all(verify(p) is None for p in committed(run / "checkpoints"))
    assert not list((run / "checkpoints").glob(".tmp-*"))
    summary = summarise(run)  # what `twin execute` prints: 12 steps, not 14 step records
    assert (summary["steps"], summary["restarts"], summary["steps_replayed"]) == (12, 3, 2)  # steps 6 and 8 again


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_under_another_tp_degree_continues_with_matching_loss(tmp_path: Path) -> None:
    """DCP reshards the tensor-parallel DTensor shards of a tp=2 checkpoint onto one rank."""
    every2 = ["reliability.checkpoint_every_steps=2", "reliability.keep_checkpoints=2"]
    wide = launch(tmp_path, "tp2", ["layout.dp=1", "layout.pp=1", "layout.tp=2", *every2], steps=4)
    start = wide / "checkpoints" / "step_00000002"
    single = ["layout.dp=1", "layout.pp=1", "layout.tp=1"]
    narrow = launch(tmp_path, "tp1", single, steps=4, extra=["--resume-from", str(start)])
    want, got = rank0_steps(wide), rank0_steps(narrow)
    torch.testing.assert_close(
        torch.tensor([got[s].loss for s in (2, 3)]), torch.tensor([want[s].loss for s in (2, 3)]), rtol=1e-5, atol=1e-5
    )
