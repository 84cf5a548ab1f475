"""Single-GPU bf16 throughput and MFU of the executor on a ~1B-parameter plan (gpt-1b-h100).

Runs the real executor (`python -m executor.train`, a world of one) for a few steps, then reads rank 0's step
records: median tokens/s and MFU over the steps after warm-up (compilation and allocator growth happen in the
first ones), the phase split that says what limits it, and peak memory. Prints them and writes them to
benchmarks/results/executor_gpu.json (executor_gpu_tiny.json for the CPU smoke test).

    python benchmarks/executor_gpu.py                       # H100: gpt-1b-h100, bf16, torch.compile per layer
    python benchmarks/executor_gpu.py --device cpu --tiny   # a smoke test of this script on any machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plan.records import StepRecord, iter_records  # noqa: E402
from twin.cli.launch import free_port  # noqa: E402

PLAN = "gpt-1b-h100"
TINY = ["model=tiny", "cluster=localhost-cpu", "layout.microbatch_size=2", "training.global_batch=4"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny model on localhost-cpu: a smoke test")
    p.add_argument("--steps", type=int, default=None, help="steps to run (default 30, tiny 4)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (default 10, tiny 1)")
    p.add_argument("--no-compile", action="store_true", help="eager mode (compile is on for cuda by default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="plan overrides")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default benchmarks/results/...)")
    return p.parse_args()


def run_executor(args: argparse.Namespace, run_dir: Path, steps: int) -> None:
    overrides = [*(TINY if args.tiny else []), *args.overrides]
    cmd = [sys.executable, "-m", "executor.train", "--plan", PLAN, "--device", args.device, "--steps", str(steps)]
    cmd += ["--out", str(run_dir), "--stats-every", "0", "--no-progress"]
    for item in overrides:
        cmd += ["--set", item]
    if args.device == "cuda" and not args.no_compile:
        cmd.append("--compile")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=3600)


def summarise(run_dir: Path, warmup: int) -> dict[str, object]:
    steps = [r for r in iter_records(run_dir / "records.jsonl") if isinstance(r, StepRecord) and r.rank == 0]
    steady = steps[warmup:] or steps[-1:]
    phases = {k: statistics.median(getattr(r.phases, k) for r in steady) for k in ("forward", "backward", "optimizer")}
    return {
        "steps_measured": len(steady),
        "tokens_per_s": statistics.median(r.tokens_per_s or 0.0 for r in steady),
        "mfu": statistics.median(r.mfu or 0.0 for r in steady),
        "step_s": statistics.median(r.step_s for r in steady),
        "phases_s": phases,
        "peak_memory_MB": max(r.peak_memory_MB for r in steps),
        "final_loss": steps[-1].loss,
    }


def main() -> None:
    args = parse_args()
    steps = args.steps or (4 if args.tiny else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 10)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        run_executor(args, run_dir, steps)
        compiled = args.device == "cuda" and not args.no_compile
        result = {"plan": PLAN, "device": args.device, "tiny": args.tiny, "compile": compiled,
                  "overrides": args.overrides, **summarise(run_dir, warmup)}  # fmt: skip
        manifest = json.loads((run_dir / "manifest.json").read_text())
    result["torch"] = manifest["torch_version"]
    result["git_commit"] = manifest["git_commit"]
    name = "executor_gpu_tiny.json" if args.tiny else "executor_gpu.json"
    out = args.out or ROOT / "benchmarks" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{PLAN}{' (tiny)' if args.tiny else ''} on {args.device}: {result['tokens_per_s']:,.0f} tokens/s, "
          f"MFU {100 * float(result['mfu']):.1f}%, step {result['step_s']:.3f} s, "  # type: ignore[arg-type]
          f"peak memory {float(result['peak_memory_MB']) / 1e3:.1f} GB → {out}")  # type: ignore[arg-type]  # fmt: skip


if __name__ == "__main__":
    main()
