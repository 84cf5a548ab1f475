"""What a torchtitan user looks at: one step profiled on every rank (`--profile-step`), merged with the twin's
predicted step into one Perfetto trace (`twin trace`), and rank 0's TensorBoard scalars."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from executor.scalars import Scalars
from executor.train import parse_args
from plan.records import ProfileIndex, RankCoords, StepRecord, iter_records
from twin import api
from twin.cli.app import app
from twin.cli.launch import free_port, torchrun_command
from twin.step.merge_trace import MIN_EVENT_US, is_comm, merge_traces
from twin.step.predict import PredictOptions
from twin.step.trace import chrome_trace

ROOT = Path(__file__).resolve().parent.parent
SINGLE = ["--set", "layout.dp=1", "--set", "layout.tp=1", "--set", "layout.pp=1"]
PP2 = ["layout.dp=1", "layout.tp=1", "layout.pp=2"]
runner = CliRunner()


def _x(name: str, cat: str, ts: float, dur: float, base: float, tid: int = 100) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": base + ts, "dur": dur}


def _rank_trace(base: float) -> dict[str, Any]:
    """A profiled step as torch.profiler writes one, on microseconds since boot (`base`)."""
    return {
        "traceEvents": [
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 100, "args": {"name": "thread 100 (python)"}},
            _x("aten::empty", "cpu_op", -5, 1, base),  # as the profiler starts, too short: left out, not the origin
            _x("step 1", "user_annotation", 0, 1000, base),
            _x("aten::linear", "cpu_op", 10, 100, base),
            _x("aten::matmul", "cpu_op", 20, 80, base),  # depth 2: left out
            _x("aten::view", "cpu_op", 200, MIN_EVENT_US / 2, base),  # too short: left out
            _x("c10d::send", "cpu_op", 300, 20, base),  # with gloo:send, one slice 300-460
            _x("gloo:send", "user_annotation", 310, 150, base),
            _x("aten::add", "cpu_op", 320, 30, base),  # under the step, whatever communication is open
            _x("gloo:all_reduce", "user_annotation", 600, 40, base, tid=101),  # another thread's collective
            _x("Optimizer.step#AdamW.step", "user_annotation", 800, 150, base),
            _x("evaluate_function: MmBackward0", "cpu_op", 50, 100, base, tid=102),  # crosses aten::linear's end
            {**_x("ncclDevKernel_AllReduce", "kernel", 610, 20, base), "pid": 0, "tid": 7},  # device: left out
            {"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "pid": 7, "tid": 100, "ts": base + 15, "id": 1},
        ]
    }


def _names(events: list[dict[str, Any]], kind: str, pid: int) -> dict[int, str]:
    return {
        e.get("tid", -1): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == kind and e["pid"] == pid
    }


def test_merge_lays_measured_ranks_on_the_predicted_tracks_from_zero() -> None:
    plan = api.load_plan("cpu-tiny", PP2)
    predicted = chrome_trace(api.predict(plan, PredictOptions(every_microbatch=True)))
    # two ranks whose clocks differ, at microseconds since boot where float64 resolves about a nanosecond
    merged = merge_traces(predicted, {0: _rank_trace(4.5e12 + 0.125), 1: _rank_trace(4.6e12 + 77.5)}, step=1)
    events = merged["traceEvents"]
    json.dumps(merged)
    assert [e for e in events if e["pid"] == 0 and e["ph"] == "X"] == [
        e for e in predicted["traceEvents"] if e["ph"] == "X"
    ]
    assert _names(events, "process_name", 0)[-1] == "twin (predicted)"
    assert _names(events, "process_name", 1)[-1] == "measured (step 1)"
    tracks = {0: "pp rank 0", 1: "pp rank 0 comm", 2: "pp rank 1", 3: "pp rank 1 comm"}
    assert _names(events, "thread_name", 0) == _names(events, "thread_name", 1) == tracks
    measured = sorted((e["tid"], e["ts"], e["dur"], e["name"]) for e in events if e["pid"] == 1 and e["ph"] == "X")
    expected = []
    for p in (0, 1):
        compute = [(0.0, 1000.0, "step 1"), (10.0, 100.0, "aten::linear"), (320.0, 30.0, "aten::add")]
        compute.append((800.0, 150.0, "Optimizer.step#AdamW.step"))
        expected += [(2 * p, *e) for e in compute]
        expected += [(2 * p + 1, 300.0, 160.0, "gloo:send"), (2 * p + 1, 600.0, 40.0, "gloo:all_reduce")]
    assert measured == sorted(expected)


def test_communication_is_told_by_name() -> None:
    comm = ["c10d::allreduce_", "nccl:all_gather", "gloo:recv", "record_param_comms", "_c10d_functional::wait"]
    comm += ["c10d::reduce_scatter_tensor_coalesced_", "ncclDevKernel_SendRecv", "aten::all_to_all_single"]
    compute = ["aten::linear", "aten::scaled_dot_product_attention", "Optimizer.step#AdamW.step", "step 3"]
    assert all(map(is_comm, comm)) and not any(map(is_comm, compute))


def test_profile_step_passes_through_and_is_checked_before_any_rank_starts(tmp_path: Path) -> None:
    plan = api.load_plan("cpu-tiny")
    cmd = torchrun_command("cpu-tiny", plan, overrides=[], steps=3, device="cpu", out=tmp_path, profile_step=2)
    assert cmd[cmd.index("--profile-step") + 1] == "2"
    assert "--profile-step" not in torchrun_command("cpu-tiny", plan, overrides=[], steps=3, device="cpu", out=tmp_path)
    out = tmp_path / "never"
    result = runner.invoke(app, ["execute", "cpu-tiny", "--steps", "3", "--profile-step", "3", "--out", str(out)])
    assert result.exit_code == 2 and "--profile-step 3: choose a step from 0 to 2" in result.output
    assert not out.exists()
    with pytest.raises(SystemExit):
        parse_args(["--plan", "cpu-tiny", "--steps", "2", "--profile-step", "2"])
    assert parse_args(["--plan", "cpu-tiny", "--steps", "2", "--profile-step", "1"]).profile_step == 1


def _record(step: int) -> StepRecord:
    coords = RankCoords(dp=0, pp=0, cp=0, ep=0, tp=0)
    phases = {"forward": 0.25, "backward": 0.5, "comm_dp": 0.125}
    return StepRecord(
        step=step, rank=0, coords=coords, time_unix=0.0, step_s=1.0, phases=phases, tokens=64, loss=5.0 - step,
        grad_norm=2.0, lr=1e-3, peak_memory_MB=300.0, tokens_per_s=64.0, mfu=0.25,
    )  # fmt: skip


def test_without_tensorboard_scalars_write_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were not installed
    scalars = Scalars(tmp_path / "tensorboard", enabled=True)
    scalars.add(_record(0))
    scalars.close()
    assert not (tmp_path / "tensorboard").exists()


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_of_a_step_record(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    scalars = Scalars(tmp_path / "tensorboard", enabled=True)
    for step in (0, 1):
        scalars.add(_record(step))
    scalars.close()
    got = _scalars(tmp_path / "tensorboard")
    assert got["loss"] == [(0, 5.0), (1, 4.0)]
    assert got["mfu"] == [(0, 0.25), (1, 0.25)] and got["tokens_per_s"][1] == (1, 64.0)
    assert got["phase_s/backward"] == [(0, 0.5), (1, 0.5)] and got["phase_s/comm_dp"][0] == (0, 0.125)
    assert {"grad_norm", "lr", "step_s", "peak_memory_MB", "phase_s/forward", "phase_s/bubble"} <= set(got)
    off = Scalars(tmp_path / "off", enabled=False)
    off.add(_record(0))
    off.close()
    assert not (tmp_path / "off").exists()


def _check_profile(run_dir: Path, world: int) -> ProfileIndex:
    """The run's profile: an index of every rank and one Chrome trace each, holding the step's CPU ops."""
    index = ProfileIndex.model_validate_json((run_dir / "profile" / "ranks.json").read_text())
    assert index.step == 1 and [r.rank for r in index.ranks] == list(range(world))
    for entry in index.ranks:
        trace = json.loads((run_dir / "profile" / entry.trace).read_text())
        ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        assert len(ops) > 100 and all(e["dur"] >= 0 for e in ops)
        assert any(e["name"] == "step 1" for e in trace["traceEvents"])
    return index


def _check_merged(run_dir: Path, tmp: Path, pp: int) -> dict[str, Any]:
    """`twin trace` on the run: both processes, the same named tracks, the measured step from 0."""
    out = tmp / "merged.json"
    result = runner.invoke(app, ["trace", "--measured", str(run_dir), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    events = json.loads(out.read_text())["traceEvents"]
    tracks = {2 * p + i: f"pp rank {p}" + " comm" * i for p in range(pp) for i in (0, 1)}
    assert _names(events, "thread_name", 0) == _names(events, "thread_name", 1) == tracks
    measured = [e for e in events if e["pid"] == 1 and e["ph"] == "X"]
    assert summary["measured"] == len(measured) and summary["predicted"] > 0 and summary["step"] == 1
    for p in range(pp):
        mine = [e for e in measured if e["tid"] == 2 * p]
        assert min(e["ts"] for e in mine) == 0.0 and any(e["name"] == "step 1" for e in mine)
    return summary


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world of one (no torchrun) training two steps and profiling the second, TensorBoard off."""
    tmp = tmp_path_factory.mktemp("profiled")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "executor.train", "--plan", "cpu-tiny", *SINGLE, "--steps", "2"]
    cmd += ["--profile-step", "1", "--out", "run", "--no-progress", "--stats-every", "0", "--no-tensorboard"]
    result = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run"


