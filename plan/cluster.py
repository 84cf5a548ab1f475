"""The cluster: the hardware facts a plan runs on, loaded from `topologies/<name>.yaml`.

A cluster file never holds a parallel degree, and every section carries `source`: the datasheet, paper or
benchmark its numbers came from. Units live in field names (`bandwidth_GBps` is 1e9 bytes/s, one direction,
per GPU; `latency_us` microseconds; `hbm_GB` 1e9 bytes as datasheets print it). The twin converts to SI once,
where it reads these.
"""

from __future__ import annotations

import math
from typing import Final, Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, field_validator, model_validator

from plan.fitted import Calibration
from plan.section import UserSection

CLUSTER_SCHEMA_VERSION: Final = 1

# Failure components, after the root-cause categories of Llama 3's 54-day table (Dubey et al. 2024, Table 5),
# grouped into the classes the twin simulates. `planned` is planned maintenance.
FAILURE_COMPONENTS = (
    "gpu",  # faulty GPU, GPU system processor
    "hbm",  # GPU HBM3 memory
    "sram",  # GPU SRAM memory
    "nic",  # network interface
    "switch",  # network switch or cable
    "host",  # host maintenance, CPU, system memory, SSD, power supply, chassis, IO expansion board
    "software",  # software bug, dependency, NCCL watchdog timeout
    "sdc",  # silent data corruption
    "thermal",  # GPU thermal interface and sensor
    "planned",  # planned maintenance
)

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
    """Tensor-core throughput inside a training step over what the isolated kernel measurements above give (the
    GEMM fraction and the attention tables come from kernels run alone): clocks under the power of a whole step,
    SMs and L2 shared with communication kernels. 1 where unmeasured; where set, fitted once per accelerator on
    one published table (the source says which) and checked on the others."""
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


class Link(Sourced):
    """One tier of the fabric as one GPU sees it."""

    name: str
    """Tier name, e.g. 'nvlink', 'leaf', 'spine', 'dci'."""
    bandwidth_GBps: PositiveFloat
    """Bandwidth per GPU through this tier, one direction (1e9 bytes/s)."""
    latency_us: NonNegativeFloat
    """One-way latency of a small message crossing this tier, end to end (microseconds)."""
    efficiency: PositiveFloat = Field(le=1)
    """Fraction of `bandwidth_GBps` that large collectives reach as nccl-tests bus bandwidth (0-1]."""


class FabricTier(Link):
    """A switching tier above the node: a group of `span_nodes` nodes is non-blocking below it."""

    span_nodes: PositiveInt
    """Nodes inside one domain of this tier, e.g. the nodes under one rail-leaf group (count)."""
    oversubscription: float = Field(default=1.0, ge=1)
    """Downlink to uplink bandwidth ratio of this tier's switches (1 = non-blocking)."""


class NodeSpec(Sourced):
    """One server: its accelerators, intra-node fabric, host and power."""

    gpus: PositiveInt
    """Accelerators per node (count); for a `cpu` accelerator, the rank slots of the host."""
    cpu_cores: PositiveInt
    """Physical host CPU cores (count); ranks of a CPU cluster share these."""
    effective_cores: PositiveFloat | None = None
    """Cores' worth of throughput the host gives ranks that oversubscribe it, where that differs from cpu_cores
    (SMT, a hypervisor's vCPU scheduling); fitted by `twin calibrate`, unset means cpu_cores (count)."""
    wakeup_latency_us: NonNegativeFloat = 0.0
    """Wait of a rank process that a message wakes when every physical core is busy (it runs when the running
    process's time slice ends); matters only where ranks oversubscribe host cores (microseconds)."""
    host_memory_GB: PositiveFloat
    """Host DRAM (1e9 bytes)."""
    intra: Link
    """The intra-node fabric (NVLink/NVSwitch, ICI, or shared memory)."""
    nvls: bool = False
    """The intra-node switch reduces in the network (NVLink SHARP)."""
    nvls_efficiency: float | None = Field(default=None, gt=0, le=1)
    """Fraction of the intra-node link bandwidth an NVLS all-reduce reaches (each GPU moves S·(1+1/n) per way)."""
    d2h_bandwidth_GBps: PositiveFloat
    """Device-to-host copy bandwidth per GPU, for async checkpoint staging (1e9 bytes/s)."""
    power_kW: PositiveFloat
    """Whole-node power at training load (kW)."""

    @model_validator(mode="after")
    def _nvls(self) -> NodeSpec:
        if self.nvls and self.nvls_efficiency is None:
            raise ValueError("nvls_efficiency: required when nvls is true (measured NVLS all-reduce efficiency)")
        return self


