"""Detection time, recovery time and steps lost of each injected fault kind, measured on this machine.

One run per kind of the tiny model as dp=2 on two gloo ranks (`twin execute`'s torchrun command, with
`--max-restarts` for the kinds that kill a rank), checkpointing every 2 steps, heartbeat timeout 3 s, the fault
striking rank 1 (rank 0 for ckpt-crash) at step 5. From each run's event records: detection = the first
`detected` event's time less the `fault` event's; recovery = the `recovered` event's time less the fault's
(restart kinds: to the first step completed after the restart; bitflip: after the rollback; slow: when it ends;
disk-full: the next committed checkpoint); steps lost = steps computed again. Writes
benchmarks/results/fault_table.json and prints a Markdown table.

    python benchmarks/fault_table.py [--kinds crash,hang] [--plan cpu-tiny-moe]

With `--plan cpu-tiny-moe` the same runs use the tiny MoE model, its eight experts split over the two ranks (ep 2):
resume restores each rank's own experts, and the SDC check compares dense weights across replicas and each
expert among its own copies. Writes fault_table_moe.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plan import loader  # noqa: E402
from plan.records import EventRecord, iter_records  # noqa: E402
from plan.reliability import FAULT_KINDS  # noqa: E402
from twin.cli.launch import child_env, torchrun_command  # noqa: E402

SETS = ["layout.dp=2", "layout.tp=1", "layout.pp=1", "reliability.checkpoint_every_steps=2"]
SETS += ["reliability.heartbeat_timeout_s=3", "reliability.checkpoint=sync"]
STEPS, AT = 8, 5


def measure(kind: str, tmp: Path, preset: str = "cpu-tiny") -> dict[str, Any]:
    fault = f"{kind}@{AT}:{0 if kind == 'ckpt-crash' else 1}"
    out = tmp / kind
    plan = loader.load(preset, SETS)
    restarts = int(kind in ("crash", "hang", "ckpt-crash"))
    cmd = torchrun_command(
        preset, plan, overrides=SETS, steps=STEPS, device="cpu", out=out, inject=[fault], max_restarts=restarts
    )
    proc = subprocess.run(
        [*cmd, "--no-progress"], cwd=ROOT, env=child_env(1), capture_output=True, text=True, timeout=1800
    )
    if proc.returncode:
        raise SystemExit(f"{kind}: the run failed:\n{proc.stderr[-3000:]}")
    events = [r for r in iter_records(out / "records.jsonl") if isinstance(r, EventRecord)]
    (struck,) = [e for e in events if e.event == "fault"]
    detected = min(e.time_unix for e in events if e.event == "detected" and e.time_unix >= struck.time_unix)
    (recovered,) = [e for e in events if e.event == "recovered"]
    return {
        "kind": kind,
        "fault": fault,
        "detection_s": detected - struck.time_unix,
        "recovery_s": recovered.time_unix - struck.time_unix,
        "steps_lost": recovered.detail["steps_lost"],
        "restarts": sum(e.event == "resume" for e in events),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(FAULT_KINDS))
    p.add_argument("--plan", default="cpu-tiny", help="cpu-tiny, or cpu-tiny-moe: dp2 with the experts over ep2")
    p.add_argument("--out", type=Path, help="default benchmarks/results/fault_table[_PLAN].json")
    args = p.parse_args()
    suffix = "" if args.plan == "cpu-tiny" else "_" + args.plan.removeprefix("cpu-tiny-")
    out = args.out or ROOT / "benchmarks" / "results" / f"fault_table{suffix}.json"
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(kind, Path(tmp), args.plan) for kind in args.kinds.split(",")]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"plan": args.plan, "steps": STEPS, "settings": SETS, "rows": rows}, indent=1) + "\n")
    print("| fault | detection (s) | recovery (s) | steps lost |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['detection_s']:.2f} | {r['recovery_s']:.2f} | {r['steps_lost']} |")


if __name__ == "__main__":
    main()