def test_a_profiled_run_writes_chrome_traces_and_merges_with_the_twin(one_rank_run: Path, tmp_path: Path) -> None:
    index = _check_profile(one_rank_run, world=1)
    assert index.ranks[0].coords == RankCoords(dp=0, pp=0, cp=0, ep=0, tp=0)
    _check_merged(one_rank_run, tmp_path, pp=1)


def test_no_tensorboard_turns_the_scalars_off(one_rank_run: Path) -> None:
    pytest.importorskip("tensorboard")  # without it nothing is written anyway
    assert (one_rank_run / "records.jsonl").is_file() and not (one_rank_run / "tensorboard").exists()


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`twin execute` of cpu-tiny as PP2 on two gloo ranks, three steps, the second profiled."""
    out = tmp_path_factory.mktemp("pp2") / "run"
    args = ["execute", "cpu-tiny", *(a for item in PP2 for a in ("--set", item)), "--steps", "3", "--json"]
    result = runner.invoke(app, [*args, "--profile-step", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output[-3000:]
    return out


@pytest.mark.slow  # a two-rank launch, about 8 s on 2 cores
def test_twin_execute_profiles_every_rank_and_merges_both_stages(two_stage_run: Path, tmp_path: Path) -> None:
    index = _check_profile(two_stage_run, world=2)
    assert [r.coords.pp for r in index.ranks] == [0, 1]
    _check_merged(two_stage_run, tmp_path, pp=2)


@pytest.mark.slow  # the same launch
def test_rank_zero_writes_its_step_records_as_tensorboard_scalars(two_stage_run: Path) -> None:
    pytest.importorskip("tensorboard")
    got = _scalars(two_stage_run / "tensorboard")
    steps = [r for r in iter_records(two_stage_run / "records.jsonl") if isinstance(r, StepRecord) and r.rank == 0]
    assert [r.step for r in steps] == [0, 1, 2]
    for tag, value in (("loss", lambda r: r.loss), ("mfu", lambda r: r.mfu), ("lr", lambda r: r.lr)):
        assert got[tag] == [(r.step, pytest.approx(value(r), rel=1e-6)) for r in steps], tag
    assert got["phase_s/comm_pp"] == [(r.step, pytest.approx(r.phases.comm_pp, rel=1e-6)) for r in steps]
    for tag in ("grad_norm", "tokens_per_s", "peak_memory_MB", "step_s", "phase_s/forward", "phase_s/bubble"):
        assert [step for step, _ in got[tag]] == [0, 1, 2], tag
