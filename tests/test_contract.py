"""The executor's contract: the plan stays as written, the manifest's `ran` section says what ran, every field that
runs otherwise is one warning, and the twin prices the plan as it ran."""

from __future__ import annotations

import pytest

from executor.contract import PINNED_TORCH, torch_version_warning, what_runs
from plan import loader
from plan.device import fp8_refusal
from plan.records import RunManifest, plan_as_ran
from twin.step.predict import predict


def test_cpu_run_of_a_bf16_plan_runs_fp32_and_says_so() -> None:
    plan = loader.load("cpu-tiny")
    ran = what_runs(plan, "cpu")
    assert (ran.dtype, ran.fused_projections, ran.grad_reduce_dtype) == ("fp32", False, "fp32")
    assert ran.schedule == "Schedule1F1B" and ran.optimizer == "torch.optim.AdamW(foreach=False)"
    fields = [line.split(":")[0] for line in ran.mismatches]
    assert fields == ["training.dtype", "training.grad_reduce_dtype"]


@pytest.mark.parametrize(("device", "asked"), [("cuda", None), ("cpu", True)], ids=["gpu", "cpu-mixed"])
def test_mixed_precision_runs_bf16_and_reduces_in_the_plans_dtype(device: str, asked: bool | None) -> None:
    for reduce in ("bf16", "fp32"):
        plan = loader.load("cpu-tiny", [f"training.grad_reduce_dtype={reduce}"])
        ran = what_runs(plan, device, asked)
        assert (ran.dtype, ran.grad_reduce_dtype) == ("bf16", reduce)
        assert not [line for line in ran.mismatches if line.startswith("training.")], ran.mismatches
    fp32 = what_runs(loader.load("cpu-tiny", ["training.dtype=fp32"]), device, asked)
    assert (fp32.dtype, fp32.grad_reduce_dtype) == ("fp32", "fp32")  # a plan that says fp32 runs fp32


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["layout.fused_projections=true"], "layout.fused_projections"),
        (["layout.cp=2", "layout.dp=1", "layout.tp=1", "layout.pp=1"], "layout.cp_algorithm"),
        (["reliability.checkpoint=in-memory"], "reliability.checkpoint"),
        (
            ["reliability.checkpoint_interval_min=auto", "reliability.checkpoint_every_steps=0"],
            "reliability.checkpoint_interval_min",
        ),
    ],
)
def test_each_field_that_runs_otherwise_is_one_warning(overrides: list[str], field: str) -> None:
    ran = what_runs(loader.load("cpu-tiny", overrides), "cpu")
    assert [line for line in ran.mismatches if line.startswith(field + ":")], ran.mismatches
    assert all("\n" not in line for line in ran.mismatches)


def test_what_the_plan_asks_and_runs_is_not_warned() -> None:
    plan = loader.load(
        "cpu-tiny",
        [
            "training.dtype=fp32",
            "training.grad_reduce_dtype=fp32",
            "layout.cp_algorithm=all-gather",
            "reliability.checkpoint_every_steps=5",
        ],
    )
    assert what_runs(plan, "cpu").mismatches == ()
    assert (
        what_runs(
            plan.model_copy(update={"training": plan.training.model_copy(update={"dtype": "bf16"})}), "cuda"
        ).optimizer
        == "torch.optim.AdamW(foreach=False)"
    )  # DTensor parameters under tp: fmt: skip


def test_the_twin_prices_the_plan_as_it_ran() -> None:
    plan = loader.load("cpu-tiny", ["layout.fused_projections=true"])
    ran = what_runs(plan, "cpu")
    manifest = RunManifest(
        run_id="r", created_unix=0.0, plan=plan, ran=ran, plan_sha256="x", torch_version="2.13.0",
        python_version="3.11", device="cpu", backend="gloo", world_size=8, hosts=("h",) * 8,
    )  # fmt: skip
    priced = plan_as_ran(manifest)
    assert manifest.plan.layout.fused_projections and not priced.layout.fused_projections
    assert priced.training.dtype == "fp32" and priced.training.reduce_dtype == "fp32"
    as_written, as_ran = predict(plan), predict(priced)
    assert as_ran.step_time_s > as_written.step_time_s  # fp32 GEMMs and five TP all-reduces per layer backward
    assert as_ran.breakdown_s["tp_comm"] > as_written.breakdown_s["tp_comm"]


def test_a_manifest_from_before_the_contract_is_priced_as_it_stands() -> None:
    plan = loader.load("cpu-tiny")
    old = RunManifest(
        run_id="r", created_unix=0.0, plan=plan, plan_sha256="x", torch_version="2.13.0", python_version="3.11",
        device="cpu", backend="gloo", world_size=8, hosts=("h",) * 8,
    )  # fmt: skip
    assert plan_as_ran(old) == plan


def test_another_torch_release_is_one_warning_naming_what_may_break() -> None:
    assert torch_version_warning(f"{PINNED_TORCH}+cpu") is None and torch_version_warning(PINNED_TORCH) is None
    line = torch_version_warning("2.14.0")
    assert line is not None and "\n" not in line
    assert line.startswith(f"torch 2.14.0: the executor is tested on {PINNED_TORCH}")
    assert "_functional_collectives" in line and "_batch_p2p" in line


@pytest.mark.parametrize(
    ("device", "capability", "refused"),
    [("cpu", None, True), ("cuda", (8, 0), True), ("cuda", (8, 9), False), ("cuda", (9, 0), False)],
)
def test_an_fp8_plan_without_fp8_tensor_cores_is_refused_at_start(
    device: str, capability: tuple[int, int] | None, refused: bool
) -> None:
    fp8 = loader.load("cpu-tiny", ["training.dtype=fp8"])
    why = fp8_refusal(fp8, device, capability)
    assert (why is not None) == refused
    if why:
        assert why.startswith("training.dtype: fp8 needs fp8 tensor cores") and why.endswith("set training.dtype: bf16")
    assert fp8_refusal(loader.load("cpu-tiny"), "cpu", None) is None  # bf16 runs (as fp32) on a CPU
