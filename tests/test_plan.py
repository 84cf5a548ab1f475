"""The plan format: presets load, broken plans fail with one line naming the field, overrides, layer splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from plan import loader
from plan.loader import PlanError
from plan.model_math import layer_params, model_flops_per_token, param_count
from plan.schema import ModelSpec, split_layers

BROKEN = sorted((Path(__file__).parent / "data" / "broken").glob("*.yaml"))


def expected_field(path: Path) -> str:
    first = path.read_text().splitlines()[0] if path.read_text() else ""
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <field>'"
    return first.removeprefix("# expect: ").strip()


@pytest.mark.parametrize("name", loader.plan_presets())
def test_every_plan_preset_validates(name: str) -> None:
    plan = loader.load(name)
    assert plan.layout.world_size <= loader.plan_cluster(plan).gpus
    assert plan.training.global_batch % (plan.layout.dp * plan.layout.microbatch_size) == 0


@pytest.mark.parametrize("path", BROKEN, ids=[p.stem for p in BROKEN])
def test_broken_plan_names_its_field(path: Path) -> None:
    with pytest.raises(PlanError) as info:
        loader.load(path)
    message = str(info.value)
    assert "\n" not in message, "a plan error is one line"
    assert expected_field(path) in message
    assert str(path) in message, "the error names the file"


def test_broken_corpus_covers_the_issue_categories() -> None:
    stems = {p.stem for p in BROKEN}
    for category in (
        "wrong-type",
        "unknown-key",
        "not-dividing",
        "world-too-big",
        "unknown-cluster",
        "negative",
        "zero-",
        "malformed-yaml",
    ):
        assert any(category in s for s in stems), category


def test_override_sets_nested_field_and_swaps_model_preset() -> None:
    plan = loader.load("cpu-tiny", ["layout.dp=1", "training.global_batch=8", "model.layers=6"])
    assert (plan.layout.dp, plan.training.global_batch, plan.model.layers) == (1, 8, 6)
    swapped = loader.load("llama3-405b-16k", ["model=llama3-70b", "layout.virtual_stages=4"])
    assert swapped.model.layers == 80


def test_override_without_equals_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match=r"section\.field=value"):
        loader.load("cpu-tiny", ["layout.dp"])


def test_plan_is_immutable() -> None:
    plan = loader.load("cpu-tiny")
    with pytest.raises(Exception, match="frozen"):
        plan.layout.dp = 4  # type: ignore[misc]


def test_cluster_path_relative_to_plan_file(tmp_path: Path) -> None:
    cluster = yaml.safe_load((loader.TOPOLOGY_DIR / "localhost-cpu.yaml").read_text())
    cluster["name"] = "my-box"
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "my-box.yaml").write_text(yaml.safe_dump(cluster))
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(
        "cluster: clusters/my-box.yaml\nmodel: tiny\nlayout: {dp: 1}\ntraining: {global_batch: 8, tokens: 1e5}\n"
    )
    plan = loader.load(plan_file)
    assert Path(plan.cluster.name).is_absolute() and loader.plan_cluster(plan).name == "my-box"


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (126, 16, (7,) + (8,) * 14 + (7,)),  # Llama 3 405B (Dubey et al. 2024 §3.3.2)
        (128, 16, (8,) * 16),
        (10, 4, (2, 3, 3, 2)),
        (7, 4, (1, 2, 2, 2)),
    ],
)
def test_split_layers_trims_outermost_stages(layers: int, stages: int, expected: tuple[int, ...]) -> None:
    assert split_layers(layers, stages) == expected


@pytest.mark.parametrize("layers", range(1, 70))
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8, 16, 32])
def test_split_layers_is_balanced(layers: int, stages: int) -> None:
    if layers < stages:
        with pytest.raises(ValueError):
            split_layers(layers, stages)
        return
    counts = split_layers(layers, stages)
    assert sum(counts) == layers and len(counts) == stages
    assert max(counts) - min(counts) <= 1
    assert counts == counts[::-1] or counts[0] <= counts[-1]


def test_llama3_405b_preset_stage_layers() -> None:
    """§3.3.2: one layer per chunk over 16 x 8 chunks, the first chunk only the embedding and the last only the
    head; the same trim on a plain 1F1B split gives 7 layers on the edge stages and 8 elsewhere."""
    plan = loader.load("llama3-405b-16k")
    assert plan.stage_layer_counts == (0,) + (1,) * 126 + (0,)
    plan = loader.load("llama3-405b-16k", ["layout.schedule=1f1b", "layout.virtual_stages=1"])
    assert plan.stage_layer_counts == (7,) + (8,) * 14 + (7,)
    plan = loader.load("llama3-405b-16k", ["layout.pp=8"])  # 64 chunks: two layers each, one on the edges
    assert plan.stage_layer_counts == (1,) + (2,) * 62 + (1,)


def test_edge_stage_trim_larger_than_an_edge_stage_is_refused() -> None:
    with pytest.raises(PlanError, match="edge_stage_trim: 3 is more than"):
        loader.load("llama3-405b-16k", ["layout.edge_stage_trim=3"])


@pytest.mark.parametrize(
    ("preset", "total", "tolerance"),
    [
        ("llama3-8b", 8.03e9, 0.01),  # Meta-Llama-3-8B model card
        ("llama3-70b", 70.6e9, 0.01),  # Meta-Llama-3-70B model card
        ("llama3-405b", 405.9e9, 0.01),  # Llama 3.1 405B model card
        ("gpt3-175b", 175.0e9, 0.01),  # Brown et al. 2020, Table 2.1
        ("deepseek-v3", 671e9, 0.005),  # DeepSeek-V3 report: 671B total, with its latent attention
        ("qwen3-30b-a3b", 30.5e9, 0.01),  # Qwen3 report Table 2 and model card: 30.5B total
        ("qwen3-235b-a22b", 235e9, 0.01),  # Qwen3 report Table 2: 235B total
        ("mixtral-8x7b", 46.7e9, 0.005),  # Jiang et al. 2024: 46.7B total
        ("mixtral-8x22b", 141e9, 0.01),  # Mistral AI: 141B total
        ("llama2-7b", 6.74e9, 0.005),  # Llama 2 model cards: 6.74B, 13.0B, 69.0B
        ("llama2-13b", 13.0e9, 0.005),
        ("llama2-70b", 69.0e9, 0.005),
        ("gpt-oss-120b", 116.8e9, 0.005),  # gpt-oss model card: 116.8B total
        ("llama4-maverick", 400e9, 0.005),  # Meta's Llama 4 model card: 400B total (17B active, below)
        ("llama4-scout", 109e9, 0.015),  # the card's 109B is the multimodal checkpoint's: its vision encoder too
    ],
)
def test_model_presets_match_published_parameter_counts(preset: str, total: float, tolerance: float) -> None:
    m = ModelSpec.model_validate(yaml.safe_load((loader.PRESET_DIR / "models" / f"{preset}.yaml").read_text()))
    assert param_count(m).total == pytest.approx(total, rel=tolerance)


def test_model_flops_per_token_is_six_n_plus_attention() -> None:
    m = ModelSpec(layers=2, hidden=8, heads=2, ffn_hidden=16, vocab=10, seq_len=4, glu=False)
    # per layer: attention 4·8·8 = 256, MLP 2·8·16 = 256; output head 10·8 = 80 -> 2·512 + 80 = 1104
    assert param_count(m).matmul_active == 1104
    assert model_flops_per_token(m) == 6 * 1104 + 12 * 2 * 2 * 4 * 4


def test_moe_active_parameters_count_top_k_and_shared() -> None:
    dense = ModelSpec(layers=1, hidden=8, heads=2, ffn_hidden=16, vocab=10, seq_len=4)
    moe = dense.model_copy(update={"experts": 4, "top_k": 2, "shared_experts": 1, "moe_ffn_hidden": 16})
    moe = ModelSpec.model_validate(moe.model_dump())
    expert = 3 * 8 * 16
    assert param_count(moe).total - param_count(dense).total == 4 * expert + 8 * 4  # + 4 experts, router
    assert param_count(moe).active - param_count(dense).active == 2 * expert + 8 * 4


def test_llama4_maverick_alternates_dense_and_moe_layers() -> None:
    """Llama 4 Maverick's interleave_moe_layer_step 2: layers 1, 3, ..., 47 route to experts, the even ones keep the
    16,384-wide dense MLP; 17B of its 400B parameters are active (Meta's model card)."""
    m = ModelSpec.model_validate(yaml.safe_load((loader.PRESET_DIR / "models" / "llama4-maverick.yaml").read_text()))
    assert [i for i in range(m.layers) if m.is_moe_layer(i)] == list(range(1, 48, 2))
    assert m.moe_layers == 24
    assert param_count(m).active == pytest.approx(17e9, rel=0.015)
    every = m.model_copy(update={"moe_layer_step": 1})
    expert_layer, dense_layer = (layer_params(m, moe=kind) for kind in (True, False))
    assert param_count(every).total - param_count(m).total == 24 * (expert_layer[0] - dense_layer[0])


def test_moe_layer_step_counts_from_the_leading_dense_layers() -> None:
    m = ModelSpec(layers=7, hidden=8, heads=2, ffn_hidden=16, vocab=10, seq_len=4, experts=4, top_k=1,
                  moe_ffn_hidden=8, dense_layers=1, moe_layer_step=3)  # fmt: skip
    assert [i for i in range(7) if m.is_moe_layer(i)] == [3, 6]
    assert m.moe_layers == 2
    assert m.is_moe_layer(7)  # a multi-token-prediction module past the last layer is MoE in an MoE model


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"experts": 0, "top_k": 0, "moe_ffn_hidden": None, "moe_layer_step": 2}, "moe_layer_step is set"),
        ({"moe_layer_step": 5}, "leaves no MoE layer among the 4"),
    ],
)
def test_moe_layer_step_that_cannot_hold_an_moe_layer_is_refused(update: dict[str, object], message: str) -> None:
    base = {"layers": 4, "hidden": 8, "heads": 2, "ffn_hidden": 16, "vocab": 10, "seq_len": 4, "experts": 4,
            "top_k": 1, "moe_ffn_hidden": 8}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        ModelSpec.model_validate(base | update)


def test_plan_round_trips_through_json() -> None:
    plan = loader.load("reference-100k")
    again = type(plan).model_validate(json.loads(plan.model_dump_json()))
    assert again == plan
