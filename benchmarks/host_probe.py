"""Measure this host's CPU figures that topologies/localhost-cpu.yaml cites.

Prints, and writes to benchmarks/results/host_probe.json: the best GEMM throughput per core in fp32 and bf16
(torch.matmul, 2048^3, one thread), memory-bound throughput (a large elementwise op), and the fixed cost of one
small framework op (dispatch overhead). Run: `python benchmarks/host_probe.py`.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def best_of(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gemm_curve() -> dict[str, float]:
    """Fraction of the best per-core fp32 GEMM rate reached by square GEMMs of growing size."""
    torch.set_num_threads(1)
    rates = {}
    for n in (32, 64, 128, 256, 512, 1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        reps = max(1, 2**27 // n**3)
        t = best_of(lambda a=a, b=b, reps=reps: [a @ b for _ in range(reps)]) / reps
        rates[n] = 2 * n**3 / t
    top = max(rates.values())
    return {f"gemm_fp32_fraction_n{n}_{2 * n**3 / 1e9:.4g}GFLOP": round(r / top, 3) for n, r in rates.items()}


def attention_table() -> dict[str, object]:
    """Causal scaled_dot_product_attention on one thread: forward and backward TFLOP/s by head width and sequence
    length (causal FLOP count: 2·b·h·s²·d forward, 2.5x that backward), at about 2,048 tokens and 256 wide."""
    torch.set_num_threads(1)
    seqs = (64, 128, 256, 512, 1024)
    tables = []
    for d in (16, 32, 64):
        heads, fwd, bwd = max(1, 256 // d), [], []
        for s in seqs:
            b = max(1, 2048 // s)
            q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
            flops = 2 * b * heads * s * s * d
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            grad = torch.ones_like(o)
            t_f = best_of(
                lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            )
            t_b = best_of(lambda o=o, g=grad: o.backward(g, retain_graph=True))
            fwd.append(round(flops / t_f / 1e12, 4))
            bwd.append(round(2.5 * flops / t_b / 1e12, 4))
        tables.append({"head_dim": d, "seq": list(seqs), "forward_tflops": fwd, "backward_tflops": bwd})
    return {"attention_sdpa": tables}


def elementwise_cached() -> dict[str, float]:
    """A binary element-wise op (two reads, one write) on one thread at sizes that stay in the caches, in GB/s."""
    torch.set_num_threads(1)
    out = {}
    for n in (2**16, 2**17, 2**18, 2**20):
        x, y = torch.randn(n), torch.randn(n)
        t = best_of(lambda x=x, y=y: torch.mul(x, y))
        out[f"elementwise_GBps_{n * 4 // 1024}KiB"] = round(3 * n * 4 / t / 1e9, 1)
    return out


def _gloo_worker(rank: int, world: int, port: int, queue: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = {}
    for nbytes in (4, 2**26):
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)
        dist.barrier()
        reps = 200 if nbytes == 4 else 5
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        result[nbytes] = (time.perf_counter() - t0) / reps
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def gloo_allreduce(world: int = 2, port: int = 29631) -> dict[str, float]:
    """Latency (4 B) and bus bandwidth (64 MiB) of a gloo all-reduce between `world` processes on loopback."""
    queue: mp.SimpleQueue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_gloo_worker, args=(world, port, queue), nprocs=world, start_method="spawn")
    times = queue.get()
    busbw = 2 * (world - 1) / world * 2**26 / times[2**26]  # nccl-tests' all-reduce bus bandwidth
    return {
        "gloo_allreduce_4B_us": round(times[4] * 1e6, 1),
        "gloo_allreduce_busbw_GBps": round(busbw / 1e9, 3),
    }


def disk_write() -> float:
    """Sequential write bandwidth of the working directory's disk, fsync included (GB/s)."""
    data = os.urandom(2**20) * 256
    with tempfile.NamedTemporaryFile(dir=Path(__file__).parent) as f:
        t0 = time.perf_counter()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        return round(len(data) / (time.perf_counter() - t0) / 1e9, 3)


def main() -> None:
    torch.set_num_threads(1)
    out: dict[str, object] = {"host": platform.node(), "cpu": platform.processor(), "cores": os.cpu_count()}
    n = 2048
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t = best_of(lambda a=a, b=b: a @ b)
        out[f"gemm_gflops_per_core_{str(dtype).split('.')[-1]}"] = round(2 * n**3 / t / 1e9, 1)
    x = torch.randn(64 * 2**20)  # 256 MiB: far past the caches
    t = best_of(lambda: torch.mul(x, 2.0))
    out["elementwise_GBps_per_core"] = round(2 * x.numel() * 4 / t / 1e9, 2)
    torch.set_num_threads(os.cpu_count() or 1)
    t = best_of(lambda: torch.mul(x, 2.0))
    out["elementwise_GBps_all_cores"] = round(2 * x.numel() * 4 / t / 1e9, 2)
    small = torch.randn(8)
    reps = 20000
    t = best_of(lambda: [torch.add(small, 1.0) for _ in range(reps)], repeats=3)
    out["op_overhead_us"] = round(t / reps * 1e6, 2)
    out.update(gemm_curve())
    out.update(elementwise_cached())
    out.update(attention_table())
    out.update(gloo_allreduce())
    out["disk_write_GBps"] = disk_write()
    for key, value in out.items():
        print(f"{key:32s} {value}")
    path = Path(__file__).parent / "results" / "host_probe.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
