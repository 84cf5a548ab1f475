"""Sharded equals single-process: every layout's first steps match one process training the same model on the
same data.

Each launch starts real ranks with torchrun (gloo on CPU, fp32) and runs several layout variants in one process
group (`executor.compare`), since starting processes is most of the cost on a 2-core machine. The reference is
the same plan with dp = tp = pp = cp = 1 and the same global batch. Tolerance: rtol 1e-5 and atol 1e-5 on the
job-wide mean loss and the global gradient norm before clipping — fp32 reductions in a different order differ
by ~1e-7 here; a wrong scale, a missed all-reduce or a misplaced layer is off by 1e-3 or more. The gradient norm
is compared too because AdamW's normalisation and clipping make the losses blind to a gradient's scale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from twin.cli.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
SINGLE = ["layout.dp=1", "layout.tp=1", "layout.pp=1", "layout.cp=1"]
STEPS = 3
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _pp(schedule: str, virtual: int = 1, *extra: str) -> list[str]:
    return [*SINGLE, "layout.pp=2", f"layout.schedule={schedule}", f"layout.virtual_stages={virtual}", *extra]


# Two ranks: each axis alone, every pipeline schedule, each ZeRO stage, recompute, sequence parallel.
TWO_RANKS = {
    "dp2": [*SINGLE, "layout.dp=2"],
    "tp2-sp-selective": [*SINGLE, "layout.tp=2", "layout.sequence_parallel=true", "layout.recompute=selective"],
    "cp2": [*SINGLE, "layout.cp=2"],
    "zero1": [*SINGLE, "layout.dp=2", "layout.zero=1"],
    "zero3-full-recompute": [*SINGLE, "layout.dp=2", "layout.zero=3", "layout.recompute=full"],
    "pp2-1f1b": _pp("1f1b"),
    "pp2-zbv": _pp("zbv", 2),
}
TWO_RANKS_SLOW = {
    "tp2": [*SINGLE, "layout.tp=2"],
    "zero2": [*SINGLE, "layout.dp=2", "layout.zero=2"],
    "pp2-gpipe": _pp("gpipe"),
    "pp2-zb-h1": _pp("zb-h1"),
    "pp2-interleaved-1f1b": _pp("interleaved-1f1b", 2),
    "pp2-dualpipe-v": _pp("dualpipe-v", 2),
}
# Four ranks: FSDP2 under every multi-stage schedule (the zero-bubble trap), FSDP2 x TP, TP x CP.
FOUR_RANKS_SLOW = {
    "dp2-pp2-zero3-zbv": [*_pp("zbv", 2), "layout.dp=2", "layout.zero=3"],
    "dp2-pp2-zero3-dualpipe-v": [*_pp("dualpipe-v", 2), "layout.dp=2", "layout.zero=3"],
    "dp2-pp2-zero3-zb-h1": [*_pp("zb-h1"), "layout.dp=2", "layout.zero=3"],
    "dp2-pp2-zero1-interleaved": [*_pp("interleaved-1f1b", 2), "layout.dp=2", "layout.zero=1"],
    "dp2-tp2-zero3-sp": [*SINGLE, "layout.dp=2", "layout.tp=2", "layout.zero=3", "layout.sequence_parallel=true"],
    "tp2-cp2": [*SINGLE, "layout.tp=2", "layout.cp=2"],
}
# Eight ranks, every axis at once.
EIGHT_RANKS_SLOW = {
    "dp2-tp2-pp2-zero3-sp-interleaved": [
        *_pp("interleaved-1f1b", 2),
        "layout.dp=2",
        "layout.tp=2",
        "layout.zero=3",
        "layout.sequence_parallel=true",
    ],
    "dp2-pp2-cp2-zero1-1f1b": [*_pp("1f1b"), "layout.dp=2", "layout.cp=2", "layout.zero=1"],
}


def run_variants(
    variants: dict[str, list[str]], nproc: int, tmp: Path, plan: str = "cpu-tiny", *flags: str
) -> dict[str, dict[str, list[float]]]:
    """Run `variants` of `plan` on `nproc` gloo ranks; each variant's per-step loss and gradient norm."""
    spec, out = tmp / "variants.json", tmp / "losses.json"
    spec.write_text(json.dumps(variants))
    launcher = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    launcher += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd = [sys.executable, *launcher, "-m", "executor.compare", "--plan", plan, "--variants", str(spec)]
    cmd += ["--steps", str(STEPS), "--out", str(out), "--timeout-s", "60", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, dict[str, list[float]]] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    return run_variants({"single": SINGLE}, 1, tmp_path_factory.mktemp("ref"))["single"]


