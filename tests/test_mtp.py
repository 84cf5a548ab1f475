"""Multi-token prediction (DeepSeek-V3 §2.2): its module's weights, FLOPs, step cost and memory on the last stage,
against closed forms."""

from __future__ import annotations

import pytest

from executor.parallel import LayoutError, check_supported
from plan import loader
from plan.model_math import layer_params, model_flops_per_token, mtp_params
from twin.step.context import shape_of, step_context
from twin.step.costs import layer_costs, mtp_projection_cost, stage_costs
from twin.step.ends import head_cost
from twin.step.memory import layer_params as rank_layer_params
from twin.step.memory import stage_params
from twin.step.predict import PredictOptions

TWO_STAGES = ["layout.pp=2", "layout.dp=128", "layout.schedule=1f1b", "layout.virtual_stages=1",
              "layout.stage_layers=null", "training.global_batch=1024"]  # fmt: skip


def _plans():
    return (loader.load("deepseek-v3-2k", [*TWO_STAGES, f"model.mtp_layers={d}"]) for d in (0, 1))


def test_the_module_is_a_layer_a_projection_and_three_norms() -> None:
    without, with_mtp = _plans()
    m = with_mtp.model
    total, active = layer_params(m, moe=True)
    h = m.hidden
    assert mtp_params(m) == (total + 2 * h * h + 3 * h, active + 2 * h * h + 3 * h)
    assert mtp_params(m)[0] == pytest.approx(11.6e9, rel=0.01)  # the report's 14B counts its embedding and head too
    extra = model_flops_per_token(m) - model_flops_per_token(without.model)
    attention = 12 * m.heads * m.attention_width * m.seq_len
    assert extra == pytest.approx(6 * (active - 2 * h + 2 * h * h + m.vocab * h) + attention)


def test_the_last_stage_runs_the_module_and_the_head_again() -> None:
    without, with_mtp = _plans()
    ctx = step_context(with_mtp, loader.plan_cluster(with_mtp), PredictOptions(stragglers=False))
    shape = shape_of(ctx)
    moe = layer_costs(ctx)[True]
    head = head_cost(with_mtp.model, shape, ctx.device, ctx.stack)
    proj = mtp_projection_cost(with_mtp.model, shape, ctx.device)
    base = stage_costs(step_context(without, loader.plan_cluster(without), PredictOptions(stragglers=False)),
                       layer_costs(ctx))  # fmt: skip
    more = stage_costs(ctx, layer_costs(ctx))
    assert more[("F", 0)] == base[("F", 0)]  # the first stage is untouched
    added = more[("F", 1)].compute - base[("F", 1)].compute
    assert added == pytest.approx(moe.forward_s + proj.forward_s + head.forward_s, rel=1e-9)
    assert more[("F", 1)].ep > base[("F", 1)].ep  # its MoE layer dispatches and combines like the others


def test_the_last_stage_holds_the_module_and_a_copy_of_the_embedding() -> None:
    without, with_mtp = _plans()
    m = with_mtp.model
    per_rank = rank_layer_params(with_mtp, m.layers)  # tp 1: the dense part whole, the experts over ep
    layer = per_rank.dense + per_rank.expert
    grown = stage_params(with_mtp, 1)
    held = stage_params(without, 1)
    extra = grown.dense + grown.expert - held.dense - held.expert
    assert extra == pytest.approx(layer + 2 * m.hidden * m.hidden + 3 * m.hidden + m.vocab * m.hidden, rel=1e-6)
    assert stage_params(with_mtp, 0) == stage_params(without, 0)


def test_the_executor_refuses_multi_token_prediction() -> None:
    with pytest.raises(LayoutError, match="set mtp_layers: 0"):
        check_supported(loader.load("cpu-tiny", ["model.mtp_layers=1"]))
