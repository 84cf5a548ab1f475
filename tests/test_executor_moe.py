"""The executor's mixture-of-experts layer in one process (the sharded runs are in test_executor_dist.py), the
records' expert imbalance, and the twin pricing the imbalance it is given."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from executor.model import build_stage_model
from executor.moe import MoE
from plan import loader
from plan.errors import PlanError
from plan.records import LayerStatsRecord, expert_imbalance
from twin import api

CPU = torch.device("cpu")


def _moe(*overrides: str) -> tuple[MoE, torch.nn.Module]:
    plan = loader.load("cpu-tiny-moe", list(overrides))
    model = build_stage_model(plan.model, range(plan.model.layers), True, True, 0, CPU)
    return model.moe_layers()[0], model


def _hidden(batch: int = 4, seq: int = 128) -> torch.Tensor:
    return torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_routing_does_not_depend_on_how_the_batch_is_split(capacity: float | None) -> None:
    # per-sequence routing: the whole batch and its halves route, drop and combine the same tokens
    moe, _ = _moe(*([f"model.capacity_factor={capacity}"] if capacity else []))
    x = _hidden()
    whole = moe(x)
    halves = torch.cat([moe(x[:2]), moe(x[2:])])
    torch.testing.assert_close(whole, halves, rtol=0, atol=1e-6)


def test_group_limited_routing_draws_a_tokens_experts_from_its_best_groups() -> None:
    """model.expert_groups 2 and group_top_k 1 over cpu-tiny-moe's 8 experts (top-2): each group of 4 is scored by
    the sum of its best top_k / group_top_k = 2 scores (not its whole sum, nor its best one), a token's two experts
    both come from its best group, and its gates stay its own scores there; without the limit many tokens' two
    experts sit in both groups."""
    x = _hidden()
    free, _ = _moe()
    limited, _ = _moe("model.expert_groups=2", "model.group_top_k=1")
    assert torch.equal(free.router.weight, limited.router.weight)  # seeded alike: only the routing differs
    scores = free.router(x.reshape(-1, 64)).float().softmax(-1)
    _, unlimited = scores.topk(2, dim=-1)
    assert bool((unlimited // 4)[:, 0].ne((unlimited // 4)[:, 1]).any())
    grouped = scores.view(-1, 2, 4)
    best_group = grouped.topk(2, dim=-1).values.sum(-1).argmax(-1)
    assert bool(best_group.ne(grouped.sum(-1).argmax(-1)).any())  # the rule differs from a whole-group sum here
    assert bool(best_group.ne(grouped.max(-1).values.argmax(-1)).any())  # and from a group's best score
    _, chosen = limited._limited(scores).topk(2, dim=-1)
    assert torch.equal(chosen // 4, best_group[:, None].expand(-1, 2))
    assert not torch.allclose(free(x), limited(x))


def test_dropless_routes_every_choice_and_a_capacity_drops_the_excess() -> None:
    x = _hidden()
    moe, _ = _moe()
    moe(x)
    load, dropped = moe.take_stats()
    assert sum(load) == x.shape[0] * x.shape[1] * moe.top_k and dropped == 0
    assert moe.take_stats() == ([0] * moe.n_experts, 0)  # taking the stats resets them
    moe(x)
    assert isinstance(moe.load, torch.Tensor)  # counted on the device: no host sync per layer and microbatch
    moe.reset_stats()
    assert moe.take_stats() == ([0] * moe.n_experts, 0)
    tight, _ = _moe("model.capacity_factor=0.5")
    tight(x)
    load, dropped = tight.take_stats()
    capacity = math.ceil(0.5 * tight.top_k * x.shape[1] / tight.n_experts)
    kept = x.shape[0] * x.shape[1] * tight.top_k - dropped
    assert dropped > 0 and kept <= x.shape[0] * tight.n_experts * capacity


def test_the_balance_loss_reaches_the_router_at_its_own_layer() -> None:
    # with no gradient coming from above, the router's gradient is exactly the balance loss's own gradient times
    # the layer's scale: the loss joins the backward at the MoE output, not through the model's loss
    x = _hidden(2)
    moe, _ = _moe("model.aux_loss_coef=0.01")
    moe.aux_scale = 0.25
    out = moe(x)
    out.backward(torch.zeros_like(out))
    scores = moe.router(x.reshape(-1, 64)).float().softmax(-1)
    chosen = scores.topk(moe.top_k, dim=-1).indices
    (expected,) = torch.autograd.grad(0.25 * moe._balance_loss(scores, chosen, 2, 128), moe.router.weight)
    assert expected.abs().max() > 0
    torch.testing.assert_close(moe.router.weight.grad, expected, rtol=1e-5, atol=1e-12)
    silent, _ = _moe("model.aux_loss_coef=0")
    out = silent(x)
    out.backward(torch.zeros_like(out))
    assert not silent.router.weight.grad.any()


def test_the_executor_routes_only_the_layers_the_model_makes_moe() -> None:
    """`moe_layer_step` 2 after one dense layer: of four layers only layer 2 gets an MoE MLP, as the twin prices."""
    plan = loader.load("cpu-tiny-moe", ["model.moe_layer_step=2"])
    model = build_stage_model(plan.model, range(4), True, True, 0, CPU)
    routed = [isinstance(block.feed_forward, MoE) for block in model.blocks()]
    assert routed == [plan.model.is_moe_layer(i) for i in range(4)] == [False, False, True, False]


def test_an_expert_has_the_same_weights_on_whichever_rank_holds_it() -> None:
    plan = loader.load("cpu-tiny-moe")
    whole = build_stage_model(plan.model, range(4), True, True, 0, CPU).state_dict()
    half = build_stage_model(plan.model, range(4), True, True, 0, CPU, expert_ids=range(4, 8)).state_dict()
    expert_keys = [k for k in half if ".experts." in k]
    assert {int(k.split(".experts.")[1].split(".")[0]) for k in expert_keys} == {4, 5, 6, 7}
    for key, value in half.items():
        assert torch.equal(value, whole[key]), key


def test_expert_imbalance_is_the_busiest_ep_rank_over_the_mean(tmp_path: Path) -> None:
    # dp2 x ep2: one group of ranks 0 and 1; experts 0-3 on ep rank 0, 4-7 on ep rank 1
    plan = loader.load("cpu-tiny-moe", ["layout.dp=2", "layout.pp=1"])
    loads = {0: [30, 10, 10, 10, 5, 5, 5, 5], 1: [10, 10, 10, 10, 10, 10, 0, 0]}  # 100 routed to rank 0, 40 to 1
    path = tmp_path / "records.jsonl"
    lines = [
        LayerStatsRecord(step=0, rank=r, grad_norm={}, expert_load={"layers.1.feed_forward": load}).model_dump_json()
        for r, load in loads.items()
    ]
    path.write_text("\n".join(lines) + "\n")
    assert expert_imbalance(path, plan) == pytest.approx(100 / 70)
    assert expert_imbalance(path, loader.load("cpu-tiny")) is None  # dense: nothing to measure
    assert json.loads(lines[0])["expert_load"]["layers.1.feed_forward"][0] == 30


def test_the_twin_prices_the_imbalance_it_is_given_up_to_the_capacity() -> None:
    def step(*overrides: str) -> float:
        return api.predict(api.load_plan("deepseek-v3-2k", list(overrides))).step_time_s

    balanced, skewed = step(), step("model.expert_imbalance=1.5")
    assert skewed > balanced * 1.05
    capped = step("model.expert_imbalance=1.5", "model.capacity_factor=1.2")
    assert balanced < capped < skewed  # a capacity drops what is over it: the busiest rank computes at most 1.2x
    assert capped == pytest.approx(step("model.expert_imbalance=1.2"))


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["model.expert_groups=4"], "set both or neither"),
        (["model.expert_groups=3", "model.group_top_k=1"], "does not divide experts=8"),
        (["model.expert_groups=8", "model.group_top_k=1"], "hold fewer than top_k=2; keep at least 2 groups"),
        (["model.expert_groups=8", "model.group_top_k=9"], "more than expert_groups=8"),
    ],
)
def test_a_group_limit_the_experts_cannot_meet_is_refused_with_its_fix(overrides: list[str], names: str) -> None:
    """Group-limited routing that could not pick top_k experts, or names a group count that does not split them,
    is a plan error naming the field and what would work, before anything runs."""
    with pytest.raises(PlanError, match=re.escape(names)):
        loader.load("cpu-tiny-moe", overrides)
