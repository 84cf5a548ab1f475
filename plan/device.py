"""What a device can run of a plan, checked before any rank starts (the executor and `twin execute` both ask)."""

from __future__ import annotations

from plan.schema import Plan


def fp8_refusal(plan: Plan, device: str, capability: tuple[int, int] | None) -> str | None:
    """Why an fp8 plan cannot start on this device; None where it can, or the plan is not fp8. Refused at start,
    not mid-run. FP8 tensor-core GEMMs need compute capability 8.9 or later (Ada 8.9, Hopper 9.0, Blackwell 10.x):
    NVIDIA Transformer Engine's installation requirements, and torch's `_scaled_mm`, which checks for sm_89+."""
    if plan.training.dtype != "fp8":
        return None
    if device == "cuda" and capability is not None and capability >= (8, 9):
        return None
    where = f"a GPU of compute capability {capability[0]}.{capability[1]}" if capability else f"the {device} device"
    return (
        f"training.dtype: fp8 needs fp8 tensor cores (compute capability 8.9+: L40S, H100, B200) and {where} has "
        "none; set training.dtype: bf16"
    )
