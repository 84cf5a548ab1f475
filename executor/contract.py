"""What the executor runs of a plan, honestly: the `ran` section of the manifest, and a warning for each of the
plan's fields that runs otherwise here.

The plan stays as the user wrote it; the twin prices a run by the plan with `ran` applied
(`plan.records.plan_as_ran`), so predicted and measured compare the same computation. Each mismatch below is one
line, naming the field, what runs instead, and why.
"""

from __future__ import annotations

from plan.records import Ran
from plan.schema import Plan

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipe-v": "ScheduleDualPipeV",
}
"""The torch.distributed.pipelining class each plan schedule runs as (executor/pipeline.py builds them)."""


PINNED_TORCH = "2.13.0"
"""The torch release the executor is tested on (pyproject.toml pins it)."""

PRIVATE_APIS = (
    "torch.distributed._functional_collectives (comm timing, executor/commtime.py)",
    "torch.distributed.pipelining.schedules._batch_p2p and _PipelineSchedule (pipeline timing and building)",
    "DeviceMesh._flatten (the dp·cp replica mesh)",
    "torch.distributed.tensor's _StridedShard (FSDP2 over TP, in the gradient norm)",
)
"""Private torch APIs the executor relies on: what another release may break."""


def torch_version_warning(version: str) -> str | None:
    """One line naming what may break under a torch release other than the pinned one; None under the pinned one
    (a local build suffix such as +cpu does not count)."""
    if version.split("+")[0] == PINNED_TORCH:
        return None
    return (
        f"torch {version}: the executor is tested on {PINNED_TORCH} and relies on private APIs that may have changed: "
        + "; ".join(PRIVATE_APIS)
    )


def mixed_precision(plan: Plan, device: str, asked: bool | None = None) -> bool:
    """Whether the executor computes in bf16 and reduces gradients in the plan's dtype (executor/engine.py): on
    GPUs unless the plan says fp32; on CPU, where the sharded-against-reference tests compare in fp32, only when
    `asked` (`--mixed-precision`)."""
    wanted = device == "cuda" if asked is None else asked
    return wanted and plan.training.dtype != "fp32"


def optimizer_kernels(plan: Plan, device: str) -> dict[str, bool]:
    """How executor/engine.py's Adam steps: fused kernels on GPU when every parameter is a plain tensor; else the
    foreach (multi-tensor) path, unless the parameters come in two kinds that torch's foreach ops cannot take in
    one list — tp (its DTensors beside plain norm gains, or FSDP's 2-D and 1-D meshes) or experts sharded over a
    mesh of their own (ep with FSDP) — where it steps one tensor at a time."""
    lay = plan.layout
    if lay.tp > 1 or (plan.model.is_moe and lay.ep > 1 and lay.zero > 0):
        return {"foreach": False}
    fsdp = lay.zero > 0 and lay.dp * lay.cp > 1
    return {"fused": True} if device == "cuda" and not fsdp else {"foreach": True}


def optimizer_name(plan: Plan, device: str) -> str:
    kind = plan.training.optimizer
    if kind == "sgd":
        return "torch.optim.SGD(momentum=0.9)"
    name = "AdamW" if kind == "adamw" else "Adam"
    flag = ", ".join(f"{k}={v}" for k, v in optimizer_kernels(plan, device).items())
    return f"torch.optim.{name}({flag})"


def what_runs(plan: Plan, device: str, mixed: bool | None = None) -> Ran:
    """The executor's `ran` section for `plan` on `device` (`mixed`: `--mixed-precision`, unset for the device's
    default), with the mismatches it warns about."""
    lay, rel = plan.layout, plan.reliability
    interval = None if rel.checkpoint_interval_min == "auto" else float(rel.checkpoint_interval_min)
    writes = bool(rel.checkpoint_every_steps or interval)
    bf16 = mixed_precision(plan, device, mixed)
    ran = Ran(
        dtype="bf16" if bf16 else "fp32",
        fused_projections=False,
        grad_reduce_dtype=plan.training.reduce_dtype if bf16 else "fp32",
        cp_algorithm="all-gather",
        schedule=SCHEDULE_CLASSES[lay.schedule] if lay.pp > 1 else "none",
        optimizer=optimizer_name(plan, device),
        checkpoint=("sync" if rel.checkpoint == "sync" else "async") if writes else "none",
        checkpoint_every_steps=rel.checkpoint_every_steps,
        checkpoint_interval_min=interval,
    )
    return ran.model_copy(update={"mismatches": tuple(mismatches(plan, ran))})


def mismatches(plan: Plan, ran: Ran) -> list[str]:
    """One line per plan field that runs otherwise than the plan says."""
    lay, tr, rel = plan.layout, plan.training, plan.reliability
    out = []
    if tr.dtype != ran.dtype:
        why = "fp32 on CPU unless --mixed-precision" if ran.dtype == "fp32" else "the executor computes in bf16"
        out.append(f"training.dtype: {tr.dtype} runs as {ran.dtype} ({why})")
    if lay.fused_projections:
        out.append(
            "layout.fused_projections: true runs as separate Q, K, V (and gate, up) projections (the executor's "
            "layers), each with its own input-gradient all-reduce under tp"
        )
    if lay.dp * lay.cp > 1 and tr.reduce_dtype != ran.grad_reduce_dtype:
        out.append(
            f"training.grad_reduce_dtype: {tr.reduce_dtype} runs as {ran.grad_reduce_dtype} (without mixed precision "
            "parameters and their gradients stay fp32)"
        )
    if lay.cp > 1 and lay.cp_algorithm != ran.cp_algorithm:
        out.append(f"layout.cp_algorithm: {lay.cp_algorithm} runs as {ran.cp_algorithm} (the executor's CP attention)")
    if rel.checkpoint == "in-memory":
        out.append("reliability.checkpoint: in-memory runs as async writes to storage (no peer-memory copy)")
    if rel.checkpoint_interval_min == "auto" and not rel.checkpoint_every_steps:
        out.append(
            "reliability.checkpoint_interval_min: auto (Young/Daly in the twin) takes no checkpoint by time here; "
            "set checkpoint_every_steps or a number of minutes"
        )
    return out
