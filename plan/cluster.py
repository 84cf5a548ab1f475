"""The cluster: the hardware facts a plan runs on, loaded from `topologies/<name>.yaml`.

A cluster file never holds a parallel degree, and every section carries `source`: the datasheet, paper or
benchmark its numbers came from. Units live in field names (`bandwidth_GBps` is 1e9 bytes/s, one direction,
per GPU; `latency_us` microseconds; `hbm_GB` 1e9 bytes as datasheets print it). The twin converts to SI once,
where it reads these.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, field_validator, model_validator

from plan.accelerator import CLUSTER_SCHEMA_VERSION, Accelerator, ComputeEfficiency, Sourced
from plan.fitted import Calibration
from plan.section import UserSection

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
        if self.accelerator.sm_count is None and self.compute.gemm_fixed_us is not None:
            raise ValueError("compute.gemm_fixed_us: a GPU's table fit; a host without sm_count uses gemm_half_gflop")
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
