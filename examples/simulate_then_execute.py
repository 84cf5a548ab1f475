"""Simulate, then execute: predict a plan's step with the twin, run the same layout for real, compare the two.

    python examples/simulate_then_execute.py [--plan cpu-tiny] [--steps 6] [--out runs/example] [--json]

Everything goes through the public Python API (`twin.api`). On a CPU machine the CPU preset runs DP2 × TP2 × PP2
on 8 gloo ranks; the comparison uses the plan as it ran (the manifest's `ran` section: fp32 matmuls on CPU) and
this machine's calibrated profile, next to the catalogue's uncalibrated one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from twin import api


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = api.load_plan(args.plan)
    before = api.predict(plan)  # the plan as written, on its catalogue cluster
    print(f"predicted {plan.name}: {before.step_time_s:.3f} s per step, MFU {before.mfu:.1%} (as written)")

    run = api.execute(args.plan, steps=args.steps, out=args.out)
    if not run.ok:
        print(f"error: the run failed (exit {run.returncode}): {run.error}", file=sys.stderr)
        return 2
    measured = api.measure(run.run_dir)  # steady steps only; measured.plan is the plan as it ran

    as_ran = api.predict(measured.plan)
    calibrated = api.predict(measured.plan, cluster=api.load_cluster(args.profile))
    rows = {
        "measured_s": measured.step_s,
        "predicted_as_written_s": before.step_time_s,
        "predicted_as_ran_s": as_ran.step_time_s,
        "predicted_calibrated_s": calibrated.step_time_s,
        "error_calibrated": calibrated.step_time_s / measured.step_s - 1,
        "error_uncalibrated": as_ran.step_time_s / measured.step_s - 1,
        "run_dir": str(run.run_dir),
    }
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"measured  {measured.step_s:.3f} s per step (sd {measured.step_sd:.3f}) over {run.summary['steps']} steps")
    print(f"predicted {as_ran.step_time_s:.3f} s as it ran, catalogue profile: error {rows['error_uncalibrated']:+.1%}")
    print(f"predicted {calibrated.step_time_s:.3f} s as it ran, {args.profile}: error {rows['error_calibrated']:+.1%}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="cpu-tiny", help="plan preset or YAML path")
    p.add_argument("--steps", type=int, default=6, help="steps to run (the first two are warm-up)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/<plan>-<time>)")
    p.add_argument("--profile", default="calibrated/localhost-cpu", help="calibrated cluster profile to compare")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
