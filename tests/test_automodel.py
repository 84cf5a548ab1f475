"""NeMo AutoModel's benchmark rows (benchmarks/published_automodel.py): the fake balanced gate's routing as the
plan states it, and the rows as they ran."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.published_automodel import AUTOMODEL_H100, AutomodelRow, automodel_plan, automodel_stages, fake_gate
from plan import loader
from twin import api
from twin.step.collectives import routed_reach


def _fake_gate_reach(experts: int, top_k: int, ranks: int, per_node: int, tokens: int) -> tuple[float, float]:
    """Mean ranks and nodes one token's experts sit on under FakeBalancedGate (Automodel components/moe/layers.py:
    token t to experts top_k·t ... top_k·t + top_k - 1, mod experts), experts in order over the ranks."""
    t = np.arange(tokens)[:, None]
    chosen = (top_k * t + np.arange(top_k)) % experts
    rank = chosen // (experts // ranks)
    node = rank // per_node
    return (
        float(np.mean([len(set(r)) for r in rank])),
        float(np.mean([len(set(n)) for n in node])),
    )


@pytest.mark.parametrize(
    ("model", "ep", "per_node"),
    [("qwen3-30b-a3b", 8, 8), ("deepseek-v3", 64, 8), ("deepseek-v3", 256, 8), ("qwen3-30b-a3b", 32, 8)],
)
def test_the_fake_gate_as_group_limited_routing_reaches_the_ranks_the_gate_does(
    model: str, ep: int, per_node: int
) -> None:
    m = loader.expand_model({"model": model}, model)["model"]
    groups = fake_gate(m)
    ranks, nodes = routed_reach(ep, ep // per_node, m["top_k"], m["experts"], (groups["expert_groups"], 1))
    want = _fake_gate_reach(m["experts"], m["top_k"], ep, per_node, tokens=4096)
    assert (ranks, nodes) == pytest.approx(want, rel=1e-9)
    # fewer than random top-k routing reaches where a rank holds several experts; as many where it holds one
    random_ranks, _ = routed_reach(ep, ep // per_node, m["top_k"], m["experts"])
    if m["experts"] // ep > 1:
        assert ranks < random_ranks
    else:
        assert ranks == pytest.approx(random_ranks)


def test_the_fake_gate_needs_whole_runs_of_experts() -> None:
    with pytest.raises(ValueError, match="does not divide experts"):
        fake_gate({"experts": 60, "top_k": 8})


def test_automodel_cuts_61_layers_into_32_stages_as_its_pipelining_does() -> None:
    # components/distributed/pipelining/functional.py: layers // stages each, the first layers % stages one more; its
    # docstring's example splits 32 layers over 4 stages 8 each
    assert automodel_stages(61, 32) == (2,) * 29 + (1,) * 3
    assert automodel_stages(32, 4) == (8, 8, 8, 8)
    assert automodel_stages(10, 4) == (3, 3, 2, 2)  # the remainder on the first stages, not the last


@pytest.mark.parametrize("row", AUTOMODEL_H100, ids=lambda r: f"{r.model}-{r.gpus}")
def test_every_automodel_row_fits_as_it_ran(row: AutomodelRow) -> None:
    plan = automodel_plan(row)
    prediction = api.predict(plan)
    device = loader.plan_cluster(plan).accelerator.device_memory_GiB
    assert device is not None
    assert prediction.memory.peak <= device