def assert_matches(got: dict[str, list[float]], reference: dict[str, list[float]]) -> None:
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor(got[key]), torch.tensor(reference[key]), **TOLERANCE, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[float]]]:
    return run_variants(TWO_RANKS, 2, tmp_path_factory.mktemp("two"))


@pytest.mark.parametrize("variant", list(TWO_RANKS))
def test_two_rank_layout_matches_single_process(variant: str, two_rank_results: dict, reference: dict) -> None:
    assert_matches(two_rank_results[variant], reference)


def test_reference_loss_starts_near_uniform_and_falls(reference: dict[str, list[float]]) -> None:
    # A byte model at init predicts ~uniformly: ln 256 = 5.545. Three steps of warm-up must already lower it.
    assert abs(reference["loss"][0] - 5.545) < 0.05
    assert reference["loss"][-1] < reference["loss"][0] - 0.1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "variants"), [(2, TWO_RANKS_SLOW), (4, FOUR_RANKS_SLOW), (8, EIGHT_RANKS_SLOW)], ids=["2", "4", "8"]
)
def test_more_layouts_match_single_process(nproc: int, variants: dict, reference: dict, tmp_path: Path) -> None:
    results = run_variants(variants, nproc, tmp_path)
    failures = []
    for name in variants:
        try:
            assert_matches(results[name], reference)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)


# Mixed precision as GPUs run it (bf16 compute; FSDP2's policy gathers bf16 weights and reduces in the plan's
# dtype; ZeRO 0 autocasts and all-reduces in it), forced on CPU and compared with the fp32 single process.
MIXED = {
    "dp2-reduce-bf16": [*SINGLE, "layout.dp=2", "training.grad_reduce_dtype=bf16"],
    "dp2-zero3-reduce-fp32": [*SINGLE, "layout.dp=2", "layout.zero=3", "training.grad_reduce_dtype=fp32"],
    "tp2-zero-reduce-bf16": [*SINGLE, "layout.tp=2", "training.grad_reduce_dtype=bf16"],
}
# bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 0.2 %) on every matmul input. Measured over three steps:
# loss within 4e-5 and gradient norm within 8e-4 of fp32 (relative); the bounds leave about six times that.
MIXED_TOLERANCE = {"loss": 3e-4, "grad_norm": 5e-3}


@pytest.mark.slow  # one 2-rank launch, about 15 s
def test_mixed_precision_stays_near_fp32_and_is_not_fp32(reference: dict[str, list[float]], tmp_path: Path) -> None:
    results = run_variants(MIXED, 2, tmp_path, "cpu-tiny", "--mixed-precision")
    for name, got in results.items():
        for metric, rtol in MIXED_TOLERANCE.items():
            np.testing.assert_allclose(got[metric], reference[metric], rtol=rtol, err_msg=f"{name} {metric}")
        assert got["grad_norm"] != reference["grad_norm"], f"{name}: bit-identical to fp32, the policy did nothing"


