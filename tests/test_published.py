"""The twin against published runs, with the tolerances we state in the README (benchmarks/published_figures.py
prints the same rows worst first).

The bounds are issue 13's targets where the twin meets them — a table within 5% mean absolute error and no row
beyond 10%, Llama 3's 8k rows within about 2 MFU points — and, where it does not (Megatron-Core's H100 table, Llama
3's long-context row, the fp8 and MoE recipes), the regression bound its unexplained rows still need (see the
README's Fidelity section).
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import fit_gemm_table
from benchmarks.published_figures import TABLES, Row, summary
from benchmarks.published_mpt import (
    MPT_A100,
    MPT_A100_40GB,
    MPT_H100,
    MPT_H100_FP8,
    MPT_H100_LARGE,
    UNPADDING,
    mpt_plan,
)
from benchmarks.published_nemo2407 import release_gains
from plan import loader
from plan.model_math import model_flops_per_token, recompute_flops_per_token
from twin import api
from twin.fidelity import FILE as FIDELITY_FILE
from twin.fidelity import summarise
from twin.step.compute import Device
from twin.step.context import shape_of, step_context
from twin.step.kernels import layer_cost
from twin.step.predict import PredictOptions, predict, straggler_factor

BOUNDS = {  # table: (mean |error|, worst |error|)
    "nccl-tests": (0.03, 0.05),
    # DeepEP's normal kernels: its README's rows set the H100's dispatcher rates (compute.ep_dispatch), an H200's
    # two-node run (DeepEP #493: two timings, each read both ways) checks them: -2.5% to +5.9%
    "deepep-kernels": (0.03, 0.065),
    "narayanan-a100": (0.035, 0.085),  # below Calculon's 8.0% mean on the same rows (Isaev et al. 2023)
    # misses the 5% / 10% target: 32B -23%; every row but 16B and 32B optimistic, +2% to +13% (1.7B and 7.1B
    # +8% to +9% with no pipeline to argue about; the pipelined rows interleaved since the README's p2p overlap
    # exists only under the interleaved schedule: benchmarks/published.py mcore_virtual_stages)
    "mcore-h100": (0.10, 0.24),
    "megatron-a100-readme": (0.05, 0.10),
    # misses the target on the 131k row since the attention tables are no longer scaled by the in-training fraction
    # (a GEMM figure, refitted to 0.782): CP16 at 131k tokens reads 43.8 against 38% MFU (+5.8 points; +1.8 while
    # FlashAttention-2 ran at 0.802 of its benchmark). Attention is ~60% of that step, and the paper names neither
    # its attention kernel nor how its MFU counts causal attention: counted half, the same step reads 31.3%, 6.7
    # points pessimistic. The 8,192-GPU row reads 44.1 against 43 (+1.1 points), 16,384 40.8 against 41, since the
    # paper's FP32 gradient accumulation over microbatches is priced as the add it is under PyTorch's autograd
    # (README, Fidelity).
    "llama3-table4": (0.065, 0.155),
    # within the 5% mean target; gpt3-175b fp8 at 2,048 GPUs is the worst row, +10.3% (+9.8% until a sequence-
    # parallel fp8 operand was cast on the rank's shard, as Transformer Engine casts it; the fp8 rows lose 3-6% from
    # 128 to 2,048 GPUs where bf16 loses 2%, and the twin keeps them flat; README, Fidelity)
    "dgxc-h100": (0.05, 0.105),
    # misses the target: optimistic on every row, fp8 most (+7% to +13%), bf16 +1% to +5%; the recipe runs
    # Transformer Engine's TP-overlap defaults (no SM margin) (README, Fidelity)
    "dgxc-h100-moe": (0.07, 0.145),
    # validation on recipes nothing was built or fitted on: Nemotron-4 15B and 340B, 16 to 2,048 GPUs
    "dgxc-h100-nemotron": (0.05, 0.10),
    # misses the target by most: DeepSeek-V3 671B on 512 and 1,024 H100, bf16, experts folded over TP2 x 32 dp
    # replicas (EP64, expert TP1), a recipe nothing was built or fitted on: +17.2% and +22.5% optimistic, with ~18 s
    # of a 42 s step in exposed all-to-all, and the published 6% drop from PP8 to PP16 seen as 2%. Pricing the
    # recipe's grouped GEMM (4 streams) and fused permutations where the stack's SequentialMLP and unfused ones stood
    # moved it from 21.0% to 24.0%, MLA's eager RoPE and concatenations back to 19.9%
    # (benchmarks/published_deepseek.py; README, Fidelity)
    "dgxc-h100-deepseek": (0.205, 0.23),
    # within the 5% target on a recipe nothing was built or fitted on: Llama 4 Maverick on 512 H100, dense and MoE
    # layers alternating, experts folded over all 512 ranks (EP128 x expert TP4): bf16 -2.5%, fp8 +4.7% (the fp8
    # run's CUDA graphs not priced) (benchmarks/published_llama4.py; README, Fidelity)
    "dgxc-h100-llama4": (0.04, 0.05),
    # within the 5% target on a run nothing was built or fitted on: Megatron-Core 0.9's Mixtral 8x7B headline, 64 H100
    # in bf16 at TP1 PP4 EP8 VP8, +3.1% (dropless with routing left to the auxiliary loss, which the twin prices
    # even) (benchmarks/published_mcore_moe.py; README, Fidelity)
    "mcore-moe-h100": (0.04, 0.04),
    # misses the target on DeepSeek-V3 only: NeMo AutoModel's PyTorch-native runs (FSDP2, DeepEP, torch CP) on the
    # `automodel` stack, routed by the benchmarks' fake balanced gate (group-limited routing, one group of top_k
    # consecutive experts a token): Qwen3 30B-A3B on 8 GPUs +0.2%, Llama 3.1 70B on 64 +3.1%, DeepSeek-V3 PP4 VP8
    # EP64 on 256 +15.2% and on 1,024 +33.5% (4 runs of the pipeline schedule a step: Layout.schedule_runs; +39.2% as
    # one schedule) (benchmarks/published_automodel.py; README, Fidelity)
    "automodel-h100": (0.135, 0.34),
    # within the target on a figure nothing was built or fitted on: DeepSeek-V3's own pre-training, 2,664K H800 GPU
    # hours for 14.8T tokens (its report, Table 1), against `twin run deepseek-v3-2k` over 4 seeds, failures and
    # checkpoints included: -1.4% (benchmarks/published_deepseek_report.py; README, Fidelity)
    "deepseek-v3-report": (0.03, 0.03),
    # misses the target, nothing built or fitted on it: BLOOM-176B's logged steps on 192-384 of Jean Zay's A100 with
    # Megatron-DeepSpeed under seven layouts (TP1-4, PP12-72, micro-batch 1-2): TP1 -3%, TP2 +5-6%, TP4 +10-20%
    # (15.0% mean, every row 11-21% optimistic, before DeepSpeed's partitioned sends, BF16_Optimizer's per-microbatch
    # fp32 accumulation and all-reduce, and the tied embedding's all-reduce were priced from the source); Omni-Path's
    # efficiency is an estimate (benchmarks/published_bloom.py)
    "bloom-176b-a100": (0.105, 0.205),
    # validation on earlier releases, fp8, FlashAttention-2 as the launcher of the time ran it (NVTE_FUSED_ATTN=0):
    # NeMo 24.07's 11 rows, GPT-3 5B to Nemotron-4 340B (the page's revisions move rows by up to 6%), and NeMo
    # 24.03.01's Llama 2 7B from 4k to 1M tokens, context-parallel up to 32 (benchmarks/published_nemo2407.py)
    "nemo-24.07-h100": (0.05, 0.10),
    "nemo-long-seq-h100": (0.035, 0.10),
    # misses the target: Megatron-Bridge's Llama 3 rows, NeMo 25.11 to 26.06, fp8 current scaling, a newer stack
    # (Transformer Engine 2.x) nothing was built or fitted on: 70B (TP4 PP8 VP5) 8-11% pessimistic in every release,
    # 405B (TP8 PP8 CP2 VP8) 2-7% optimistic; the same settings' published rows spread 4% over the releases
    # (benchmarks/published_mbridge.py; README, Fidelity)
    "mbridge-h100": (0.075, 0.11),
    # misses the target by most: Megatron-Bridge's MoE rows, NeMo 25.11 to 26.06, nothing built or fitted on them:
    # Qwen3 235B-A22B in fp8 (TP2 PP8 VP4 EP32, experts folded over tp and dp, the combined 1F1B) 5-9% pessimistic
    # (19-24% optimistic while the combined 1F1B hid every all-to-all its paired compute could); Qwen3 30B-A3B at PP1
    # EP16 (HybridEP on 32 SMs at the H100's measured dispatcher rates) 20-22% optimistic; 30B at PP2 VP12 EP8 with
    # DeepEP and the combined 1F1B in 26.02 +138.5% (published at 57% of 26.04's throughput); gpt-oss-120b in bf16
    # (PP4 EP8, 16 experts a rank) 26-38% optimistic (benchmarks/published_mbridge_moe.py; README, Fidelity)
    "mbridge-h100-moe": (0.28, 1.40),
    # the same 30B shape in bf16, Megatron-Bridge's controlled comparisons: HybridEP with the overlap off +1.2% (the
    # dispatcher's rates are DeepEP's, not fitted here), on -6.2% (its profile's 36.55% hidden communication is the
    # stack's ep_overlap_hidden: a `fit` row); the alltoall dispatcher +14% off (NCCL's all-to-all at EP16 priced
    # faster than it ran) and +1.1% on (+42.5% while every hideable all-to-all was hidden)
    "mbridge-qwen3-30b-controlled": (0.06, 0.145),
    # misses the target: MosaicML's MPT on 8 A100 under FSDP, a table no part of the twin was built or fitted on.
    # Most rows that keep their activations are within 5% from 512 to 8k tokens, but every model is 8-20% slow at
    # 32k-65k (its Triton FlashAttention is priced at FlashAttention-1's figure, which stops at 16k at 83 TFLOP/s)
    # and the checkpointed 7B and 13B rows 8-14% slow up to 8k; 760M at 512-1,024 tokens (+22%, +32%) and 125M
    # (+7% to +11%) are fast where the published rows lose what the twin does not see (README, Fidelity)
    "mpt-a100": (0.08, 0.33),
    # the April 2023 A100 40GB table, 8 to 128 GPUs: within 4% on the 7B-30B rows at 2,048 tokens from 16 to 128
    # GPUs, but 70B on 64 GPUs +37% (the published row is 27% below the 128-GPU one per GPU; the twin sees 5%), 1B on
    # 32 GPUs +26% (its neighbours at 16 and 64 GPUs are within 3%), 125M across nodes +11% to +15%, long sequences
    # slow as on the 80GB table (README, Fidelity)
    "mpt-a100-40gb": (0.06, 0.38),
    # MPT on H100 (October 2023, 8 to 64 GPUs), bf16 and fp8 with Transformer Engine's Linears: the same pattern as
    # on A100 — within 4% at 2k-4k tokens without checkpointing for 760M-3B, 13-23% slow at 16k-65k and on the
    # checkpointed 7B and 13B rows, 13B without checkpointing +13% to +15% (README, Fidelity)
    "mpt-h100": (0.09, 0.23),
    "mpt-h100-fp8": (0.09, 0.18),
    # misses the target: MPT on 128-512 H100 (January 2024, every setting in sweep.py). The checkpointed 13B, 30B and
    # 70B rows are within 9%, but 1B, 3B and 7B without checkpointing on FlashAttention-2 are 15-28% fast (20-35%
    # before flash_attn_fn's unpadding was priced), more so with more GPUs (published 8-10% down from 128 to 512, the
    # twin 0-1%): the twin hides every FSDP gather and reduce-scatter under the blocks' compute (README, Fidelity)
    "mpt-h100-large": (0.12, 0.28),
}
LLAMA3_MFU_POINTS = {8192: 0.025, 131072: 0.06}
"""Llama 3 Table 4 prints MFU to whole points; the target is 2 points and the rounding. The 8k rows meet it (+1.1
and -0.2 points); the 131k row (CP16) is 5.8 points over, by an MFU convention the paper does not state (see
BOUNDS)."""


@pytest.fixture(scope="module")
def tables() -> dict[str, list[Row]]:
    return {name: build() for name, build in TABLES.items()}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_published_table_within_stated_error(name: str, tables: dict[str, list[Row]]) -> None:
    rows = tables[name]
    s = summary(rows)
    mean, worst = BOUNDS[name]
    report = "\n".join(f"{r['what']}: {r['published']:g} vs {r['predicted']:.4g} ({r['error']:+.1%})" for r in rows)
    assert s["mean_abs_error"] <= mean, report
    assert s["worst_abs_error"] <= worst, report


def test_llama3_rows_within_mfu_points(tables: dict[str, list[Row]]) -> None:
    for r in tables["llama3-table4"]:
        seq = 131072 if "131,072" in r["what"] else 8192
        assert abs(r["predicted"] - r["published"]) <= LLAMA3_MFU_POINTS[seq], r["what"]


@pytest.mark.consistency
def test_h100_in_training_fraction_sits_at_the_centre_of_its_fit_table(tables: dict[str, list[Row]]) -> None:
    """Consistency: topologies/accelerators/h100-sxm5-80gb.yaml's in_training_fraction was fitted on the bf16 rows
    of NVIDIA's DGX Cloud table (benchmarks/fit_in_training.py); with it, those rows' mean log error is ~0. A change
    to the step model that moves them says the fraction must be fitted again."""
    fit = [r for r in tables["dgxc-h100"] if r["kind"] == "fit"]
    assert len(fit) == 8
    mean_log = sum(math.log(r["predicted"] / r["published"]) for r in fit) / len(fit)
    assert abs(mean_log) < 0.01


def test_h100_fraction_left_out_rows_within_bounds(tables: dict[str, list[Row]]) -> None:
    """Validation of the fitted fraction where it was not fitted and every setting is known: the same table's fp8
    rows and NeMo's earlier releases (24.07; 24.03.01's long sequences, where attention is most of the step) within
    issue 13's target together (Llama 3's rows, whose kernel and MFU convention are unstated, have their own bound)."""
    left_out = [r for r in tables["dgxc-h100"] if r["kind"] == "validation"] + [
        r for name in ("nemo-24.07-h100", "nemo-long-seq-h100") for r in tables[name]
    ]
    errors = [abs(r["error"]) for r in left_out]
    assert len(errors) == 28
    assert sum(errors) / len(errors) <= 0.04 and max(errors) <= 0.105  # gpt3-175b fp8 at 2,048 GPUs: +10.3%


def test_every_published_table_has_rows_and_sources(tables: dict[str, list[Row]]) -> None:
    assert set(tables) == set(BOUNDS)
    for rows in tables.values():
        assert rows and all(r["source"] and r["kind"] in ("validation", "consistency", "fit") for r in rows)


def test_narayanan_larger_models_run_no_faster_per_gpu_than_measured_by_more_than_the_table_spread(
    tables: dict[str, list[Row]],
) -> None:
    """The twin's error on Narayanan's table has one sign (it is a little optimistic everywhere) and no trend
    with size: the spread of the errors stays within 10 points, so the ordering of the rows is the paper's."""
    errors = [r["error"] for r in tables["narayanan-a100"]]
    assert max(errors) - min(errors) <= 0.10


