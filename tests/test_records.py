"""Run records: round trip, a malformed line is rejected with its line number, a torn last line is skipped."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from plan import loader
from plan.records import (
    EventRecord,
    RankCoords,
    RecordError,
    RunManifest,
    StepRecord,
    iter_records,
    read_manifest,
    steps_frame,
)


def step(step: int, rank: int, **kw: object) -> StepRecord:
    return StepRecord(
        step=step,
        rank=rank,
        coords=RankCoords(dp=rank, pp=0, cp=0, ep=0, tp=0),
        time_unix=time.time(),
        step_s=0.5,
        tokens=1024,
        loss=2.0,
        **kw,
    )  # type: ignore[arg-type]


def write(path: Path, records: list) -> None:
    path.write_text("".join(r.model_dump_json() + "\n" for r in records))


def test_records_round_trip_and_frame(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    recs = [
        step(0, 0, phases={"forward": 0.2, "backward": 0.25}),
        step(0, 1),
        EventRecord(event="checkpoint", step=0, time_unix=time.time(), duration_s=1.5),
    ]
    write(path, recs)
    assert list(iter_records(path)) == recs
    frame = steps_frame(path)
    assert len(frame) == 2 and frame.loc[0, "forward"] == 0.2 and frame.loc[1, "forward"] == 0.0


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ('{"kind": "step", "step": 1}', "rank"),
        ("not json at all", "json"),
        ('{"kind": "weather", "step": 1}', "kind"),
        (
            '{"kind": "step", "step": -1, "rank": 0, "coords": {"dp":0,"pp":0,"cp":0,"ep":0,"tp":0},'
            ' "time_unix": 0, "step_s": 1, "tokens": 1}',
            "step",
        ),
    ],
)
def test_malformed_line_is_rejected_with_its_line_number(tmp_path: Path, bad: str, needle: str) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text(step(0, 0).model_dump_json() + "\n" + bad + "\n" + step(1, 0).model_dump_json() + "\n")
    with pytest.raises(RecordError) as info:
        list(iter_records(path))
    assert f"{path}:2:" in str(info.value)
    assert needle.lower() in str(info.value).lower()


def test_torn_last_line_from_a_crash_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    whole = step(0, 0).model_dump_json() + "\n"
    path.write_text(whole + step(1, 0).model_dump_json()[:40])
    assert [r.step for r in iter_records(path)] == [0]


def test_unknown_record_field_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    obj = json.loads(step(0, 0).model_dump_json())
    obj["gpu_temp"] = 80
    path.write_text(json.dumps(obj) + "\n")
    with pytest.raises(RecordError, match="gpu_temp"):
        list(iter_records(path))


def test_manifest_round_trip_and_errors(tmp_path: Path) -> None:
    plan = loader.load("cpu-tiny")
    manifest = RunManifest(
        run_id="r1",
        created_unix=time.time(),
        plan=plan,
        plan_sha256="0" * 64,
        torch_version="2.13.0",
        python_version="3.11",
        device="cpu",
        backend="gloo",
        world_size=8,
        hosts=("vm",) * 8,
    )
    (tmp_path / "manifest.json").write_text(manifest.model_dump_json())
    assert read_manifest(tmp_path) == manifest
    with pytest.raises(RecordError, match="run directory"):
        read_manifest(tmp_path / "missing")
    (tmp_path / "manifest.json").write_text('{"run_id": 3}')
    with pytest.raises(RecordError, match=r"manifest\.json"):
        read_manifest(tmp_path)
