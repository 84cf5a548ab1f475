"""The twin's DTensor op counts (twin/step/compute.py, twin/step/costs.py) are what the executor's TP layers dispatch.

Counted with a TorchDispatchMode around one step of cpu-tiny under TP 2 on two gloo ranks: each op whose arguments
hold a DTensor pays the sharded per-op cost the twin prices. A torch upgrade that changes DTensor's decomposition
fails here rather than silently skewing calibration.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from executor.model import build_stage_model, cross_entropy
from executor.parallel import apply_tensor_parallel
from plan import loader
from twin.cli.launch import free_port
from twin.step.compute import DTENSOR_OPS_BACKWARD, DTENSOR_OPS_FORWARD, LOSS_PARALLEL_DTENSOR_OPS
from twin.step.costs import ADAM_DTENSOR_OPS


class _CountDTensorOps(TorchDispatchMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts, self.phase = counts, ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat, _ = tree_flatten((args, kwargs or {}))
        if any(isinstance(a, DTensor) for a in flat):
            self.counts[self.phase] += 1
        return func(*args, **(kwargs or {}))


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = loader.load("cpu-tiny").model
    model = build_stage_model(spec, range(spec.layers), True, True, seed=0, device=torch.device("cpu"))
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), sequence_parallel=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)  # the executor's CPU optimizer
    x = torch.randint(0, spec.vocab, (2, spec.seq_len))
    counts: Counter[str] = Counter()
    for _ in range(2):  # the second step: AdamW's state exists
        counts.clear()
        with _CountDTensorOps(counts) as mode:
            mode.phase = "forward"
            logits = model(x)
            mode.phase = "loss forward"
            with loss_parallel():  # as the executor's Trainer computes the loss under tp
                loss = cross_entropy(logits, x)
                mode.phase = "backward"
                loss.backward()
            mode.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad()
    linears = spec.layers * (4 + (3 if spec.glu else 2)) + 1  # Q, K, V, O and the MLP per layer; the head
    sharded = linears + 1  # and the vocab-parallel embedding
    # the embedding's lookup forward and its gradient backward are one op each on top of the linears'
    assert counts["forward"] == linears * DTENSOR_OPS_FORWARD + 1
    assert counts["loss forward"] == LOSS_PARALLEL_DTENSOR_OPS[0]
    # the embedding weight's detach, and the loss's own backward
    assert counts["backward"] == linears * DTENSOR_OPS_BACKWARD + 1 + 1 + LOSS_PARALLEL_DTENSOR_OPS[1]
    assert counts["optimizer"] == sharded * ADAM_DTENSOR_OPS
    dist.destroy_process_group()


def test_twin_dtensor_op_counts_match_the_executors_tp_layers() -> None:
    port = free_port()
    mp.spawn(_worker, args=(port,), nprocs=2, join=True)