def test_llama3_405b_fits_without_recompute_and_utilisation_is_ordered() -> None:
    """§3.3.2: the 16k-GPU run trains without activation recompute, so the plan must fit in 80 GB; with
    recompute switched on HFU counts the recomputed work on top of MFU; nothing executes above peak."""
    plan = loader.load("llama3-405b-16k")
    result = predict(plan)
    assert result.fits, result.memory
    assert result.hfu == pytest.approx(result.mfu)  # no recompute: hardware and model FLOPs agree
    # the fused causal attention skips the masked half of the scores, so the kernels run less than the count
    assert 0 < result.executed_utilisation < result.mfu <= 1
    full = predict(loader.load("llama3-405b-16k", ["layout.recompute=full"]))
    m = plan.model
    ratio = (model_flops_per_token(m) + recompute_flops_per_token(m, "full")) / model_flops_per_token(m)
    assert full.hfu == pytest.approx(full.mfu * ratio, rel=1e-9)
    assert full.mfu < result.mfu  # recompute costs time and buys nothing the MFU counts


def test_every_mpt_row_fits_as_it_ran() -> None:
    """MosaicML ran every row of its A100 and H100 tables, so each must fit in the memory model. The closest are the
    760M and 350M rows without checkpointing, whose largest transient is the logits under flash-attn's fused
    cross-entropy: 16-bit logits and gradient (counted in fp32, 30 rows did not fit). The fullest, 3B at 8k on the 80GB
    part and 1B and 350M on 16-64 A100 40GB, come to 89-90% of what CUDA reports (96% when 80 GB was read as 80e9
    bytes)."""
    worst = 0.0
    for row in MPT_A100 + MPT_A100_40GB + MPT_H100 + MPT_H100_FP8 + MPT_H100_LARGE:
        memory = predict(mpt_plan(row)).memory
        assert memory.fits, (row, memory.reason)
        worst = max(worst, memory.peak / memory.capacity)
    assert worst > 0.85  # the table's micro-batches were chosen near the memory limit; the model sees that too


