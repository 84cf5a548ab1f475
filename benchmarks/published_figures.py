"""The twin against published figures, row by row, each in its source's own convention, worst rows first.

Tables (benchmarks/published.py, published_nemotron.py, published_nemo2407.py, published_mbridge.py,
published_mbridge_moe.py, published_deepseek.py, published_llama4.py, published_mcore_moe.py, published_mpt.py,
published_automodel.py, published_deepseek_report.py, published_bloom.py): nccl-tests bus bandwidth on one node;
Narayanan et al. 2021 Table 1 (A100, TFLOP/s by the paper's formula); Megatron-Core r0.8.0's H100 table and its 0.9
Mixtral 8x7B headline (TFLOP/s by Megatron-Core's formula); the Megatron-LM A100 README table (MFU); Llama 3 405B Table
4 (MFU); NVIDIA's DGX Cloud recipes (step time, as throughput: Llama 3.1 and GPT-3, Grok-1, Nemotron-4, DeepSeek-V3,
Llama 4 Maverick); NeMo's H100 fp8 performance summary, 24.07 and its Llama 2 7B rows from 4k to 1M tokens, and
Megatron-Bridge's Llama 3 and Qwen3 MoE rows from 25.11 to 26.06 under fp8 current scaling (tokens/s per GPU); NeMo
AutoModel's PyTorch-native bf16 runs (FSDP2, DeepEP: Qwen3 30B-A3B, Llama 3.1 70B, DeepSeek-V3; tokens/s per GPU);
DeepSeek-V3's own pre-training time against a simulated whole run (tokens/s per GPU over the run); BLOOM-176B's logged
steps on Jean Zay's A100s (tokens/s per GPU); MosaicML's MPT on A100 and H100 (bf16 and fp8) under FSDP (tokens/s per
GPU). Each row says its kind: `validation` (the twin was not built from that figure), `consistency` (a catalogue number
was derived from the same published figure, so agreement only shows the arithmetic is consistent) or `fit` (the row is
in the table an accelerator's one fitted constant was fitted on). Prints a table per source with mean and worst absolute
error (and, beside a fit, the rows left out of it) and writes benchmarks/results/published_figures.json.

Run: `python benchmarks/published_figures.py`."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.published import (
    DGXC_GROK_H100,
    DGXC_H100,
    KORTHIKANTI_A100,
    LLAMA3_TABLE_4,
    MCORE_H100,
    NARAYANAN_TABLE_1,
    dgxc_plan,
    grok_plan,
    korthikanti_mfu,
    korthikanti_plan,
    llama_plan,
    mcore_plan,
    mcore_virtual_stages,
    megatron_tflops,
    narayanan_plan,
    narayanan_tflops,
    vp_label,
)
from benchmarks.published_automodel import AUTOMODEL_H100, automodel_plan
from benchmarks.published_automodel import SOURCE as AUTOMODEL_SOURCE
from benchmarks.published_bloom import BATCH as BLOOM_BATCH
from benchmarks.published_bloom import BLOOM_A100, bloom_plan
from benchmarks.published_bloom import SEQ as BLOOM_SEQ
from benchmarks.published_bloom import SOURCE as BLOOM_SOURCE
from benchmarks.published_deepep import DEEPEP_ROWS, deepep_gbps
from benchmarks.published_deepseek import DGXC_DEEPSEEK_H100, deepseek_plan
from benchmarks.published_deepseek import SEQ as DEEPSEEK_SEQ
from benchmarks.published_deepseek import SOURCE as DEEPSEEK_SOURCE
from benchmarks.published_deepseek_report import SOURCE as DEEPSEEK_REPORT_SOURCE
from benchmarks.published_deepseek_report import predicted_tokens_per_gpu_s, published_tokens_per_gpu_s
from benchmarks.published_llama4 import DGXC_LLAMA4_H100, llama4_plan
from benchmarks.published_llama4 import SEQ as LLAMA4_SEQ
from benchmarks.published_llama4 import SOURCE as LLAMA4_SOURCE
from benchmarks.published_mbridge import MBRIDGE_H100, SEQ, mbridge_plan
from benchmarks.published_mbridge import SOURCE as MBRIDGE_SOURCE
from benchmarks.published_mbridge_moe import (
    CONTROLLED_SOURCE,
    MBRIDGE_MOE_H100,
    QWEN3_30B_CONTROLLED,
    controlled_plan,
    mbridge_moe_plan,
)
from benchmarks.published_mbridge_moe import SEQ as MBRIDGE_MOE_SEQ
from benchmarks.published_mbridge_moe import SOURCE as MBRIDGE_MOE_SOURCE
from benchmarks.published_mcore_moe import MCORE_MOE_H100, mcore_moe_plan
from benchmarks.published_mcore_moe import SOURCE as MCORE_MOE_SOURCE
from benchmarks.published_mpt import (
    MPT_A100,
    MPT_A100_40GB,
    MPT_H100,
    MPT_H100_FP8,
    MPT_H100_LARGE,
    SOURCE_40GB,
    SOURCE_H100,
    SOURCE_H100_LARGE,
    MptRow,
    mpt_plan,
    mpt_tokens_per_gpu,
)
from benchmarks.published_mpt import SOURCE as MPT_SOURCE
from benchmarks.published_nemo2407 import LONG_SOURCE as NEMO_LONG_SOURCE
from benchmarks.published_nemo2407 import NEMO_2407_H100, NEMO_LONG_H100, NemoRow, nemo_plan, release_gains
from benchmarks.published_nemo2407 import SOURCE as NEMO_2407_SOURCE
from benchmarks.published_nemotron import NEMOTRON_H100, SOURCE, nemotron_plan
from plan.loader import load_cluster
from plan.loader import plan_cluster as load_plan_cluster
from plan.schema import Plan
from twin.cli.fidelity_cmd import groups_table
from twin.fidelity import FILE as FIDELITY_FILE
from twin.fidelity import Fidelity, plan_class, summarise
from twin.step.collectives import InNetwork, collective_time
from twin.step.fabric import Fabric
from twin.step.predict import predict

NCCL = [  # (cluster, algorithm, published busbw GB/s, source, kind)
    # the H100 rows are consistency checks: its NVLink efficiencies were back-solved from NVIDIA's 370/480 GB/s
    ("dgx-h100-superpod", "ring", 367.6, "8xH200 16 GiB, NVLS off (stas00 ml-engineering)", "consistency"),
    ("dgx-h100-superpod", "nvls", 478.9, "Azure AI-benchmarking-guide, 8G", "consistency"),
    ("dgx-h100-superpod", "nvls", 479.7, "Voltage Park, 8 GiB", "consistency"),
    ("dgx-a100-superpod", "ring", 231.6, "Azure ND A100 v4, 8G", "validation"),
]

Row = dict[str, Any]

GAINS_FILE = Path(__file__).parent / "results" / "nemo_release_gains.json"
"""What NeMo 24.12 gained over 24.07 on the rows both ran with one layout, published and predicted."""

FIDELITY_SOURCE = (
    "written by benchmarks/published_figures.py (rerun it after any change to the step model): the validation rows "
    "of its published tables, by accelerator, precision and MoE; twin/fidelity.py reads it"
)


def nccl_rows() -> list[Row]:
    rows = []
    for name, algorithm, published, source, kind in NCCL:
        cluster = load_cluster(name)
        node = cluster.node
        net = InNetwork(nvls_link_Bps=node.intra.bandwidth_GBps * 1e9 * (node.nvls_efficiency or 0) or None)
        got = collective_time("all_reduce", 8 * 2**30, Fabric(cluster).span(list(range(8))), net, algorithm)
        rows.append(_row(f"{name} all-reduce {algorithm} busbw GB/s", published, got.busbw_Bps / 1e9, source, kind))
    return rows


def deepep_rows() -> list[Row]:
    """DeepEP's normal kernels: the node-forwarding dispatch's published bandwidths (benchmarks/published_deepep.py)."""
    return [
        _row(f"{r.cluster} DeepEP {r.op} EP{r.ep}: {r.metric} GB/s", r.gbps, deepep_gbps(r), r.source, r.kind)
        for r in DEEPEP_ROWS
    ]


def narayanan_rows() -> list[Row]:
    out = []
    for r in NARAYANAN_TABLE_1:
        plan = narayanan_plan(r)
        step = predict(plan).step_time_s
        what = f"GPT {r.params_b:g}B, {r.gpus:,} A100, TP{r.tp} PP{r.pp}: TFLOP/s per GPU"
        out.append(_row(what, r.tflops, narayanan_tflops(r, step), "Narayanan et al. 2021, Table 1", plan=plan))
    return out


def mcore_rows() -> list[Row]:
    out = []
    for r in MCORE_H100:
        plan = mcore_plan(r)
        step = predict(plan).step_time_s
        layout = f"TP{r.tp} PP{r.pp}" + vp_label(mcore_virtual_stages(r))
        what = f"GPT {r.name}, {r.tp * r.pp * r.dp:,} H100, {layout}: TFLOP/s per GPU"
        source = "Megatron-Core r0.8.0 README (f2e5db402c)"
        out.append(_row(what, r.tflops, megatron_tflops(plan, step), source, plan=plan))
    return out


def korthikanti_rows() -> list[Row]:
    out = []
    for r in KORTHIKANTI_A100:
        plan = korthikanti_plan(r)
        step = predict(plan).step_time_s
        what = f"GPT {r.name}, {r.tp * r.pp} A100, TP{r.tp} PP{r.pp}, DP1: MFU"
        source = "Megatron-LM A100 README (Korthikanti et al. 2022)"
        out.append(_row(what, r.mfu, korthikanti_mfu(r, step), source, plan=plan))
    return out


def llama_rows() -> list[Row]:
    out = []
    for r in LLAMA3_TABLE_4:
        plan = llama_plan(r)
        pred = predict(plan)
        what = f"Llama 3 405B, {r.gpus:,} H100, CP{r.cp} DP{r.dp}, seq {r.seq:,}: MFU"
        out.append(_row(what, r.mfu, pred.mfu, "Dubey et al. 2024, Table 4", plan=plan))
    return out


def _step_time_rows(
    rows: Iterable[Any],
    plan_of: Callable[[Any], Plan],
    what: Callable[[Any], str],
    tokens_per_gpu: Callable[[Any], float],
    source: str,
    kind: Callable[[Any], str] = lambda _: "validation",
    rounded: bool = True,
) -> list[Row]:
    """Rows whose published figure is a step time (each row's `step_s`), as throughput errors against the predicted
    step of the row's plan: `what` labels a row, `tokens_per_gpu` gives the tokens one GPU takes a step. `rounded`:
    the published throughput rounded as the recipes print it (`_tokens_per_gpu_row`); false where the source prints
    the seconds themselves (a training log), kept exact."""
    out = []
    for r in rows:
        plan = plan_of(r)
        step, tokens = predict(plan).step_time_s, tokens_per_gpu(r)
        if rounded:
            out.append(_tokens_per_gpu_row(what(r), tokens, r.step_s, step, source, kind(r), plan))
        else:
            out.append(_row(what(r), tokens / r.step_s, tokens / step, source, kind(r), plan))
    return out


def _seq_batch_per_gpu(r: Any) -> float:
    """Tokens a GPU takes a step where the row carries its sequence, global batch and GPUs."""
    return float(r.seq * r.batch / r.gpus)


def dgxc_rows() -> list[Row]:
    """Step times of NVIDIA's DGX Cloud recipes as throughput errors (published step / predicted step − 1). The
    bf16 rows are where the H100's in-training fraction was fitted (kind `fit`); the fp8 rows were left out."""
    return _step_time_rows(
        DGXC_H100,
        dgxc_plan,
        lambda r: (
            f"{r.model} {r.dtype}, {r.gpus:,} H100, TP{r.tp} PP{r.pp} CP{r.cp}{vp_label(r.virtual)}: tokens/s per GPU"
        ),
        _seq_batch_per_gpu,
        "NVIDIA/dgxc-benchmarking v25.02 (NeMo 24.12)",
        lambda r: "fit" if r.dtype == "bf16" else "validation",
    )


def grok_rows() -> list[Row]:
    """Grok-1 314B step times of the same recipes release as throughput errors, bf16 and fp8 (no fit uses them)."""
    out = []
    for r in DGXC_GROK_H100:
        for dtype, published in (("bf16", r.bf16_s), ("fp8", r.fp8_s)):
            plan = grok_plan(r, dtype)
            step = predict(plan).step_time_s
            layout = f"TP{r.tp} PP{r.pp} CP{r.cp} EP{r.ep}" + vp_label(r.virtual)
            what = f"grok-1 {r.layers}L {dtype}, {r.gpus:,} H100, {layout}: tokens/s per GPU"
            source = "NVIDIA/dgxc-benchmarking v25.02 (NeMo 24.12), grok1/README_314b.md"
            out.append(_tokens_per_gpu_row(what, r.seq * r.batch / r.gpus, published, step, source, plan=plan))
    return out


def nemotron_rows() -> list[Row]:
    """Nemotron-4 15B and 340B step times of the same recipes release at every published GPU count, bf16 and fp8
    (benchmarks/published_nemotron.py; no fit uses them)."""
    return _step_time_rows(
        NEMOTRON_H100,
        nemotron_plan,
        lambda r: (
            f"{r.model} {r.dtype}, {r.gpus:,} H100, TP{r.tp} PP{r.pp} CP{r.cp}{' VP12' if r.pp > 1 else ''}: "
            "tokens/s per GPU"
        ),
        lambda r: 4096 * r.batch / r.gpus,
        SOURCE,
    )


def nemo2407_rows() -> list[Row]:
    """NeMo 24.07's DGX-H100 fp8 pre-training rows, tokens per second per GPU (benchmarks/published_nemo2407.py; no
    fit uses them)."""
    return _nemo_rows(NEMO_2407_H100, "NeMo 24.07", NEMO_2407_SOURCE)


def nemo_long_rows() -> list[Row]:
    """NeMo 24.03.01's LLAMA2-7B from 4k to 1M tokens under context parallelism (benchmarks/published_nemo2407.py)."""
    return _nemo_rows(NEMO_LONG_H100, "NeMo 24.03.01", NEMO_LONG_SOURCE, long_sequence=True)


def _nemo_rows(rows: tuple[NemoRow, ...], release: str, source: str, long_sequence: bool = False) -> list[Row]:
    out = []
    for r in rows:
        plan = nemo_plan(r, long_sequence)
        step = predict(plan).step_time_s
        layout = f"TP{r.tp} PP{r.pp} CP{r.cp}" + vp_label(r.virtual) + f", micro-batch {r.microbatch}"
        what = f"{r.model} fp8 ({release}), seq {r.seq:,}, {r.gpus:,} H100, {layout}: tokens/s per GPU"
        stack = release.lower().replace(" ", "-")  # the run's release, not the kernel list it borrows
        out.append(_row(what, r.tokens_per_gpu, r.seq * r.batch / r.gpus / step, source, plan=plan, stack=stack))
    return out


def mbridge_rows() -> list[Row]:
    """Megatron-Bridge's DGX-H100 Llama 3 rows, NeMo 25.11 to 26.06, fp8 with current scaling, tokens per second
    per GPU (benchmarks/published_mbridge.py; no fit uses them)."""
    return _release_rows(MBRIDGE_H100, mbridge_plan, SEQ, MBRIDGE_SOURCE, lambda r: f"TP{r.tp} PP{r.pp} CP{r.cp}")


def _release_rows(
    rows: Sequence[Any], plan_of: Callable[[Any], Plan], seq: int, source: str, layout_of: Callable[[Any], str]
) -> list[Row]:
    """Rows of a performance summary by release (Megatron-Bridge's): tokens per second per GPU, fp8 as current
    scaling (fp8-cs) unless a row says bf16."""
    out = []
    for r in rows:
        plan = plan_of(r)
        step = predict(plan).step_time_s
        layout = layout_of(r) + vp_label(r.virtual) + f", batch {r.batch:,}"
        precision = "fp8-cs" if getattr(r, "dtype", "fp8") == "fp8" else r.dtype
        what = f"{r.model} {precision} (NeMo {r.release}), {r.gpus:,} H100, {layout}: tokens/s per GPU"
        out.append(_row(what, r.tokens_per_gpu, seq * r.batch / r.gpus / step, source, plan=plan))
    return out


def deepseek_rows() -> list[Row]:
    """DeepSeek-V3 671B in bf16 on DGX H100, expert parallelism folded over tp and dp (benchmarks/published_deepseek.py;
    no fit uses them)."""
    return _step_time_rows(
        DGXC_DEEPSEEK_H100,
        deepseek_plan,
        lambda r: f"deepseek-v3 bf16, {r.gpus:,} H100, TP{r.tp} PP{r.pp} EP{r.ep} (expert TP1): tokens/s per GPU",
        lambda r: DEEPSEEK_SEQ * r.batch / r.gpus,
        DEEPSEEK_SOURCE,
    )


def llama4_rows() -> list[Row]:
    """Llama 4 Maverick in bf16 and fp8 on 512 DGX H100, dense and MoE layers alternating, the experts folded over
    every rank (benchmarks/published_llama4.py; no fit uses them)."""
    return _step_time_rows(
        DGXC_LLAMA4_H100,
        llama4_plan,
        lambda r: (
            f"llama4-maverick {r.dtype}, {r.gpus:,} H100, TP{r.tp} PP1 EP{r.ep} (expert TP{r.expert_tp}): "
            "tokens/s per GPU"
        ),
        lambda r: LLAMA4_SEQ * r.batch / r.gpus,
        LLAMA4_SOURCE,
    )


def mcore_moe_rows() -> list[Row]:
    """Megatron-Core 0.9's Mixtral 8x7B headline on 64 H100 in bf16, TFLOP/s per GPU by its own count
    (benchmarks/published_mcore_moe.py; no fit uses it)."""
    out = []
    for r in MCORE_MOE_H100:
        plan = mcore_moe_plan(r)
        step = predict(plan).step_time_s
        what = f"{r.model} bf16, {r.gpus} H100, TP{r.tp} PP{r.pp} EP{r.ep}{vp_label(r.virtual)}: TFLOP/s per GPU"
        out.append(_row(what, r.tflops, megatron_tflops(plan, step), MCORE_MOE_SOURCE, plan=plan))
    return out


def bloom_rows() -> list[Row]:
    """BLOOM-176B's logged steps on 192 to 384 A100 80GB of Jean Zay under seven layouts, Megatron-DeepSpeed
    (benchmarks/published_bloom.py; no fit uses them). Each log prints seconds, not a rounded throughput: kept exact."""
    return _step_time_rows(
        BLOOM_A100,
        bloom_plan,
        lambda r: (
            f"BLOOM-176B bf16, {r.gpus} A100 (Jean Zay), TP{r.tp} PP{r.pp} DP{r.dp}, micro-batch {r.microbatch}: "
            "tokens/s per GPU"
        ),
        lambda r: BLOOM_SEQ * BLOOM_BATCH / r.gpus,
        BLOOM_SOURCE,
        rounded=False,
    )


def deepseek_report_rows() -> list[Row]:
    """DeepSeek-V3's own pre-training time (its report's 2,664K H800 GPU hours for 14.8T tokens) against the twin's
    whole-run simulation of the `deepseek-v3-2k` plan, failures included (benchmarks/published_deepseek_report.py;
    no fit uses it)."""
    what = "DeepSeek-V3 pre-training, 14.8T tokens on 2,048 H800, whole run: tokens/s per GPU"
    published = published_tokens_per_gpu_s()
    # no plan class: a whole-run figure (failures and checkpoints included) stays out of the step-accuracy groups
    # that a plan's "checked on" record reads (twin/published_fidelity.json)
    return [_row(what, published, predicted_tokens_per_gpu_s(), DEEPSEEK_REPORT_SOURCE)]


def automodel_rows() -> list[Row]:
    """NeMo AutoModel's DGX-H100 bf16 pre-training rows, FSDP2 with DeepEP and torch context parallelism, tokens/s
    per GPU (benchmarks/published_automodel.py; no fit uses them)."""

    def what(r: Any) -> str:
        split = f"PP{r.pp} EP{r.ep}{vp_label(r.virtual)}" if r.pp > 1 else (f"CP{r.cp}" if r.cp > 1 else f"EP{r.ep}")
        return f"{r.model} bf16 (AutoModel), {r.gpus:,} H100, FSDP {split}: tokens/s per GPU"

    return _step_time_rows(AUTOMODEL_H100, automodel_plan, what, _seq_batch_per_gpu, AUTOMODEL_SOURCE)


def mbridge_moe_rows() -> list[Row]:
    """Megatron-Bridge's DGX-H100 MoE rows, NeMo 25.11 to 26.06: Qwen3 in fp8 current scaling, gpt-oss-120b in bf16,
    tokens per second per GPU (benchmarks/published_mbridge_moe.py; no fit uses them)."""
    return _release_rows(
        MBRIDGE_MOE_H100, mbridge_moe_plan, MBRIDGE_MOE_SEQ, MBRIDGE_MOE_SOURCE, lambda r: f"TP{r.tp} PP{r.pp} EP{r.ep}"
    )


def controlled_rows() -> list[Row]:
    """Megatron-Bridge's controlled Qwen3 30B-A3B comparisons on 16 H100 in bf16: HybridEP and the alltoall
    dispatcher, each with the expert-parallel overlap off and on (benchmarks/published_mbridge_moe.py). The HybridEP
    run with the overlap on is `fit`: its profile's hidden share of the communication is the nemo-25.11 stack's
    `ep_overlap_hidden`."""
    out = []
    for r in QWEN3_30B_CONTROLLED:
        plan = controlled_plan(r)
        step = predict(plan).step_time_s
        what = f"qwen3-30b-a3b bf16, 16 H100, TP1 PP1 EP16, {r.what}: tokens/s per GPU"
        tokens = MBRIDGE_MOE_SEQ * plan.training.global_batch / plan.layout.world_size
        kind = "fit" if r.dispatch == "node-forwarding" and r.overlap else "validation"
        out.append(_tokens_per_gpu_row(what, tokens, r.step_s, step, CONTROLLED_SOURCE, kind, plan))
    return out


def mpt_rows(rows: tuple[MptRow, ...] = MPT_A100, source: str = MPT_SOURCE) -> list[Row]:
    """MosaicML's MPT tokens per second per GPU under FSDP (benchmarks/published_mpt.py; no fit uses them)."""
    out = []
    for r in rows:
        plan = mpt_plan(r)
        step = predict(plan).step_time_s
        ckpt = ", checkpointed" if r.checkpointing else ""
        part = PARTS[r.accelerator] + (" fp8" if r.dtype == "fp8" else "")
        what = f"MPT-{r.model} seq {r.seq:,}, {r.gpus} {part}, micro-batch {r.microbatch}{ckpt}: tokens/s per GPU"
        out.append(_row(what, r.tokens_per_gpu, mpt_tokens_per_gpu(r, step), source, plan=plan))
    return out


PARTS = {"a100-sxm4-80gb": "A100", "a100-sxm4-40gb": "A100 40GB", "h100-sxm5-80gb": "H100"}


def mpt_40gb_rows() -> list[Row]:
    return mpt_rows(MPT_A100_40GB, SOURCE_40GB)


def mpt_h100_rows() -> list[Row]:
    return mpt_rows(MPT_H100, SOURCE_H100)


def mpt_h100_fp8_rows() -> list[Row]:
    return mpt_rows(MPT_H100_FP8, SOURCE_H100)


def mpt_h100_large_rows() -> list[Row]:
    return mpt_rows(MPT_H100_LARGE, SOURCE_H100_LARGE)


def _tokens_per_gpu_row(
    what: str,
    tokens_per_gpu: float,
    published_s: float,
    predicted_s: float,
    source: str,
    kind: str = "validation",
    plan: Plan | None = None,
) -> Row:
    """A published step time as throughput (tokens per GPU per second, rounded as the recipes print it)."""
    return _row(what, round(tokens_per_gpu / published_s), tokens_per_gpu / predicted_s, source, kind, plan)


def _row(
    what: str,
    published: float,
    predicted: float,
    source: str,
    kind: str = "validation",
    plan: Plan | None = None,
    stack: str | None = None,
) -> Row:
    """One figure; every `error` is the twin's figure over the published, less one, of a figure where more is
    better (throughput, TFLOP/s, MFU, bus bandwidth), so a positive error is an optimistic twin. A training run's
    row carries its plan (`plan`, left out of the JSON; benchmarks/error_by_kernel.py predicts it again) and the
    plan's class (twin.fidelity.plan_class), which twin/published_fidelity.json groups its errors by; `stack` names
    the software the run ran where the plan borrows another release's kernel list."""
    row: Row = {
        "what": what,
        "published": published,
        "predicted": predicted,
        "error": (predicted - published) / published,
        "source": source,
        "kind": kind,
    }
    if plan is not None:
        row["class"] = plan_class(plan, load_plan_cluster(plan)) | ({"stack": stack} if stack else {})
        row["plan"] = plan
    return row


def serialisable(row: Row) -> Row:
    """The row as benchmarks/results/published_figures.json holds it: without its plan."""
    return {k: v for k, v in row.items() if k != "plan"}


TABLES: dict[str, Callable[[], list[Row]]] = {
    "nccl-tests": nccl_rows,
    "deepep-kernels": deepep_rows,
    "narayanan-a100": narayanan_rows,
    "mcore-h100": mcore_rows,
    "megatron-a100-readme": korthikanti_rows,
    "llama3-table4": llama_rows,
    "dgxc-h100": dgxc_rows,
    "dgxc-h100-moe": grok_rows,
    "dgxc-h100-nemotron": nemotron_rows,
    "dgxc-h100-deepseek": deepseek_rows,
    "dgxc-h100-llama4": llama4_rows,
    "mcore-moe-h100": mcore_moe_rows,
    "automodel-h100": automodel_rows,
    "deepseek-v3-report": deepseek_report_rows,
    "bloom-176b-a100": bloom_rows,
    "nemo-24.07-h100": nemo2407_rows,
    "nemo-long-seq-h100": nemo_long_rows,
    "mbridge-h100": mbridge_rows,
    "mbridge-h100-moe": mbridge_moe_rows,
    "mbridge-qwen3-30b-controlled": controlled_rows,
    "mpt-a100": mpt_rows,
    "mpt-a100-40gb": mpt_40gb_rows,
    "mpt-h100": mpt_h100_rows,
    "mpt-h100-fp8": mpt_h100_fp8_rows,
    "mpt-h100-large": mpt_h100_large_rows,
}


def summary(rows: list[Row]) -> dict[str, float]:
    """Mean and worst absolute error over every row, and over the rows of each kind present."""
    errors = [abs(r["error"]) for r in rows]
    out = {"rows": len(rows), "mean_abs_error": sum(errors) / len(errors), "worst_abs_error": max(errors)}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [abs(r["error"]) for r in rows if r["kind"] == kind]
        out[f"{kind}_rows"] = len(mine)
        out[f"{kind}_mean_abs_error"] = sum(mine) / len(mine)
        out[f"{kind}_worst_abs_error"] = max(mine)
    return out


def _number(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.4g}"


def main() -> None:
    console = Console(width=150)
    results: dict[str, Any] = {}
    for name, build in TABLES.items():
        t0 = time.perf_counter()
        rows = sorted(build(), key=lambda r: -abs(r["error"]))  # the bad rows first
        results[name] = {
            **summary(rows),
            "figures": [serialisable(r) for r in rows],
            "seconds": time.perf_counter() - t0,
        }
        s = results[name]
        count = "1 row" if s["rows"] == 1 else f"{s['rows']} rows"
        title = f"{name}: mean |error| {s['mean_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} ({count})"
        if "fit_rows" in s and "validation_rows" in s:
            left = s["validation_mean_abs_error"], s["validation_worst_abs_error"]
            title += f"; left out of the fit: mean {left[0]:.1%}, worst {left[1]:.1%}"
        table = Table(title=title)
        for col in ("figure", "kind", "published", "predicted", "error"):
            table.add_column(col, justify="left" if col in ("figure", "kind") else "right")
        for r in rows:
            table.add_row(r["what"], r["kind"], _number(r["published"]), _number(r["predicted"]), f"{r['error']:+.1%}")
        console.print(table)
    out = Path(__file__).parent / "results" / "published_figures.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    gains = release_gains()
    listed = ", ".join(f"{row} {p:+.1%} (twin {t:+.1%})" for row, p, t in gains)
    print(f"NeMo 24.12 over 24.07 on one layout, fp8 tokens/s per GPU: {listed}")
    records = [{"row": row, "published": p, "twin": t} for row, p, t in gains]
    GAINS_FILE.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {GAINS_FILE}")
    groups = fidelity_groups(results)
    console.print(groups_table(Fidelity.from_json(g) for g in groups))
    FIDELITY_FILE.write_text(json.dumps({"source": FIDELITY_SOURCE, "groups": groups}, indent=1) + "\n")
    print(f"wrote {FIDELITY_FILE}")


def fidelity_groups(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The validation rows of every table, grouped as a prediction looks its record up (twin/fidelity.py)."""
    return summarise({name: table["figures"] for name, table in results.items()})


if __name__ == "__main__":
    main()
