"""What one rank's device does in a given time: GEMMs by shape, fused attention by sequence length, memory-bound
kernels by bytes — each from a kernel-level measurement the cluster's accelerator file cites.

- GEMM (GPU with a table by shape, `compute.gemm_fixed_us`): max(FLOPs at the best shape's rate, bytes at the GEMM
  bandwidth) plus a fixed cost per GEMM, the three fitted to a measured table (`fitted_gemm_s`; H100: XLA's).
- GEMM (GPU without one): waves of one 128x256 output tile per SM (NVIDIA, "Matrix Multiplication Background
  User's Guide", §3.2 wave quantization; ml-engineering, "Tile and wave quantization"), each full wave at the
  accelerator's measured fraction of peak for transformer-sized GEMMs, and never faster than moving its operands
  through HBM (the roofline). A partial last wave idles the SMs it leaves empty.
- GEMM (CPU host, no SM count): the measured saturating curve t = (f + f_half) / (fraction · peak).
- Fused attention: the accelerator's published throughput table for the stack's kernel (FlashAttention-2/3,
  cuDNN) at the head width and sequence length, interpolated; without a table, its FLOPs at the GEMM rate.
- Memory-bound kernels: bytes over the accelerator's measured achievable bandwidth — a framework's element-wise
  kernels at what such kernels measure, tuned ones (the fused optimizer) at what the best reach.

Every kernel also pays the accelerator's per-kernel overhead; a stack that issues kernels from the host in eager
mode cannot run an action faster than it can issue its kernels (`dispatch_s`, applied per action by the caller).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from plan.accelerator import AttentionTable
from plan.cluster import Cluster
from plan.errors import PlanError

TILE = (128, 256)
"""Output tile of one SM's GEMM work: cuBLAS's large Hopper/Ampere tiles (the Matrix Multiplication guide, §2.3)."""

DTENSOR_OPS_FORWARD = 4
"""Ops a tensor-parallel linear dispatches on DTensors in its forward, each paying the sharded per-op cost: aten.t,
view, mm and _unsafe_view (a 3-D input is flattened around the matmul). Counted with a TorchDispatchMode around
the executor's TP layers (apply_tensor_parallel, torch 2.13): 116 such ops for cpu-tiny's 29 TP linears;
tests/test_dtensor_op_counts.py counts them again on every run."""

DTENSOR_OPS_BACKWARD = 9
"""The same linear's DTensor ops in backward, its input- and weight-gradient GEMMs together: 4 t, 2 view, 2 mm and
a detach (263 for the 29 linears, the embedding's one included), split evenly between the two GEMMs."""

LOSS_PARALLEL_DTENSOR_OPS = (4, 5)
"""DTensor ops of the loss on vocab-sharded logits under tp (the executor's `loss_parallel()`), forward and
backward: the flatten, the cast and the sharded cross-entropy's pieces. Counted as the linears' are, above."""

ACT_BYTES = 2
"""Activations and element-wise work stay in 16 bits under fp8 training (fp8 applies to GEMM inputs; Micikevicius
et al. 2022, "FP8 Formats for Deep Learning"; DeepSeek-V3 report §3.3)."""


def act_bytes(dtype: str) -> int:
    """Bytes per activation element: 4 when the plan trains in fp32 (the executor on a CPU), else 2."""
    return 4 if dtype == "fp32" else ACT_BYTES


OPERAND_BYTES = {"fp8": 1, "fp32": 4}
"""Bytes per GEMM operand element by matmul dtype (2 otherwise)."""


@dataclass(frozen=True)
class Device:
    """One rank's compute in SI units."""

    peak_flops: float
    """Dense peak for the plan's matmul dtype (FLOP/s)."""
    gemm_fraction: float
    """Fraction of that peak a full wave of a transformer-sized GEMM reaches (the best shape's, with gemm_fixed_s)."""
    kernel_s: float
    """Fixed cost of one kernel (s)."""
    memory_Bps: float
    """Achieved memory bandwidth of tuned memory-bound kernels (the optimizer) (bytes/s)."""
    elementwise_Bps: float = 0.0
    """Achieved memory bandwidth of a framework's element-wise kernels (bytes/s); 0: memory_Bps."""
    sm_count: int | None = None
    """SMs for the wave model; None: the saturating curve with `half_flops`."""
    half_flops: float = 0.0
    """GEMM size reaching half of `gemm_fraction` on the saturating curve (FLOP)."""
    operand_bytes: int = 2
    """Bytes per GEMM operand element (the matmul dtype)."""
    attention: tuple[AttentionTable, ...] = ()
    """The stack's fused attention kernel on this accelerator, by head width; empty: priced as GEMM FLOPs."""
    sharded_s: float = 0.0
    """Extra host cost of one op on a tensor-parallel DTensor (s); 0 without tensor parallelism."""
    layer_s: float = 0.0
    """Fixed host cost of one layer for one microbatch, each way (s)."""
    in_training: float = 1.0
    """Weight-GEMM throughput in a training step over the isolated GEMM figures (the fused-attention tables are not
    scaled by it: ComputeEfficiency.in_training_fraction)."""
    peak16_flops: float = 0.0
    """Dense 16-bit peak (FLOP/s), for the GEMMs an fp8 stack keeps in bf16; 0: peak_flops."""
    gemm16_fraction: float = 0.0
    """The 16-bit GEMM fraction beside it; 0: gemm_fraction."""
    gemm_fixed_s: float = 0.0
    """Fixed cost of one GEMM from a fit to a measured table by shape (ComputeEfficiency.gemm_fixed_us); 0: the wave
    model and kernel_s."""
    gemm_Bps: float = 0.0
    """Bandwidth of a GEMM's operands and product from the same fit (bytes/s); 0: memory_Bps."""
    gemm_streams: int = 0
    """A batch of GEMMs as one cuBLAS call per product, issued round-robin on this many streams (Stack.
    grouped_gemm_streams): the products share the SMs, and each wave of concurrent calls pays one GEMM's fixed
    cost; 0: the batch is one kernel."""

    @classmethod
    def of(
        cls,
        cluster: Cluster,
        dtype: str,
        ranks_per_node: int,
        *,
        share_cores: bool = True,
        sharded: bool = False,
        attention_kernel: str = "none",
        fp8_scaling: str = "tensor",
    ) -> Device:
        """The device a rank sees. A `cpu` accelerator's figures are per core: with `share_cores` the node's cores
        are split evenly among its ranks; without, the rank runs alone (the pipeline simulation then shares the
        cores among the ranks busy at each moment, twin/step/host.py). `sharded` ops (tensor-parallel DTensors) pay
        the extra per-op dispatch cost. `attention_kernel` is the stack's fused attention kernel; where the
        accelerator has no table for it, the first it has is used. `fp8_scaling` "block" prices fp8 GEMMs at the
        block-scaled fraction where the cluster has one."""
        acc, eff = cluster.accelerator, cluster.compute
        key = dtype if dtype in acc.peak_tflops else "bf16"
        cpu_share = acc.kind == "cpu" and share_cores
        share = min(1.0, cluster.node.cpu_cores / max(1, ranks_per_node)) if cpu_share else 1.0
        memory = acc.hbm_bandwidth_GBps * 1e9 * eff.memory_bandwidth_fraction
        elementwise = (
            (acc.cache_bandwidth_GBps or acc.hbm_bandwidth_GBps)
            * 1e9
            * (eff.elementwise_bandwidth_fraction or eff.memory_bandwidth_fraction)
        )
        if cpu_share:
            memory /= max(1, ranks_per_node)
            elementwise /= max(1, ranks_per_node)
        priced_as = attention_priced_as(cluster, attention_kernel)
        tables = eff.attention[priced_as] if priced_as else ()
        return cls(
            peak16_flops=acc.peak_tflops.get("bf16", acc.peak_tflops[key]) * 1e12 * share,
            gemm16_fraction=eff.gemm_peak_fraction["bf16"],
            peak_flops=acc.peak_tflops[key] * 1e12 * share,
            gemm_fraction=(
                eff.fp8_block_gemm_fraction
                if key == "fp8" and fp8_scaling == "block" and eff.fp8_block_gemm_fraction
                else eff.gemm_peak_fraction.get(key, eff.gemm_peak_fraction["bf16"])
            ),
            kernel_s=eff.kernel_overhead_us * 1e-6 / share,
            memory_Bps=memory,
            elementwise_Bps=elementwise,
            sm_count=acc.sm_count,
            half_flops=(eff.gemm_half_gflop or 0.0) * 1e9,
            operand_bytes=OPERAND_BYTES.get(dtype, 2),
            attention=tables,
            sharded_s=eff.sharded_kernel_overhead_us * 1e-6 / share if sharded else 0.0,
            layer_s=eff.layer_overhead_us * 1e-6 / share,
            in_training=eff.in_training_fraction,
            gemm_fixed_s=(eff.gemm_fixed_us or 0.0) * 1e-6,
            gemm_Bps=(eff.gemm_bandwidth_GBps or 0.0) * 1e9,
        )

    def sixteen_bit(self) -> Device:
        """The same rank running its GEMMs in bf16: what an fp8 plan's stack keeps out of fp8 (the output head, the
        MoE router; Megatron-Core core_v0.10.0 runs them outside Transformer Engine's fp8_autocast, DeepSeek-V3
        §3.3.1 keeps them in BF16)."""
        if self.operand_bytes != 1:
            return self
        return replace(
            self,
            peak_flops=self.peak16_flops or self.peak_flops,
            gemm_fraction=self.gemm16_fraction or self.gemm_fraction,
            operand_bytes=2,
        )

    def without_sms(self, withheld: int) -> Device:
        """The same rank with `withheld` SMs kept from its GEMMs (Transformer Engine's `set_sm_margin`): GEMMs run on
        the rest, at their share of the peak (the wave model on that many SMs)."""
        if not withheld or self.sm_count is None:
            return self
        if withheld >= self.sm_count:
            raise PlanError(
                f"stack.tp_overlap_sm_margin withholds {withheld} of the accelerator's {self.sm_count} SMs from a "
                "GEMM; give it fewer (Transformer Engine recipes withhold 8-24)"
            )
        share = (self.sm_count - withheld) / self.sm_count
        return replace(
            self,
            sm_count=self.sm_count - withheld,
            peak_flops=self.peak_flops * share,
            peak16_flops=self.peak16_flops * share,
        )

    # --- GEMMs --------------------------------------------------------------------------------------------------

    def gemm_s(self, m: float, n: float, k: float, batch: float = 1) -> float:
        """One (batched) GEMM of an m x k by k x n product: on a GPU the fit to a measured table (`fitted_gemm_s`)
        where the accelerator has one, else the wave model and roofline plus the per-kernel cost; the saturating
        curve on a CPU host."""
        if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
            return 0.0
        flops = 2.0 * m * n * k * batch
        if self.sm_count is None:
            return self.flops_s(flops)
        # fp8 operands, but the product is written in 16 bits (Transformer Engine 1.x's fp8 GEMMs output bf16)
        written = max(self.operand_bytes, ACT_BYTES)
        nbytes = ((m * k + k * n) * self.operand_bytes + m * n * written) * batch
        rate = self.gemm_fraction * self.in_training * self.peak_flops
        calls = math.ceil(batch / self.gemm_streams) if self.gemm_streams else 1  # waves of concurrent calls
        if self.gemm_fixed_s:  # fitted to a measured table by shape: no one tile's waves
            return fitted_gemm_s(flops, nbytes, rate, self.gemm_Bps or self.memory_Bps, self.gemm_fixed_s * calls)
        return max(flops / (rate * self.wave_efficiency(m, n, batch)), nbytes / self.memory_Bps) + self.kernel_s * calls

    def grouped(self, streams: int) -> Device:
        """The same rank issuing a batch of GEMMs as one call per product on `streams` streams (0: one kernel)."""
        return replace(self, gemm_streams=streams) if streams != self.gemm_streams else self

    def gemm_launches(self, batch: float) -> int:
        """Kernels a (batched) GEMM launches: one per product where each is its own call, else one."""
        return max(1, math.ceil(batch)) if self.gemm_streams and self.sm_count is not None else 1

    def wave_efficiency(self, m: float, n: float, batch: float = 1) -> float:
        """Share of the SMs busy over a GEMM's waves of output tiles, the better of the tile's two orientations."""
        assert self.sm_count is not None
        best = 0.0
        for rows, cols in (TILE, TILE[::-1]):
            tiles = math.ceil(m / rows) * math.ceil(n / cols) * math.ceil(batch)
            best = max(best, tiles / (math.ceil(tiles / self.sm_count) * self.sm_count))
        return best

    def flops_s(self, flops: float) -> float:
        """A GEMM known only by its FLOPs, on the saturating curve (CPU hosts, and attention without a table)."""
        if flops <= 0:
            return 0.0
        return (flops + self.half_flops) / (self.gemm_fraction * self.peak_flops) + self.kernel_s

    def linear_s(self, m: float, n: float, k: float, dtensor_ops: float) -> float:
        """A weight GEMM and, on a tensor-parallel layer, the DTensor ops around it."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        return self.gemm_s(m, n, k) + dtensor_ops * self.sharded_s

    # --- attention and memory-bound kernels ---------------------------------------------------------------------

    def attention_s(self, forward_flops: float, seq: int, head_dim: int) -> tuple[float, float]:
        """(forward, backward) seconds of a fused causal attention doing `forward_flops` (causal count) at key
        length `seq`: the kernel's measured throughput, interpolated in log length and head width and held at the
        table's ends, not scaled by the in-training fraction (ComputeEfficiency.in_training_fraction, a GEMM figure);
        without a table, the FLOPs at the GEMM rate (backward 2.5x the forward's FLOPs)."""
        if forward_flops <= 0:
            return 0.0, 0.0
        if not self.attention:
            return self.flops_s(forward_flops), self.flops_s(2.5 * forward_flops)
        fwd_rate, bwd_rate = _interpolate_tables(self.attention, seq, head_dim)
        return forward_flops / fwd_rate + self.kernel_s, 2.5 * forward_flops / bwd_rate + self.kernel_s

    def memory_s(self, nbytes: float, kernels: float) -> float:
        """Tuned memory-bound kernels (the optimizer) moving `nbytes` in all."""
        return nbytes / self.memory_Bps + kernels * self.kernel_s

    def elementwise_s(self, nbytes: float, kernels: float) -> float:
        """A framework's element-wise and normalisation kernels moving `nbytes` in all."""
        return nbytes / (self.elementwise_Bps or self.memory_Bps) + kernels * self.kernel_s


def attention_priced_as(cluster: Cluster, attention_kernel: str) -> str | None:
    """The accelerator's attention table a stack's fused kernel is priced with: its own, else the first the
    accelerator holds (a stand-in: `attention_substitute` says so); None where it holds none (the GEMM rate)."""
    tables = cluster.compute.attention
    if attention_kernel in tables:
        return attention_kernel
    return next(iter(tables), None)


def attention_substitute(cluster: Cluster, attention_kernel: str, flash: bool) -> str | None:
    """What a prediction should say when the stack's fused attention kernel has no figure on the accelerator and
    another kernel's stands in (or, with no table at all, the GEMM rate); None where its own figure prices it or
    the stack runs no fused kernel."""
    if not flash or attention_kernel == "none":
        return None
    used = attention_priced_as(cluster, attention_kernel)
    if used == attention_kernel:
        return None
    instead = f"{used}'s figure" if used else "the GEMM rate"
    return (
        f"the stack's attention kernel {attention_kernel!r} has no figure for {cluster.accelerator.name}; it is priced"
        f" at {instead} (add a `{attention_kernel}` table under compute.attention in the accelerator's file)"
    )


def fitted_gemm_s(flops: Any, nbytes: Any, rate: float, bandwidth_Bps: float, fixed_s: float) -> Any:
    """A GEMM's time under the model fitted to a measured table by shape (floats or numpy arrays): its FLOPs at the
    best shape's `rate` or its operands and product at the GEMM bandwidth, whichever is longer, plus a fixed cost
    per GEMM (the first wave's ramp, the last's tail). benchmarks/fit_gemm_table.py and `twin bench`'s GPU fit use
    the same function, so what is fitted is what is priced."""
    compute, memory = flops / rate, nbytes / bandwidth_Bps
    if isinstance(compute, float) and isinstance(memory, float):  # one GEMM: Python's max, not numpy's per call
        return max(compute, memory) + fixed_s
    return np.maximum(compute, memory) + fixed_s


def _interpolate_tables(tables: tuple[AttentionTable, ...], seq: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOP/s at (seq, head_dim), linear in head width between the tables around it."""
    ordered = sorted(tables, key=lambda t: t.head_dim)
    widths = [t.head_dim for t in ordered]
    i = bisect.bisect_left(widths, head_dim)
    if i == 0 or i == len(ordered):
        return _rates(ordered[min(i, len(ordered) - 1)], seq)
    lo, hi = ordered[i - 1], ordered[i]
    w = (head_dim - lo.head_dim) / (hi.head_dim - lo.head_dim)
    (f0, b0), (f1, b1) = _rates(lo, seq), _rates(hi, seq)
    return f0 + w * (f1 - f0), b0 + w * (b1 - b0)


def _rates(table: AttentionTable, seq: int) -> tuple[float, float]:
    if table.fwd_bwd_tflops is not None:
        rate = _along(table.seq, table.fwd_bwd_tflops, seq)
        return rate, rate
    assert table.forward_tflops is not None and table.backward_tflops is not None
    return _along(table.seq, table.forward_tflops, seq), _along(table.seq, table.backward_tflops, seq)


def _along(seqs: tuple[int, ...], tflops: tuple[float, ...], seq: int) -> float:
    """TFLOP/s at `seq` (FLOP/s), linear in log2 length between measured points, held at the ends."""
    x = math.log2(min(max(seq, seqs[0]), seqs[-1]))
    xs = [math.log2(s) for s in seqs]
    j = min(len(xs) - 1, max(1, bisect.bisect_left(xs, x)))
    x0, x1, y0, y1 = xs[j - 1], xs[j], tflops[j - 1], tflops[j]
    return (y0 + (y1 - y0) * (x - x0) / (x1 - x0)) * 1e12 if x1 > x0 else y0 * 1e12