def test_llm_foundrys_flash_attention_pays_its_unpadding_every_layer() -> None:
    """llm-foundry 5e85bd62d runs FlashAttention-2 between bert_padding's unpad_input of q, k and v and pad_input of
    the output: per token and hidden unit, 6 then 3 16-bit units moved forward (gathers; zeros and index_put), 1.5
    and 0.667 times that backward (zeros and scatter_; a gather), on 28 and 7 kernels. Closed form on one layer of
    the 1B row: nothing else in the layer moves."""
    row = next(r for r in MPT_H100_LARGE if r.model == "1b")
    with_unpad = mpt_plan(row)
    bare = api.load_plan(
        with_unpad.model_dump() | {"stack": {"name": "llm-foundry-0.3", "overrides": {"attention_kernel": "fa2"}}}
    )
    contexts = [step_context(p, loader.plan_cluster(p), PredictOptions(stragglers=False)) for p in (with_unpad, bare)]
    costs = [layer_cost(c.plan.model, shape_of(c), c.device, c.stack, False, c.plan.layout.recompute) for c in contexts]
    device = contexts[0].device  # the same cluster and dtype for both
    nbytes = shape_of(contexts[0]).tokens * with_unpad.model.hidden * 2
    forward = device.elementwise_s(9 * nbytes, 28)
    backward = device.elementwise_s(1.5 * 6 * nbytes, 6) + device.elementwise_s(0.667 * 3 * nbytes, 1)
    assert [k["name"] for k in UNPADDING] == ["unpad_qkv", "pad_output"]
    assert costs[0].forward_s - costs[1].forward_s == pytest.approx(forward, rel=1e-9)
    assert costs[0].backward_input_s - costs[1].backward_input_s == pytest.approx(backward, rel=1e-9)
    assert costs[0].backward_weight_s == pytest.approx(costs[1].backward_weight_s, rel=1e-12)


