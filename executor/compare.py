"""Run several variants of one plan in one process group and write each one's job losses, step by step.

`torchrun --nproc-per-node N -m executor.compare --plan PLAN --variants variants.json --steps 3 --out losses.json`

`variants.json` maps a name to a list of `section.field=value` overrides; every variant must need N ranks. The
output maps each name to its steps' job-wide mean losses and gradient norms (before clipping): the norm catches
a gradient that is wrong only in scale, which Adam's normalisation and clipping would hide from the losses.
Starting the ranks once and running the variants in turn saves the process start-up (several seconds per rank on
a small CPU machine) that a launch per variant would pay. The sharded-against-single-process tests use it, with
the single-process reference as a run of its own (N = 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from executor.train import init_distributed, parse_args, run_training
from plan import loader


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="executor.compare")
    p.add_argument("--plan", required=True)
    p.add_argument("--variants", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--mixed-precision", action="store_true", help="bf16 compute on CPU too (the precision check)")
    args = p.parse_args(argv)
    variants: dict[str, list[str]] = json.loads(args.variants.read_text())
    device = init_distributed("cpu", args.timeout_s)
    losses: dict[str, dict[str, list[float]]] = {}
    for name, overrides in variants.items():
        plan = loader.load(args.plan, overrides)
        run_args = parse_args(
            [
                "--plan",
                args.plan,
                "--steps",
                str(args.steps),
                "--out",
                str(args.out.parent / f"run-{name}"),
                "--stats-every",
                "0",
                "--no-progress",
                *(["--mixed-precision"] if args.mixed_precision else []),
            ]
        )
        results = run_training(plan, run_args, device)
        losses[name] = {"loss": [r.job_loss for r in results], "grad_norm": [r.grad_norm for r in results]}
        if dist.get_rank() == 0:
            print(f"{name}: {losses[name]}", flush=True)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(losses, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
