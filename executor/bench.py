"""Microbenchmarks that feed calibration: `torchrun --nproc-per-node N -m executor.bench --out DIR`.

Rank 0 times a GEMM sweep and the fixed cost of a tiny eager op and of the same op on a DTensor, while the other
ranks wait at a barrier (a waiting gloo rank sleeps, so rank 0 has a core to itself, like a rank of a pipeline
stage whose neighbours idle). Then every group size 2, 4, ... up to the world times all-reduce, all-gather,
reduce-scatter and all-to-all over message sizes, and ranks 0 and 1 ping-pong point-to-point messages; each point
is the slowest rank's mean time, in nccl-tests' algbw/busbw convention (plan/bench.py). `twin bench` starts it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from plan.bench import BenchResult, CollectivePoint, GemmPoint, OpPoint, bus_factor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GEMM_SHAPES: dict[str, tuple[tuple[int, int, int], ...]] = {
    "cpu": tuple((n, n, n) for n in (32, 64, 128, 256, 512, 1024)),
    # a GPU's fit (fraction, GEMM bandwidth, fixed cost per GEMM: twin/step/compute.py fitted_gemm_s) needs short
    # products beside the cubes, as XLA's table by shape has them: 4096 x 4096 at k = 256 and 1,024
    "cuda": (
        (4096, 4096, 256),
        (4096, 4096, 1024),
        (1024, 1024, 1024),
        (2048, 2048, 2048),
        *((n, n, n) for n in (256, 4096, 8192, 16384)),
    ),
}
"""(m, n, k) of the GEMM sweep per device; --quick takes the first three on a CPU, the first four on a GPU (the GPU
model's three constants need four points)."""
MESSAGE_BYTES = {"cpu": tuple(4**i * 1024 for i in range(8)), "cuda": tuple(4**i * 4096 for i in range(12))}
QUICK_MESSAGE_BYTES = (1024, 64 * 1024, 1024 * 1024)
TARGET_S = 0.2  # time each point for about this long (at least 3 iterations)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="executor.bench", description="GEMM, op-overhead and collective sweeps.")
    p.add_argument("--out", type=Path, required=True, help="directory for bench.json")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="a few sizes only (tests, smoke runs)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout: a hang fails this fast")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, calls: int | None = None) -> float:
    """Seconds of one call after one warm-up: over `calls` calls, or as many as fit in TARGET_S (at least 3).
    Collectives pass `calls` (every rank of a group must make the same number of them) and get the mean, as
    nccl-tests reports it and as a step pays it, one collective after another: on a host whose cores its ranks
    fill, a gloo hand-off now and then waits a scheduler tick, and at 32 KB on this 2-core machine the mean
    all-reduce (2.1 ms) is 2.4x the median (0.86 ms). A GEMM, timed alone on rank 0, gets the median, which
    leaves out the other processes' interruptions."""
    fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (
        len(times) < calls if calls else time.perf_counter() - start < TARGET_S and len(times) < 1000
    ):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.mean(times) if calls else statistics.median(times)


def _calls(nbytes: int) -> int:
    """Iterations of a collective point: many for latency-bound sizes, a few for bandwidth-bound ones."""
    return 20 if nbytes <= 1 << 20 else 5


def gemm_sweep(device: torch.device, quick: bool) -> list[GemmPoint]:
    shapes = GEMM_SHAPES[device.type][: (3 if device.type == "cpu" else 4) if quick else None]
    points = []
    for name, dtype in DTYPES.items():
        for m, n, k in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            seconds = _timed(lambda a=a, b=b: a @ b, device)  # type: ignore[misc]
            points.append(GemmPoint(m=m, n=n, k=k, dtype=name, seconds=seconds))
    return points


def op_overhead(device: torch.device) -> list[OpPoint]:
    """One tiny eager add: the per-op dispatch cost (and on a GPU, the launch)."""
    x = torch.ones(1, device=device)
    return [OpPoint(kind="eager", seconds=_timed_loop(lambda: torch.add(x, x), device))]


def _timed_loop(fn: Callable[[], object], device: torch.device, calls: int = 2000) -> float:
    """Mean seconds of one call over a tight loop of `calls` (per-op costs are microseconds)."""
    for _ in range(50):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