@pytest.mark.consistency
def test_straggler_cost_at_16k_is_llama3s_one_to_two_percent() -> None:
    """Consistency, not validation: the H100 clusters' jitter_cv was derived from Llama 3's 1-2% throughput
    variation at 16,384 GPUs (§3.3.4), so the median slowest of 16,384 must land inside that band."""
    cluster = loader.load_cluster("meta-24k-h100-roce")
    assert 1.01 <= straggler_factor(cluster, 16_384) <= 1.02


@pytest.mark.consistency
def test_llama3_run_matches_table_5_and_reaches_ninety_percent_effective_training_time() -> None:
    """Validation: the simulated run sees Table 5's interruption rate (466 in 54 days, 419 unexpected + 47
    planned; the cluster's rates come from those counts, so within 10% over ten seeds). Consistency: the preset's
    restart time was derived from the paper's ">90% effective training time" (plan/presets/plans/llama3-405b-16k
    .yaml), so the mean goodput must clear 90%."""
    summary = api.simulate_runs("llama3-405b-16k", 10)
    per_54_days = [sum(r.interruptions.values()) / r.wall_days * 54 for r in summary.runs]
    assert sum(per_54_days) / len(per_54_days) == pytest.approx(466, rel=0.10)
    assert summary.stats["goodput"]["mean"] > 0.90


