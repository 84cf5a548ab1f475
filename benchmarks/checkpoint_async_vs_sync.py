"""Training stall of async against sync checkpointing of the same state.

Trains the same ~30M-parameter model (AdamW: ~0.4 GB of state) twice as one process on CPU, checkpointing every
`--every` steps, once with `reliability.checkpoint=sync` and once with `async`, and reads back what the run
records say: each checkpoint's stall (the step record's `checkpoint` phase: the whole write for sync; for async
the staging copy into host memory plus any wait for the previous write) and the plain steps' time (async writes
share the CPU with training). Prints the figures and writes benchmarks/results/checkpoint_async_vs_sync.json.

    python benchmarks/checkpoint_async_vs_sync.py [--steps 9] [--every 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plan.records import StepRecord, iter_records  # noqa: E402

MODEL = ["model.layers=8", "model.hidden=512", "model.heads=8", "model.kv_heads=8", "model.ffn_hidden=1408"]
LAYOUT = ["layout.dp=1", "layout.tp=1", "layout.pp=1", "layout.microbatch_size=2", "training.global_batch=2"]


def run(kind: str, steps: int, every: int, out: Path) -> dict[str, float]:
    """One run with checkpoints of `kind`; its mean checkpoint stall and plain step time (seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sets = [*MODEL, *LAYOUT, f"reliability.checkpoint={kind}", f"reliability.checkpoint_every_steps={every}"]
    cmd = [sys.executable, "-m", "executor.train", "--plan", "cpu-tiny", "--steps", str(steps), "--out", str(out)]
    cmd += [arg for item in sets for arg in ("--set", item)] + ["--no-progress", "--stats-every", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=1800)
    records = [r for r in iter_records(out / "records.jsonl") if isinstance(r, StepRecord)]
    stalls = [r.phases.checkpoint for r in records if r.phases.checkpoint > 0 and r.step < steps - 1]
    plain = [r.step_s for r in records[1:] if r.phases.checkpoint == 0]  # step 0 pays for warm-up
    return {"stall_s": statistics.median(stalls), "checkpoints": len(stalls), "plain_step_s": statistics.median(plain)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "checkpoint_async_vs_sync.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = {kind: run(kind, args.steps, args.every, Path(tmp) / kind) for kind in ("sync", "async")}
    ratio = figures["sync"]["stall_s"] / figures["async"]["stall_s"]
    result = {"model": MODEL, "steps": args.steps, "every": args.every, **figures, "sync_over_async_stall": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for kind in ("sync", "async"):
        f = figures[kind]
        print(f"{kind:5}: stall {f['stall_s'] * 1e3:7.1f} ms per checkpoint, plain step {f['plain_step_s']:.3f} s")
    print(f"sync stalls training {ratio:.1f}x as long as async -> {args.out}")


if __name__ == "__main__":
    main()