@pytest.mark.slow  # the README's 8-rank execute example: about 20 s on 2 cores
def test_readme_example_twin_execute_cpu_tiny(reference: dict[str, list[float]], tmp_path: Path) -> None:
    """`twin execute cpu-tiny` runs DP2 x TP2 x PP2 on 8 gloo ranks, writes records the plan package reads, and
    its losses match the single-process reference (so the (2,2,2) layout is checked too)."""
    from typer.testing import CliRunner

    from plan.records import StepRecord, iter_records, read_manifest
    from twin.cli.app import app

    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["execute", "cpu-tiny", "--steps", str(STEPS), "--out", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["ok"] and summary["steps"] == STEPS and summary["tokens_per_s"] > 0
    records = list(iter_records(run_dir / "records.jsonl"))
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert sorted({r.rank for r in steps}) == list(range(8)) and len(steps) == 8 * STEPS
    rank0 = sorted((r for r in steps if r.rank == 0), key=lambda r: r.step)
    assert all(r.tokens_per_s and r.mfu and r.step_spread_s is not None for r in rank0)
    assert all(r.phases.forward > 0 and r.phases.backward > 0 for r in steps)
    got = {"loss": [r.loss for r in rank0], "grad_norm": [r.grad_norm for r in rank0]}
    assert_matches(got, reference)  # type: ignore[arg-type]
    manifest = read_manifest(run_dir)
    assert manifest.world_size == 8 and manifest.backend == "gloo" and manifest.data is not None
    assert manifest.plan.layout.dp == manifest.plan.layout.tp == manifest.plan.layout.pp == 2
    # the plan as written (bf16), and what ran beside it (fp32 on CPU), warned about at start
    assert manifest.plan.training.dtype == "bf16" and manifest.ran is not None and manifest.ran.dtype == "fp32"
    assert manifest.ran.schedule == "Schedule1F1B" and "training.dtype: bf16 runs as fp32" in manifest.ran.mismatches[0]


# Mixture of experts (cpu-tiny-moe: 8 experts, top-2, a shared expert, the first layer dense): expert parallelism
# alone and with each other axis (FSDP2 shards the experts over their own replicas), every pipeline schedule
# family, and tokens dropped over capacity — each against one process training the same MoE model on the same
# batch (with the same capacity where tokens drop).
MOE_SINGLE = [*SINGLE, "layout.ep=1"]
DROPPING = "model.capacity_factor=1.0"  # an even share per expert and sequence: a fifth of choices or so drop
MOE_TWO_RANKS = {
    "ep2": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2"],
    "ep2-dropping": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2", DROPPING],
    "cp2": [*MOE_SINGLE, "layout.cp=2"],
    "cp2-dropping": [*MOE_SINGLE, "layout.cp=2", DROPPING],  # the capacity counted along the whole sequence
    "tp2-sp-dropping": [*MOE_SINGLE, "layout.tp=2", "layout.sequence_parallel=true", DROPPING],  # shards routed
    "ep2-zero1": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2", "layout.zero=1"],
}
MOE_FOUR_RANKS_SLOW = {
    "ep2-dp4": [*MOE_SINGLE, "layout.dp=4", "layout.ep=2"],
    "ep4-dp4": [*MOE_SINGLE, "layout.dp=4", "layout.ep=4"],
    "ep2-pp2": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2", "layout.pp=2"],
    "ep2-tp2": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2", "layout.tp=2"],
    "ep2-pp2-zbv": [
        *MOE_SINGLE,
        "layout.dp=2",
        "layout.ep=2",
        "layout.pp=2",
        "layout.schedule=zbv",
        "layout.virtual_stages=2",
    ],
    "ep2-pp2-dualpipe-v": [
        *MOE_SINGLE,
        "layout.dp=2",
        "layout.ep=2",
        "layout.pp=2",
        "layout.schedule=dualpipe-v",
        "layout.virtual_stages=2",
    ],
    "ep2-pp2-dropping": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2", "layout.pp=2", DROPPING],
    "ep2-cp2": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2", "layout.cp=2"],
    "ep2-cp2-dropping": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2", "layout.cp=2", DROPPING],
    "ep2-tp2-sp": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2", "layout.tp=2", "layout.sequence_parallel=true"],
    "ep2-tp2-zero1": [*MOE_SINGLE, "layout.dp=2", "layout.ep=2", "layout.tp=2", "layout.zero=1"],
    "dp2-tp2-sp-zero1": [*MOE_SINGLE, "layout.dp=2", "layout.tp=2", "layout.sequence_parallel=true", "layout.zero=1"],
    "cp2-tp2-sp-dropping": [*MOE_SINGLE, "layout.cp=2", "layout.tp=2", "layout.sequence_parallel=true", DROPPING],
    "ep2-dp4-zero3": [*MOE_SINGLE, "layout.dp=4", "layout.ep=2", "layout.zero=3"],
}


@pytest.fixture(scope="session")
def moe_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[float]]]:
    variants = {"dropless": MOE_SINGLE, "dropping": [*MOE_SINGLE, DROPPING]}
    return run_variants(variants, 1, tmp_path_factory.mktemp("moe-ref"), "cpu-tiny-moe")


def _moe_matches(results: dict[str, dict[str, list[float]]], reference: dict[str, dict[str, list[float]]]) -> None:
    failures = []
    for name, got in results.items():
        try:
            assert_matches(got, reference["dropping" if "dropping" in name else "dropless"])
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow  # two launches, about 20 s on 2 cores; the MoE layer's own tests run by default
def test_expert_parallel_matches_single_process(moe_reference: dict, tmp_path: Path) -> None:
    # dropping tokens changes the computation: the two references differ, and each sharded run matches its own
    assert abs(moe_reference["dropping"]["loss"][-1] - moe_reference["dropless"]["loss"][-1]) > 1e-4
    _moe_matches(run_variants(MOE_TWO_RANKS, 2, tmp_path, "cpu-tiny-moe"), moe_reference)


@pytest.mark.slow
def test_expert_parallel_with_every_axis_matches_single_process(moe_reference: dict, tmp_path: Path) -> None:
    _moe_matches(run_variants(MOE_FOUR_RANKS_SLOW, 4, tmp_path, "cpu-tiny-moe"), moe_reference)