@pytest.mark.consistency
def test_h100_gemm_constants_are_the_fit_of_xlas_table() -> None:
    """Consistency: the H100 file's GEMM fraction, bandwidth and fixed cost are benchmarks/fit_gemm_table.py's fit
    of XLA's measured sm_90 table; a change to the table or the file that moves them says fit again."""
    result = fit_gemm_table.fit(fit_gemm_table.load_table())
    compute = loader.load_cluster("dgx-h100-superpod").compute
    assert compute.gemm_peak_fraction["bf16"] == pytest.approx(result.fraction, abs=0.001)
    assert compute.gemm_bandwidth_GBps == pytest.approx(result.bandwidth_GBps, rel=0.001)
    assert compute.gemm_fixed_us == pytest.approx(result.fixed_us, abs=0.01)
    # fp8 has no table by shape: the bf16 fit times ml-engineering's fp8 / bf16 best shapes (1,402.6 / 1,978.9 of
    # fp8, 794.5 / 989.4 of bf16)
    assert compute.gemm_peak_fraction["fp8"] == pytest.approx(
        result.fraction * (1402.6 / 1978.9) / (794.5 / 989.4), abs=0.001
    )


def test_in_training_fraction_scales_the_gemms_and_not_the_attention_tables() -> None:
    """The fitted fraction is a weight-GEMM figure: halving it doubles a compute-bound GEMM's FLOP time and leaves a
    fused attention kernel at its benchmark's throughput (topologies/accelerators/h100-sxm5-80gb.yaml, the
    fraction's source comment)."""
    full = Device.of(api.load_cluster("dgx-h100-superpod", ["compute.in_training_fraction=1"]), "bf16", 8)
    half = Device.of(api.load_cluster("dgx-h100-superpod", ["compute.in_training_fraction=0.5"]), "bf16", 8)
    flops = 4 * 4096 * 128 * 8192 * 32 / 2
    assert half.attention_s(flops, 8192, 128) == full.attention_s(flops, 8192, 128)
    fixed = full.gemm_fixed_s
    m = n = k = 8192.0
    assert half.gemm_s(m, n, k) - fixed == pytest.approx(2 * (full.gemm_s(m, n, k) - fixed), rel=1e-9)


