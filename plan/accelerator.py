"""An accelerator and its kernels: the chip's datasheet figures and the kernel-level efficiencies the step model
prices with (`topologies/accelerators/NAME.yaml`, or written out in a cluster file). Every section carries `source`.
Units live in field names (`hbm_GB` 1e9 bytes as datasheets print it, `device_memory_GiB` 2^30 bytes as CUDA
reports it, `*_us` microseconds, `*_GBps` 1e9 bytes/s).
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, field_validator, model_validator

from plan.section import UserSection

CLUSTER_SCHEMA_VERSION: Final = 1

PEAK_DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")


class Sourced(UserSection):
    """A section whose numbers all come from the cited `source`."""

    source: str = Field(min_length=8)
    """Where these numbers come from: datasheet, paper (with table or section) or benchmark."""


class Accelerator(Sourced):
    """One accelerator chip."""

    name: str
    """Product name, e.g. 'H100 SXM5 80GB'."""
    kind: Literal["gpu", "tpu", "npu", "cpu"] = "gpu"
    """Kind of device (npu: another compiler-fed matrix engine, e.g. Trainium); a `cpu` device is a rank slot on
    host cores (executor runs on CPU machines)."""
    peak_tflops: dict[str, PositiveFloat]
    """Dense peak throughput per dtype (TFLOP/s), without structured sparsity."""
    sm_count: PositiveInt | None = None
    """Streaming multiprocessors (count): a GEMM runs in waves of one output tile per SM, which sets its
    quantization loss; unset for devices priced by a measured GEMM curve instead (CPU hosts)."""
    hbm_GB: PositiveFloat
    """Device memory (1e9 bytes), as the datasheet prints it."""
    device_memory_GiB: PositiveFloat | None = None
    """Memory one process can allocate, as CUDA reports it (GiB; PyTorch's "total capacity"): an "80 GB" H100 has
    79.1 GiB, not the 74.5 that 80e9 bytes are. The memory model fits into this; unset, hbm_GB as 1e9 bytes."""
    hbm_bandwidth_GBps: PositiveFloat
    """Device memory bandwidth (1e9 bytes/s)."""
    cache_bandwidth_GBps: PositiveFloat | None = None
    """Bandwidth of an element-wise op whose tensors stay in the on-chip caches, for hosts whose training-sized
    tensors do (CPU cores: a microbatch's activations fit in L2); a framework's element-wise kernels then run at
    `elementwise_bandwidth_fraction` of this instead of HBM's (1e9 bytes/s). Unset: HBM."""
    tdp_W: PositiveFloat
    """Board power at full load (watts)."""

    @property
    def memory_bytes(self) -> float:
        """Bytes one process can allocate into (`device_memory_GiB`, else `hbm_GB` read as 1e9 bytes)."""
        return self.device_memory_GiB * 2**30 if self.device_memory_GiB else self.hbm_GB * 1e9

    @field_validator("peak_tflops")
    @classmethod
    def _known_dtypes(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(PEAK_DTYPES))
        if unknown:
            raise ValueError(f"unknown dtype(s) {unknown}; use {', '.join(PEAK_DTYPES)}")
        if "bf16" not in v:
            raise ValueError("needs a bf16 entry (the default training dtype)")
        return v

    @model_validator(mode="after")
    def _memory(self) -> Accelerator:
        # a sanity bound, not a figure: CUDA reports about 6% more than the datasheet's GB read as bytes (H100 79.11
        # GiB = 84.9e9 of "80 GB", A100 79.25 GiB = 85.1e9, B200 178.35 GiB = 191.5e9 of "180 GB"), never 10% more
        if self.device_memory_GiB and self.device_memory_GiB * 2**30 > 1.1 * self.hbm_GB * 1e9:
            raise ValueError(
                f"device_memory_GiB: {self.device_memory_GiB} GiB is more than the datasheet's {self.hbm_GB} GB; "
                "give what CUDA reports (PyTorch's out-of-memory 'total capacity'), close to the datasheet's figure"
            )
        return self


class AttentionTable(UserSection):
    """A fused attention kernel's measured throughput by sequence length at one head width, causal, in the
    flash-attention benchmark's convention: forward 4·b·s²·heads·head_dim / 2 FLOPs, backward 2.5 times that."""

    head_dim: PositiveInt
    """Head width the table was measured at (elements)."""
    seq: tuple[PositiveInt, ...]
    """Sequence lengths measured (tokens), ascending."""
    forward_tflops: tuple[PositiveFloat, ...] | None = None
    """Forward TFLOP/s at each length."""
    backward_tflops: tuple[PositiveFloat, ...] | None = None
    """Backward TFLOP/s at each length."""
    fwd_bwd_tflops: tuple[PositiveFloat, ...] | None = None
    """Forward and backward together, where the source publishes only that (3.5x the forward's FLOPs)."""

    @model_validator(mode="after")
    def _check(self) -> AttentionTable:
        split = self.forward_tflops is not None and self.backward_tflops is not None
        if split == (self.fwd_bwd_tflops is not None):
            raise ValueError("give forward_tflops and backward_tflops, or fwd_bwd_tflops")
        for values in (self.forward_tflops, self.backward_tflops, self.fwd_bwd_tflops):
            if values is not None and len(values) != len(self.seq):
                raise ValueError(f"{len(values)} throughputs for {len(self.seq)} sequence lengths")
        if list(self.seq) != sorted(set(self.seq)):
            raise ValueError("seq: lengths must be distinct and ascending")
        return self


class DispatchKernel(Sourced):
    """Measured rates of an expert-parallel dispatcher whose own SM-driven kernels forward tokens over NVLink
    (DeepEP's normal kernels, Megatron-Core's HybridEP; `Stack.ep_dispatch` node-forwarding): across nodes a token
    goes once over the NICs to each remote node holding any of its experts, then the kernel's NVLink stage hands
    one copy to each rank holding any of them. That stage runs on the few SMs the kernel is given, well below the
    NVLink bandwidth NCCL reaches."""

    nvlink_GBps: PositiveFloat
    """Bytes a rank receives through the NVLink stage per second: one copy of a token per rank holding any of its
    experts, its own copies included (1e9 bytes/s)."""
    nic_fraction: float = Field(gt=0, le=1)
    """Share of a rank's NIC bandwidth (the fabric tier's, efficiency applied) the RDMA stage sustains."""
    sms: PositiveInt
    """SMs the measurement gave the kernels (count)."""
    intranode_GBps: PositiveFloat | None = None
    """The NVLink rate where the whole expert-parallel group sits in one node (1e9 bytes/s, same count as
    nvlink_GBps, at the same `sms`): the intranode kernels give every SM to NVLink copies, where the internode ones
    share them with the RDMA stage; unset: nvlink_GBps."""


class ComputeEfficiency(Sourced):
    """How close real kernels come to the accelerator's peak."""

    gemm_peak_fraction: dict[str, PositiveFloat]
    """Fraction of peak FLOP/s a full wave of a transformer-sized GEMM reaches, per dtype (0-1]; the best shape's
    with gemm_fixed_us."""
    fp8_block_gemm_fraction: float | None = Field(default=None, gt=0, le=1)
    """Fraction of the fp8 peak a block-scaled fp8 GEMM reaches (DeepSeek-V3's 1x128 and 128x128 scaling factors,
    applied on the CUDA cores: DeepGEMM); unset: the per-tensor fp8 fraction of gemm_peak_fraction."""
    gemm_fixed_us: PositiveFloat | None = None
    """Fixed cost of one GEMM (the first wave's ramp, the last's tail) from a fit to a measured table by shape
    (benchmarks/fit_gemm_table.py): set, a GEMM takes max(FLOPs at gemm_peak_fraction, bytes at gemm_bandwidth_GBps)
    plus this, no waves (cuBLAS picks its tile per shape); unset, one tile's waves plus kernel_overhead_us (us)."""
    gemm_bandwidth_GBps: PositiveFloat | None = None
    """Bandwidth of a GEMM's operands and product from the same fit (1e9 bytes/s); unset: HBM's, as memory-bound."""
    gemm_half_gflop: PositiveFloat | None = None
    """Without an SM count (CPU hosts): GEMM size at which it reaches half of that fraction (GFLOP), a measured
    saturating curve."""
    attention: dict[str, tuple[AttentionTable, ...]] = Field(default_factory=dict)
    """Fused attention kernels (fa2, fa3, cudnn, ...) and their measured throughput tables by head width."""
    in_training_fraction: float = Field(default=1.0, gt=0, le=1)
    """Weight-GEMM throughput inside a training step over what the isolated GEMM measurements above give (a table
    of cuBLAS GEMMs run alone): clocks under the power of a whole step, SMs and L2 shared with communication
    kernels, and what a framework's GEMMs add to a bare one (Transformer Engine's epilogues and fp32
    weight-gradient accumulation, GEMMs cut into chunks under tensor-parallel overlap). The attention tables are
    the fused kernels' own benchmarks and are not scaled by it (on H100 its fit's residual halves so). 1 where
    unmeasured; where set, fitted once per accelerator on one published table (the source says which) and checked
    on the others."""
    kernel_overhead_us: NonNegativeFloat
    """Fixed cost per kernel or framework op: launch and dispatch (microseconds)."""
    memory_bandwidth_fraction: PositiveFloat = Field(le=1)
    """Fraction of HBM bandwidth that tuned memory-bound kernels (fused multi-tensor optimizers, hand-written
    reductions) reach."""
    elementwise_bandwidth_fraction: float | None = Field(default=None, gt=0, le=1)
    """Fraction of HBM bandwidth a framework's element-wise and normalisation kernels reach (norms, activations,
    dropout, residual adds, softmax, losses); unset: memory_bandwidth_fraction."""
    layer_overhead_us: NonNegativeFloat = 0.0
    """Fixed host cost of running one layer for one microbatch, each way: the module call, hooks and autograd
    bookkeeping around its ops (microseconds); 0 where asynchronous launch hides it behind device work."""
    sharded_kernel_overhead_us: NonNegativeFloat = 0.0
    """Extra host cost per op on a tensor-parallel shard: DTensor's sharding propagation and dispatch
    (microseconds); 0 where asynchronous launch hides it behind device work."""
    optimizer_kernels_per_tensor: NonNegativeFloat = 0.0
    """Ops the optimizer step runs per parameter tensor: about 0 for a fused multi-tensor Adam, ~11 for PyTorch's
    single-tensor AdamW (count)."""
    ep_dispatch: DispatchKernel | None = None
    """A node-forwarding dispatcher's measured rates on this accelerator; unset, its NVLink stage moves at NCCL's
    NVLink bandwidth."""
    dp_overlap_fraction: float = Field(default=1.0, ge=0, le=1)
    """Share of the data-parallel gradient reduction that runs under the backward in buckets (1: Megatron/FSDP
    bucketed overlap; 0: one reduction after the backward)."""

    @field_validator("gemm_peak_fraction")
    @classmethod
    def _fractions(cls, v: dict[str, float]) -> dict[str, float]:
        for dtype, frac in v.items():
            if dtype not in PEAK_DTYPES or not 0 < frac <= 1:
                raise ValueError(f"{dtype}: {frac} must be a dtype of {PEAK_DTYPES} with a fraction in (0, 1]")
        return v

    @model_validator(mode="after")
    def _gemm_fit(self) -> ComputeEfficiency:
        if self.gemm_bandwidth_GBps is not None and self.gemm_fixed_us is None:
            raise ValueError(
                "gemm_bandwidth_GBps: only the model fitted to a table by shape reads it; set "
                "compute.gemm_fixed_us from the same fit (benchmarks/fit_gemm_table.py), or remove it"
            )
        return self


class AcceleratorFile(UserSection):
    """An accelerator of the catalogue (topologies/accelerators/NAME.yaml): the chip and its kernel-level
    efficiencies, which cluster files name instead of repeating them."""

    schema_version: Literal[1] = CLUSTER_SCHEMA_VERSION
    """Version of this file format."""
    accelerator: Accelerator
    compute: ComputeEfficiency