class Torus(Sourced):
    """A direct-connect torus (TPU ICI): every chip links to its neighbours along each dimension. It describes one
    pod; a fleet of several pods joins them over `fabric.tiers`, the data-centre network (DCN)."""

    dims: tuple[PositiveInt, ...]
    """Torus extent of one pod along each dimension (chips)."""
    link_bandwidth_GBps: PositiveFloat
    """Bandwidth of one link, one direction (1e9 bytes/s)."""
    latency_us: NonNegativeFloat
    """Latency per hop (microseconds)."""
    wraparound: bool = True
    """Links close each dimension into a ring."""


class Fabric(Sourced):
    """The scale-out fabric: a switched fat-tree of tiers, a torus, or nothing (one node)."""

    kind: Literal["fat-tree", "torus", "single-node"]
    """Topology family."""
    rails: PositiveInt = 1
    """Scale-out NICs per node (count)."""
    rail_optimized: bool = False
    """NIC i of every node connects to leaf switch group i (GPU i's rail)."""
    tiers: tuple[FabricTier, ...] = ()
    """Switching tiers above the node, innermost first (span_nodes grows outward); on a torus, the data-centre
    network between pods (bandwidth per chip), whose innermost tier spans at least one pod."""
    torus: Torus | None = None
    """The torus, for kind 'torus'."""
    sharp: bool = False
    """Scale-out switches reduce in the network (InfiniBand SHARP)."""

    @model_validator(mode="after")
    def _check(self) -> Fabric:
        if self.kind == "fat-tree" and not self.tiers:
            raise ValueError("tiers: a fat-tree needs at least one tier")
        if self.kind == "torus" and self.torus is None:
            raise ValueError("torus: kind 'torus' needs the torus section (dims, link_bandwidth_GBps, ...)")
        spans = [t.span_nodes for t in self.tiers]
        if spans != sorted(spans):
            raise ValueError(f"tiers: span_nodes must grow outward, got {spans}")
        return self


class Storage(Sourced):
    """The parallel filesystem that checkpoints are written to and data is read from."""

    write_GBps: PositiveFloat
    """Aggregate checkpoint write bandwidth (1e9 bytes/s)."""
    read_GBps: PositiveFloat
    """Aggregate read bandwidth for training data and restores (1e9 bytes/s)."""
    per_node_write_GBps: PositiveFloat
    """Write bandwidth one node can drive (1e9 bytes/s); a job writes at min(aggregate, nodes · this)."""


class Failures(Sourced):
    """Failure rates by component and what a failure costs to repair."""

    rates_per_node_day: dict[str, NonNegativeFloat]
    """Interruptions per node per day, by component (see FAILURE_COMPONENTS)."""
    weibull_shape: PositiveFloat = 1.0
    """Shape of the time-between-failures distribution: 1 exponential, <1 infant mortality, >1 wear-out."""
    repair_hours: PositiveFloat
    """Time until a failed node is repaired and can rejoin as a spare (hours)."""
    rate_scale: NonNegativeFloat = 1.0
    """What-if multiplier on every rate above (1 = as the sources say; 0.5 = half the failures) (ratio)."""

    @field_validator("rates_per_node_day")
    @classmethod
    def _known_components(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(FAILURE_COMPONENTS))
        if unknown:
            raise ValueError(f"unknown component(s) {unknown}; use {', '.join(FAILURE_COMPONENTS)}")
        return v