def test_a_kernel_without_a_figure_is_priced_at_another_and_the_prediction_says_so() -> None:
    """llm-foundry's Triton kernel has its own H100 figure (FlashAttention-1's bars), far below cuDNN's; on B200,
    which holds only cuDNN's table, it is priced at that and the prediction carries a note naming the stand-in."""
    h100 = api.load_cluster("dgx-h100-superpod")
    flops = 4 * 4096 * 128 * 8192 * 32 / 2
    triton = Device.of(h100, "bf16", 8, attention_kernel="triton").attention_s(flops, 8192, 128)
    cudnn = Device.of(h100, "bf16", 8, attention_kernel="cudnn").attention_s(flops, 8192, 128)
    assert sum(triton) > 2.5 * sum(cudnn)  # 135 against 529 (forward) and 457 (backward) TFLOP/s at 8k
    row = MPT_H100[0]
    assert predict(mpt_plan(row)).notes == ()
    notes = predict(api.load_plan(mpt_plan(row), ["cluster.overrides.accelerator=b200-sxm-180gb"])).notes
    assert len(notes) == 1 and "'triton'" in notes[0] and "cudnn's figure" in notes[0], notes


def test_a_dispatcher_without_measured_rates_on_the_accelerator_is_noted() -> None:
    """DeepSeek-V3's node-forwarding dispatcher is priced at DeepEP's measured rates on H800 (compute.ep_dispatch)
    without a note; moved to B200, which has none (and no FA3 table), the prediction names both stand-ins."""
    assert predict(api.load_plan("deepseek-v3-2k")).notes == ()
    notes = predict(api.load_plan("deepseek-v3-2k", ["cluster.accelerator=b200-sxm-180gb"])).notes
    assert len(notes) == 2
    assert "'fa3'" in notes[0] and "node-forwarding dispatcher" in notes[1] and "compute.ep_dispatch" in notes[1]


