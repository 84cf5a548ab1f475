"""Fault-tolerance pieces without a launcher: the fault grammar and its one-line errors, the checkpoint store's
atomic commit, checksums, retention and corrupt-skip, the watchdog's verdicts, and the bit-flip checksum."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from executor import health
from executor.ckpt_store import clean_staging, commit, committed, final_dir, latest_good, prune, staging_dir, verify
from executor.faults import flip_bit, weight_checksum
from executor.health import Beat, Health, Verdict, diagnose
from executor.train import _peer_failure
from plan import loader
from plan.reliability import FaultSpec
from twin.cli.app import app


def test_fault_grammar_and_its_one_line_errors() -> None:
    assert FaultSpec.parse("crash@5:3") == FaultSpec(kind="crash", step=5, rank=3)
    assert FaultSpec.parse("disk-full@2").rank == 0
    with pytest.raises(ValueError, match="unknown kind 'boom'; use one of crash, hang, slow, bitflip"):
        FaultSpec.parse("boom@1")
    for bad in ("crash", "crash@x", "crash@1:y", "crash@-1"):
        with pytest.raises(ValueError, match="write KIND@STEP"):
            FaultSpec.parse(bad)
    with pytest.raises(loader.PlanError, match="names rank 9, but the layout has 8 ranks"):
        loader.load("cpu-tiny", ['reliability.faults=["hang@2:9"]'])


@pytest.mark.parametrize(
    ("inject", "message"),
    [("nuke@3", "--inject: fault 'nuke@3': unknown kind 'nuke'"), ("crash@3:8", "rank 8 is not among the plan's 8")],
)
def test_twin_execute_bad_injection_is_one_line(inject: str, message: str) -> None:
    result = CliRunner().invoke(app, ["execute", "cpu-tiny", "--inject", inject])
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


def _checkpoint(root: Path, step: int, payload: bytes = b"weights") -> Path:
    staging = staging_dir(root, step)
    staging.mkdir(parents=True)
    (staging / "__0_0.distcp").write_bytes(payload)
    return commit(staging, final_dir(root, step), {"step": step})


def test_commit_is_atomic_and_a_corrupt_checkpoint_is_skipped_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 4)
    staging_dir(tmp_path, 6).mkdir()  # a write that a crash cut short: never a candidate
    assert [p.name for p in committed(tmp_path)] == ["step_00000004", "step_00000002"]
    (newest / "__0_0.distcp").write_bytes(b"weightz")  # same size, one byte off
    assert verify(newest) == "__0_0.distcp does not match its checksum"
    info = latest_good(tmp_path)
    assert info is not None and info.step == 2
    assert f"warning: skipping corrupt checkpoint {newest}: __0_0.distcp does not match" in capsys.readouterr().err
    clean_staging(tmp_path)
    assert not staging_dir(tmp_path, 6).exists()


def test_prune_keeps_the_newest_k(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _checkpoint(tmp_path, step)
    prune(tmp_path, keep=2)
    assert [p.name for p in committed(tmp_path)] == ["step_00000008", "step_00000006"]


def test_watchdog_names_the_dead_or_the_longest_silent_rank() -> None:
    now = 1000.0

    def beat(rank: int, t: float, pid: int = 1, attempt: int = 0, done: bool = False) -> Beat:
        return Beat(rank, attempt, 7, pid, "h", t, done)

    def alive(pid: int) -> bool:
        return pid != 99

    assert diagnose([beat(0, now), beat(1, now - 1)], 0, now, 3.0, "h", alive) is None
    hung = diagnose([beat(0, now), beat(1, now - 5)], 0, now, 3.0, "h", alive)
    assert hung is not None and (hung.rank, hung.step, hung.cause) == (1, 7, "hung")
    assert "rank 1 hung at step 7 (no heartbeat for 5.0 s > 3.0 s)" in hung.message(3.0)
    # Two gone: the first to fall (silent longest) is the culprit; a rank that left on purpose is never blamed.
    beats = [beat(0, now - 0.2, 99), beat(1, now - 0.4, 99), beat(2, now - 9, done=True)]
    died = diagnose(beats, 0, now, 3.0, "h", alive)
    assert died is not None and (died.rank, died.cause) == (1, "died")
    assert diagnose([beat(0, now - 50, attempt=0)], 1, now, 3.0, "h", alive) is None  # an earlier attempt's


class _Exited(Exception):
    pass


def test_a_rank_records_its_verdict_once_however_many_of_its_threads_reach_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog thread and torchrun's SIGTERM (or a failed collective) can name the dead rank at once: one
    `detected` event, one failure.json, and the handler leaves the first verdict to finish (CI saw two events)."""
    recorded: list[tuple[Any, ...]] = []

    def leave(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(health.os, "_exit", leave)
    me = Health(tmp_path, 0, 3.0, lambda *a, **kw: recorded.append(a), token="g")
    me._write()
    verdict = Verdict(5, 3, "died", 0.4)
    with pytest.raises(_Exited):
        me.fail(verdict)
    assert me._on_sigterm(15, None) is None  # returns to the verdict it interrupted instead of a second one
    second = threading.Thread(target=me.fail, args=(verdict,), daemon=True)  # parks until the first exits
    second.start()
    second.join(timeout=3 * me.period)
    assert second.is_alive()
    assert [(name, step, detail["cause"]) for name, step, detail in recorded] == [("detected", 3, "died")]
    assert (tmp_path / "health" / health.FAILURE_FILE).exists()


def test_a_finished_rank_stays_done_whatever_its_heartbeat_thread_writes_after(tmp_path: Path) -> None:
    """The heartbeat thread can be past its wait when the main thread finishes: its next beat must not undo the
    done one, or the rank's exit is taken for a death and the gang fails at its very end (seen in CI: every step
    trained and checkpointed, then a peer's watchdog exited 4)."""
    me = Health(tmp_path, 1, 3.0, lambda *a, **kw: None, token="g")
    me._write()
    me.finish()
    me._write()  # the heartbeat thread's beat, a moment late
    (beat,) = me.read()
    assert beat.done
    assert diagnose([beat], me.attempt, beat.time_unix + 60.0, 3.0, me.host, lambda pid: False, "g") is None


def test_a_flipped_bit_changes_the_checksum_and_little_else() -> None:
    layer = torch.nn.Linear(8, 8)
    params = list(layer.parameters())
    before, weight = weight_checksum(params), layer.weight.detach().clone()
    flip_bit(params)
    assert weight_checksum(params) != before
    changed = (layer.weight != weight).nonzero().tolist()
    assert changed == [[0, 0]] and torch.isfinite(layer.weight).all()


def test_a_peer_failure_is_recognised_through_wrapping() -> None:
    try:
        try:
            raise RuntimeError("[gloo/pair.cc:537] Read error: Connection reset by peer")
        except RuntimeError as inner:
            raise RuntimeError("[Stage 1] failed to run forward") from inner
    except RuntimeError as outer:
        assert _peer_failure(outer)
    assert not _peer_failure(RuntimeError("shape mismatch"))
    assert os.environ.get("TORCHELASTIC_RESTART_COUNT") is None