class Stragglers(Sourced):
    """Per-rank step-time variation and slow nodes."""

    jitter_cv: NonNegativeFloat
    """Coefficient of variation of one rank's step time around the mean (lognormal sigma)."""
    slow_node_rate_per_node_day: NonNegativeFloat
    """Nodes per node-day that turn persistently slow (thermal throttling, bad link) (1/node/day)."""
    slow_node_slowdown: float = Field(ge=1)
    """Step-time multiplier of a persistently slow node (x)."""


class Economics(Sourced):
    """What running the cluster costs."""

    usd_per_gpu_hour: PositiveFloat
    """Price of one accelerator for one hour (US dollars)."""
    pue: float = Field(ge=1)
    """Power usage effectiveness of the data centre (facility power / IT power)."""


class AcceleratorFile(UserSection):
    """An accelerator of the catalogue (topologies/accelerators/NAME.yaml): the chip and its kernel-level
    efficiencies, which cluster files name instead of repeating them."""

    schema_version: Literal[1] = CLUSTER_SCHEMA_VERSION
    """Version of this file format."""
    accelerator: Accelerator
    compute: ComputeEfficiency


class Cluster(UserSection):
    """A whole cluster: `nodes` identical servers on one fabric."""

    schema_version: Literal[1] = CLUSTER_SCHEMA_VERSION
    """Version of this file format."""
    name: str
    """Short name; matches the file name in topologies/."""
    description: str
    """What this cluster is and where it stands."""
    nodes: PositiveInt
    """Servers in the cluster (count)."""
    accelerator: Accelerator
    compute: ComputeEfficiency
    node: NodeSpec
    fabric: Fabric
    storage: Storage
    failures: Failures
    stragglers: Stragglers
    economics: Economics
    stack: str | None = None
    """The software stack (plan/presets/stacks/) runs on this fleet use when a plan names none: what its
    accelerator's software runs (XLA on a TPU, the Neuron SDK on Trainium); unset: Megatron-Core."""
    calibration: Calibration | None = None
    """Present in profiles written by `twin calibrate`: how they were fitted."""

    @property
    def gpus(self) -> int:
        """Accelerators in the cluster (count)."""
        return self.nodes * self.node.gpus

    @model_validator(mode="after")
    def _check(self) -> Cluster:
        if self.fabric.kind == "single-node" and self.nodes != 1:
            raise ValueError(f"fabric.kind: single-node, but nodes={self.nodes}; describe the scale-out fabric")
        if self.fabric.tiers and self.fabric.tiers[-1].span_nodes < self.nodes:
            raise ValueError(
                f"fabric.tiers: the outermost tier spans {self.fabric.tiers[-1].span_nodes} nodes, "
                f"fewer than nodes={self.nodes}; add a tier that spans the whole cluster"
            )
        if self.accelerator.sm_count is None and self.compute.gemm_half_gflop is None:
            raise ValueError("compute.gemm_half_gflop: required when accelerator.sm_count is not given")
        if self.fabric.torus is not None:
            self._check_pods(self.fabric.torus)
        return self

    def _check_pods(self, torus: Torus) -> None:
        chips = math.prod(torus.dims)
        if self.gpus % chips or chips % self.node.gpus:
            raise ValueError(
                f"fabric.torus.dims: a pod of {chips} chips must be a multiple of node.gpus={self.node.gpus} and "
                f"divide nodes·node.gpus = {self.gpus}"
            )
        if self.gpus > chips and not self.fabric.tiers:
            raise ValueError(
                f"fabric.tiers: {self.gpus // chips} pods of {chips} chips need the data-centre network between "
                "them; add a tier that spans the whole cluster"
            )
        pod_nodes = chips // self.node.gpus
        if self.fabric.tiers and self.fabric.tiers[0].span_nodes % pod_nodes:
            raise ValueError(
                f"fabric.tiers: the innermost tier spans {self.fabric.tiers[0].span_nodes} nodes, not whole pods "
                f"of {pod_nodes}; give it a multiple of {pod_nodes}"
            )

    @property
    def pod_chips(self) -> int:
        """Accelerators in one torus pod (the whole cluster when there is no torus)."""
        torus = self.fabric.torus
        return self.gpus if torus is None else math.prod(torus.dims)