def test_the_release_gain_of_nemo_24_12_is_the_attention_kernel() -> None:
    """NeMo 24.12 ran Llama 3 8B 13% faster than 24.07 on one layout and Nemotron-4 340B no faster (published);
    24.12's Llama recipe runs cuDNN's fused attention where 24.07's launcher ran FlashAttention-2, and 340B ran
    FlashAttention-2 in both. The twin, given each release's kernel, finds the same split within 3 points for
    those two (70B, with its attention a smaller share, it puts at 7% against the published 3%)."""
    gains = {row.split(",")[0]: (published, twin) for row, published, twin in release_gains()}
    assert set(gains) == {"llama3-8b", "llama3-70b", "nemotron4-340b"}
    for model in ("llama3-8b", "nemotron4-340b"):
        published, twin = gains[model]
        assert abs(twin - published) <= 0.03, model
    assert gains["llama3-8b"][1] > gains["llama3-70b"][1] > gains["nemotron4-340b"][1]


def test_h100_gemms_take_the_time_xla_measured_for_their_shape() -> None:
    """Kernel-level validation: outside a training step (in-training fraction 1) the step model's H100 GEMM takes
    the time XLA measured for every layer-sized shape of its table within 9% (the fit's worst), and keeps the order
    beyond the fit: 4096 x 4096 x 256 runs at half the 4096-cube's rate per FLOP as measured, the model at 1/1.5."""
    cluster = api.load_cluster("dgx-h100-superpod", ["compute.in_training_fraction=1"])
    device = Device.of(cluster, "bf16", 8)
    table = fit_gemm_table.load_table()
    sized = table[fit_gemm_table.layer_sized(table)]
    errors = [device.gemm_s(r.m, r.n, r.k, r.b) / r.seconds - 1 for r in sized.itertuples()]
    assert max(abs(e) for e in errors) < 0.09 and len(errors) == 108

    def rate(m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k / device.gemm_s(m, n, k)

    measured = table.set_index(["b", "m", "n", "k"]).flops_per_s
    slower = measured[(1, 4096, 4096, 4096)] / measured[(1, 4096, 4096, 256)]
    assert 1.4 < rate(4096, 4096, 4096) / rate(4096, 4096, 256) < slower == pytest.approx(2.0, rel=0.01)


def test_published_fidelity_file_is_what_the_tables_give_today(tables: dict[str, list[Row]]) -> None:
    """twin/published_fidelity.json, which every prediction quotes, is the grouping of today's rows: a change to the
    step model that moves a row and leaves the file behind fails here (`python benchmarks/published_figures.py`
    rewrites it)."""
    committed = json.loads(FIDELITY_FILE.read_text())["groups"]
    today = summarise(tables)
    key = ("accelerator", "precision", "moe")
    assert [[g[k] for k in key] for g in committed] == [[g[k] for k in key] for g in today]
    for old, new in zip(committed, today, strict=True):
        assert (old["rows"], old["tables"], old["worst"], old["optimistic_rows"]) == (
            new["rows"],
            new["tables"],
            new["worst"],
            new["optimistic_rows"],
        )
        for field in ("mean_abs_error", "p90_abs_error", "worst_error"):
            assert old[field] == pytest.approx(new[field], rel=1e-9, abs=1e-12), (old["worst"], field)
        assert old["stacks"].keys() == new["stacks"].keys()
        for stack, mine in old["stacks"].items():
            want = new["stacks"][stack]
            assert (mine["rows"], mine["worst"]) == (want["rows"], want["worst"]), stack
            for field in ("mean_abs_error", "worst_error"):
                assert mine[field] == pytest.approx(want[field], rel=1e-9, abs=1e-12), (stack, field)


def test_megatron_flop_count_is_the_gpt_closed_form_and_counts_the_routed_experts() -> None:
    """Megatron-Core's count from a plan (benchmarks.published.megatron_tflops): on the dense GPT rows of the r0.8.0
    table (g = a, q = h, f = 4h, no GLU) it is ../shared/published/megatron-core-h100.md's closed form
    72·B·s·l·h²·(1 + s/6h + V/12lh), and routing each token to k experts multiplies the MLP term by k."""
    from benchmarks.published import MCORE_H100, mcore_plan, megatron_tflops
    from benchmarks.published_mcore_moe import MCORE_MOE_H100, mcore_moe_plan

    for row in MCORE_H100:
        s, h, layers, vocab = 4096, row.hidden, row.layers, 131072
        closed = 72 * row.batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
        gpus = row.tp * row.pp * row.dp
        assert megatron_tflops(mcore_plan(row), 1.0) == pytest.approx(closed / gpus / 1e12, rel=1e-9)
    plan = mcore_moe_plan(MCORE_MOE_H100[0])
    top1 = plan.model_copy(update={"model": plan.model.model_copy(update={"top_k": 1})})
    m = plan.model
    mlp_share = (m.moe_ffn_hidden / m.hidden * 1.5) / (
        (1 + m.n_kv_heads / m.heads + m.seq_len / m.hidden) + 2 * m.moe_ffn_hidden / m.hidden * 1.5
        + m.vocab / (2 * m.layers * m.hidden)
    )  # fmt: skip
    assert megatron_tflops(top1, 1.0) / megatron_tflops(plan, 1.0) == pytest.approx(1 - mlp_share, rel=1e-9)


def test_megatron_deepspeeds_tflops_are_blooms_logged_figure_from_its_logged_step() -> None:
    # the log line prints both: 104.70 s an iteration and 149.77 TFLOP/s (24·4·B·s·l·h²·(1 + s/6h + V/16lh) over the
    # 384 GPUs, recompute counted); dropping the recompute factor (3 for 4) or the vocabulary term misses it
    from benchmarks.published_bloom import BLOOM_A100, TFLOPS, megatron_deepspeed_tflops

    first = BLOOM_A100[0]
    assert megatron_deepspeed_tflops(first.step_s, first.gpus) == pytest.approx(TFLOPS, rel=2e-4)


def test_bloom_stage_split_is_the_readmes_with_the_tied_embedding_weighed_as_a_block() -> None:
    # tr11-176B-ml/README.md: "pp rank 0: [embed | 5 transformer blocks] ... pp ranks 1-10: 6 ... pp rank 11: [5
    # transformer blocks | embed]"; at PP72 the embedding fills the first and the last stage alone
    from benchmarks.published_bloom import BLOOM_A100, bloom_plan

    by_pp = {r.pp: bloom_plan(r).stage_layer_counts for r in BLOOM_A100}
    assert by_pp[12] == (5,) + (6,) * 10 + (5,)
    assert by_pp[72] == (0,) + (1,) * 70 + (0,)
    assert by_pp[24] == (2,) + (3,) * 22 + (2,)  # 72 items over 24 stages, the embedding one of the edges' three
