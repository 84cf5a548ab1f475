"""The executor stack's memory-bound kernels (plan/presets/stacks/executor.yaml) are what the executor's layer runs.

Counted with a TorchDispatchMode around one layer's forward and backward of executor/model.py, on this CPU, for
three model widths: every op that is not a matmul, a view or the attention core, with the bytes of its tensor
arguments and results. The stack's list must move the same bytes (within 10%) and dispatch about as many ops
(within 15%); its fp32 multiple must be what fp32 activations really move. A change to the executor's layers (or
torch's decompositions) that moves these fails here instead of silently skewing predictions and calibration.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from executor.model import build_stage_model
from plan import loader
from plan.stacks import load_stack
from twin.step.kernels import Shape, kernel_bytes, tensor_sizes

WIDTHS = sorted((Path(__file__).resolve().parent.parent / "plans" / "cpu-widths").glob("w*-dp2.yaml"))
SKIPPED = ("mm.default", "addmm.default", "bmm.default", "scaled_dot_product")
VIEWS = ("view", "reshape", "unflatten", "flatten", "transpose", "t.default", "expand", "permute", "alias")
VIEWS += ("slice", "select", "unsqueeze", "squeeze", "detach", "_unsafe_view", "as_strided", "split", "unbind")


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = ""
        self.ops: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if any(s in name for s in SKIPPED) or any(v in name for v in VIEWS):
            return out
        flat, _ = tree_flatten((args, kwargs or {}, out))
        self.ops[self.phase] += 1
        self.bytes[self.phase] += sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        return out


def _measure(plan_path: Path, dtype: torch.dtype) -> _Count:
    spec = loader.load(str(plan_path)).model
    model = build_stage_model(spec, range(1), True, False, seed=0, device=torch.device("cpu")).to(dtype)
    block = model.layers["0"]
    count = _Count()
    for _ in range(2):  # the second pass: nothing left to initialise
        count = _Count()
        h = torch.randn(2, spec.seq_len, spec.hidden, dtype=dtype, requires_grad=True)
        with count:
            count.phase = "forward"
            y = block(h)
            grad = torch.ones_like(y)
            count.phase = "backward"
            y.backward(grad)
    return count


def _stack_totals(plan_path: Path) -> dict[str, float]:
    """Bytes and kernels of the stack's memory-bound layer kernels for the same microbatch (2 sequences)."""
    spec = loader.load(str(plan_path)).model
    stack = load_stack("executor")
    shape = Shape(tokens=2 * spec.seq_len, tp=1, sequence_parallel=False, microbatch=2, seq_kv=spec.seq_len)
    sizes = tensor_sizes(spec, shape, moe=False)
    bound = [k for k in stack.layer if not k.gemm and not k.attention]
    fwd = sum(kernel_bytes(k, sizes, shape, stack) for k in bound)
    return {
        "forward_bytes": fwd,
        "backward_bytes": sum(k.backward * kernel_bytes(k, sizes, shape, stack) for k in bound),
        "forward_ops": sum(k.kernels for k in bound),
        "backward_ops": sum(k.backward_kernels for k in bound),
    }


@pytest.mark.parametrize("plan_path", WIDTHS, ids=lambda p: p.stem)
def test_executor_stack_moves_what_the_executor_layer_moves(plan_path: Path) -> None:
    measured = _measure(plan_path, torch.bfloat16)
    stack = _stack_totals(plan_path)
    for phase in ("forward", "backward"):
        assert stack[f"{phase}_bytes"] == pytest.approx(measured.bytes[phase], rel=0.10), phase
        assert stack[f"{phase}_ops"] == pytest.approx(measured.ops[phase], rel=0.15), phase


def test_executor_fp32_multiple_is_what_fp32_activations_move() -> None:
    ratios = []
    for plan_path in WIDTHS:
        fp32, bf16 = _measure(plan_path, torch.float32), _measure(plan_path, torch.bfloat16)
        ratios.append(sum(fp32.bytes.values()) / sum(bf16.bytes.values()))
    assert load_stack("executor").fp32_traffic == pytest.approx(sum(ratios) / len(ratios), rel=0.05)
