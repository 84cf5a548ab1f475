"""Time from losing a node to the first step of the smaller gang, on this machine, per rendezvous setting.

Two simulated nodes on loopback, each a `twin execute cpu-tiny --nnodes 1:2` of 4 ranks (together the plan's
(2,2,2) on 8 gloo ranks), checkpointing every 2 steps. After rank 0 records step 3, the second node dies as a
machine does: its twin, torchrun agent and workers are SIGKILLed at once. The first node's gang stops (its
watchdog names a dead rank), rendezvouses alone once the lost node's keep-alive has expired and the last call
has passed, and resumes from the step-4 checkpoint with dp 2 -> 1. From the records: the `restart` event
(failure = the dead rank's last heartbeat, to the end of the first new step), split into detection, the time
until the new gang has loaded the checkpoint (its `start` event: rendezvous, process start, process groups,
model build, DCP load), and the first step; the rendezvous itself from the agent's log (LOGLEVEL=INFO).
Writes benchmarks/results/elastic_shrink.json and prints a Markdown table.

    python benchmarks/elastic_shrink.py [--settings default,last-call-2,fast] [--repeats 1]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plan.records import EventRecord, StepRecord, iter_records  # noqa: E402
from twin.cli.launch import free_port  # noqa: E402

SETTINGS = {
    "default": "",  # torch's: keep-alive every 5 s, dead after 3 missed; last call 30 s
    "last-call-2": "last_call_timeout=2",
    "fast": "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5",
}
SETS = ["reliability.checkpoint_every_steps=2", "reliability.heartbeat_timeout_s=10"]
STEPS, KILL_AFTER = 10, 3
LOG_TIME = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) \d+ .*api\.py:\d+\] \[default\] (Rendezvous.*)$")


def node_command(out: Path, port: int, rdzv: str) -> list[str]:
    cmd = [sys.executable, "-m", "twin.cli", "execute", "cpu-tiny", "--nnodes", "1:2", "--master-port", str(port)]
    cmd += ["--out", str(out), "--steps", str(STEPS), *(a for s in SETS for a in ("--set", s))]
    return [*cmd, *(["--rdzv-conf", rdzv] if rdzv else [])]


def kill_tree(pid: int) -> None:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                parent = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    todo = [pid]
    while todo:
        victim = todo.pop()
        todo += children.get(victim, [])
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def rendezvous_s(log: Path, after_unix: float) -> float | None:
    """Seconds the surviving agent spent in its rendezvous after the failure, from its INFO log lines."""
    year, starts, ends = dt.date.today().year, [], []
    for line in log.read_text(errors="replace").splitlines():
        found = LOG_TIME.match(line)
        if found:
            when = dt.datetime.strptime(f"{year}{found[1]} {found[2]}", "%Y%m%d %H:%M:%S.%f").timestamp()
            if when >= after_unix:
                (starts if found[3].startswith("Rendezvous'ing") else ends).append(when)
    return ends[0] - starts[0] if starts and ends else None


def measure(setting: str, tmp: Path) -> dict[str, Any]:
    out, port = tmp / setting / "run", free_port()
    out.parent.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOGLEVEL": "INFO"}
    logs = [out.parent / f"node{i}.log" for i in range(2)]
    nodes = []
    cmd = node_command(out, port, SETTINGS[setting])
    for log in logs:
        with log.open("wb") as sink:
            nodes.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT))
        time.sleep(0.5)  # the first node hosts the rendezvous store, which must outlive the lost one
    records = out / "records.jsonl"
    deadline = time.monotonic() + 900
    while not records.exists() or not any(
        isinstance(r, StepRecord) and r.rank == 0 and r.step == KILL_AFTER for r in iter_records(records)
    ):
        if any(n.poll() is not None for n in nodes) or time.monotonic() > deadline:
            for n in nodes:
                kill_tree(n.pid)
            raise SystemExit(f"{setting}: a node ended early or step {KILL_AFTER} never came; see {logs}")
        time.sleep(0.2)
    kill_tree(nodes[1].pid)
    nodes[1].wait(timeout=60)
    if nodes[0].wait(timeout=900):
        raise SystemExit(f"{setting}: the surviving node failed; see {logs[0]}")
    events = [r for r in iter_records(records) if isinstance(r, EventRecord)]
    (restart,) = [e for e in events if e.event == "restart"]
    failed_at = restart.time_unix - restart.duration_s
    start = next(e for e in events if e.event == "start" and e.time_unix > failed_at)
    d = restart.detail
    return {
        "setting": setting,
        "rdzv_conf": SETTINGS[setting] or "(torch defaults)",
        "from_world": d["from_world_size"],
        "to_world": d["to_world_size"],
        "failure_to_first_step_s": restart.duration_s,
        "detect_s": d["detect_s"],
        "rendezvous_s": rendezvous_s(logs[0], failed_at),
        "failure_to_checkpoint_loaded_s": start.time_unix - failed_at,
        "first_step_s": d["first_step_s"],
        "resumed_step": d["resumed_step"],
        "failed_step": d["failed_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for setting in args.settings.split(","):
                rows.append(measure(setting, Path(tmp) / str(repeat)))
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_1min_at_end": os.getloadavg()[0],
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    (ROOT / "benchmarks" / "results" / "elastic_shrink.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| rdzv conf | world | failure → first new step (s) | detect | rendezvous | → checkpoint loaded | 1st step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rdzv = f"{r['rendezvous_s']:.1f}" if r["rendezvous_s"] is not None else "?"
        print(
            f"| {r['rdzv_conf']} | {r['from_world']} → {r['to_world']} | {r['failure_to_first_step_s']:.1f} | "
            f"{r['detect_s']:.2f} | {rdzv} | {r['failure_to_checkpoint_loaded_s']:.1f} | {r['first_step_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
