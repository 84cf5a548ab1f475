"""NVIDIA's NeMo 24.07 performance summary on DGX-H100 in fp8: a validation table from a release half a year before
the DGX Cloud recipes (NeMo 24.12) that `compute.in_training_fraction` was fitted on, with the same stack.

Source: NVIDIA/NeMo docs/source/performance/performance_summary.md at 070a0bb168d405d653b9734c0017cf5078e77c0d
("Container: NeMo24.07, System: DGX-H100", pre-training at FP8 precision), tokens per second per GPU. Another
revision of the same page, for the same container, prints different figures for the same rows (GPT3-175B on 128
GPUs 716, on 512 GPUs 825; LLAMA3-8B 12,273; LLAMA3-70B 1,524; Nemotron-340B 326): the published figures of one
release move by up to 5.5% between revisions, which bounds what any prediction of them can mean.

Only the rows whose model and recipe the twin already holds are taken (GPT3-175B twice, LLAMA3-8B, LLAMA3-70B,
Nemotron-340B); GPT3-5B and 20B, Llama 2 and Nemotron 8B and 22B need recipes this repository does not yet carry.
Each row runs the layout the table prints (GBS, MBS, TP, PP, CP, VP) with the settings of NeMo 24.12's recipe for
the same model (benchmarks/published.py dgxc_plan, benchmarks/published_nemotron.py nemotron_plan): the 24.07
recipes are not published beside the table, so the stack is nemo-24.12's and the gap is the two releases' kernels.
LLAMA3-8B and 70B and Nemotron-340B here run exactly the layouts of the 24.12 recipes' smallest rows, so the table
also measures what the newer release gained (`release_gains`).

Run as part of benchmarks/published_figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.published import DGXC_H100, DgxcRow, dgxc_plan
from benchmarks.published_nemotron import NEMOTRON_H100, NemotronRow, nemotron_plan
from plan.schema import Plan

SOURCE = "NVIDIA/NeMo docs/source/performance/performance_summary.md at 070a0bb (NeMo 24.07, DGX-H100, fp8)"


@dataclass(frozen=True)
class Nemo2407Row:
    """One pre-training row of the table: its layout and published tokens per second per GPU."""

    model: str
    gpus: int
    batch: int
    microbatch: int
    seq: int
    tp: int
    pp: int
    cp: int
    virtual: int
    tokens_per_gpu: float


NEMO_2407_H100 = (
    Nemo2407Row("gpt3-175b", 128, 256, 1, 2048, 4, 8, 1, 6, 726),
    Nemo2407Row("gpt3-175b", 512, 2048, 2, 2048, 4, 8, 1, 6, 782),
    Nemo2407Row("nemotron4-340b", 128, 32, 1, 4096, 8, 8, 1, 12, 322),
    Nemo2407Row("llama3-8b", 8, 128, 1, 8192, 1, 1, 2, 1, 12036),
    Nemo2407Row("llama3-70b", 64, 128, 1, 8192, 4, 4, 2, 5, 1533),
)


def nemo2407_plan(row: Nemo2407Row) -> Plan:
    """The row's layout under NeMo 24.12's recipe for the same model (the Nemotron-340B recipe fixes its own
    layout, which is this row's: TP8, PP8, VP12, CP1 in fp8, micro-batch 1, two sequences per node)."""
    if row.model == "nemotron4-340b":
        plan = nemotron_plan(NemotronRow(row.model, row.gpus, "fp8", 0.0))
        lay = plan.layout
        assert (lay.tp, lay.pp, lay.cp, lay.virtual_stages, plan.training.global_batch) == (
            row.tp,
            row.pp,
            row.cp,
            row.virtual,
            row.batch,
        ), "the 24.12 Nemotron-340B recipe no longer runs this row's layout"
        return plan
    recipe = DgxcRow(row.model, row.seq, row.gpus, row.tp, row.pp, row.cp, row.virtual, row.batch, "fp8", 0.0)
    return dgxc_plan(recipe, [f"layout.microbatch_size={row.microbatch}"])


def release_gains() -> list[tuple[str, float]]:
    """(row, NeMo 24.12's tokens per GPU over 24.07's, less one) for the rows both releases ran with one layout (the
    24.12 recipes all run micro-batch 1)."""
    out = []
    for row in NEMO_2407_H100:
        if row.model == "nemotron4-340b":
            newer = [r.step_s for r in NEMOTRON_H100 if (r.model, r.gpus, r.dtype) == (row.model, row.gpus, "fp8")]
        else:
            key = (row.model, row.gpus, row.tp, row.pp, row.cp, row.virtual, row.batch, row.microbatch)
            newer = [r.step_s for r in DGXC_H100 if r.dtype == "fp8" and _layout_key(r) == key]
        if newer:
            tokens = row.seq * row.batch / row.gpus
            out.append((f"{row.model}, {row.gpus} H100", tokens / newer[0] / row.tokens_per_gpu - 1))
    return out


def _layout_key(r: DgxcRow) -> tuple[str, int, int, int, int, int, int, int]:
    return (r.model, r.gpus, r.tp, r.pp, r.cp, r.virtual, r.batch, 1)