def dtensor_overhead(device: torch.device) -> OpPoint:
    """The same add on a DTensor replicated over the whole world: rank 0 times it; no op communicates."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    x = DTensor.from_local(torch.ones(1, device=device), mesh, [Replicate()], run_check=False)
    seconds = _timed_loop(lambda: x + x, device, calls=500) if dist.get_rank() == 0 else 1.0
    return OpPoint(kind="dtensor", seconds=seconds)


def _collective(
    op: str, nbytes: int, ranks: int, group: dist.ProcessGroup, device: torch.device
) -> Callable[[], object]:
    """The call that runs `op` once at nccl-tests' `nbytes` over `group`."""
    elems = max(ranks, nbytes // 4 // ranks * ranks)
    full = torch.ones(elems, device=device)
    part = torch.ones(elems // ranks, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_single(full, part, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    out = torch.empty_like(full)
    return lambda: dist.all_to_all_single(out, full, group=group)


def collective_sweep(device: torch.device, quick: bool, skipped: list[str]) -> list[CollectivePoint]:
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [g for g in (2, 4, 8, 16, 32, 64) if g <= world]
    groups = {g: dist.new_group(list(range(g))) for g in sizes}  # every rank must create every group
    points = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for g in sizes:
            for nbytes in QUICK_MESSAGE_BYTES if quick else MESSAGE_BYTES[device.type]:
                dist.barrier()
                seconds = 0.0
                if rank < g:
                    try:
                        seconds = _timed(_collective(op, nbytes, g, groups[g], device), device, _calls(nbytes))
                    except RuntimeError as exc:  # gloo lacks some collectives in some builds
                        seconds = -1.0
                        if rank == 0:
                            skipped.append(f"{op}: {str(exc).splitlines()[0][:120]}")
                slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if float(slowest) <= 0:
                    break
                algbw = nbytes / float(slowest) / 1e9
                points.append(CollectivePoint(op=op, ranks=g, bytes=nbytes, seconds=float(slowest),
                                              algbw_GBps=algbw, busbw_GBps=algbw * bus_factor(op, g)))  # fmt: skip
    return points + _p2p_sweep(device, quick)


def _p2p_sweep(device: torch.device, quick: bool) -> list[CollectivePoint]:
    """Ranks 0 and 1 ping-pong; one transfer is half the round trip."""
    rank = dist.get_rank()
    points = []
    for nbytes in QUICK_MESSAGE_BYTES if quick else MESSAGE_BYTES[device.type]:
        buf = torch.ones(max(1, nbytes // 4), device=device)
        dist.barrier()
        if rank > 1:
            continue

        def ping_pong(buf: torch.Tensor = buf) -> None:
            peer = 1 - rank
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        seconds = _timed(ping_pong, device, _calls(nbytes)) / 2
        algbw = nbytes / seconds / 1e9
        points.append(CollectivePoint(op="p2p", ranks=2, bytes=nbytes, seconds=seconds, algbw_GBps=algbw,
                                      busbw_GBps=algbw))  # fmt: skip
    return points


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device_type = args.device
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device_type == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    skipped: list[str] = []
    gemm = gemm_sweep(device, args.quick) if rank == 0 else []
    ops = op_overhead(device) if rank == 0 else []
    dist.barrier()
    ops.append(dtensor_overhead(device))
    dist.barrier()
    if world > 1:
        collectives = collective_sweep(device, args.quick, skipped)
    else:
        collectives = []
        skipped.append("collectives: one rank; run with --ranks 2 or more")
    if rank == 0:
        result = BenchResult(
            device=device_type, backend=backend, world_size=world, host=socket.gethostname(),
            torch_version=torch.__version__, threads_per_rank=torch.get_num_threads(), gemm=tuple(gemm),
            ops=tuple(ops), collectives=tuple(collectives), skipped=tuple(skipped),
        )  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        tmp = args.out / "bench.json.tmp"
        tmp.write_text(result.model_dump_json(indent=1))
        tmp.replace(args.out / "bench.json")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 processes that built a DeviceMesh sometimes abort in interpreter teardown


if __name__ == "__main__":
    main()
