"""Cluster what-ifs: a catalogue cluster plus overrides, from `--set cluster.…`, a plan file, or the API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.published import NARAYANAN_TABLE_1, narayanan_plan
from plan import loader
from plan.clusters import load_cluster_what_if
from plan.loader import PlanError
from twin import api
from twin.cli.app import app
from twin.run.reliability import job_failure_rates
from twin.step.predict import predict

A100 = "gpt3-175b-1k"  # a preset on the 140-node A100 SuperPOD


def test_growing_nodes_grows_the_outermost_tier() -> None:
    base = loader.plan_cluster(loader.load(A100))
    grown = loader.plan_cluster(loader.load(A100, ["cluster.nodes=560"]))
    assert (base.nodes, grown.nodes) == (140, 560)
    assert grown.fabric.tiers[-1].span_nodes == 560 and base.fabric.tiers[-1].span_nodes == 140
    assert grown.fabric.tiers[0] == base.fabric.tiers[0]  # inner tiers keep their domains
    assert grown.gpus == 4 * base.gpus


def test_a_layout_past_the_catalogue_runs_on_a_grown_cluster() -> None:
    plan = narayanan_plan(NARAYANAN_TABLE_1[-1])  # 3,072 GPUs: more than the catalogue's 1,120
    as_catalogued = {**plan.model_dump(mode="json"), "cluster": "dgx-a100-superpod"}
    with pytest.raises(PlanError, match="exceeds cluster 'dgx-a100-superpod' with 1120 accelerators"):
        api.load_plan(as_catalogued)
    assert plan.cluster.overrides == {"nodes": 384}
    assert loader.plan_cluster(plan).gpus == 3072 and predict(plan).step_time_s > 0


@pytest.mark.parametrize("tier", ["0", "leaf", "*"])
def test_a_tier_is_named_by_index_name_or_star(tier: str) -> None:
    cluster = loader.plan_cluster(loader.load(A100, [f"cluster.fabric.tiers.{tier}.bandwidth_GBps=100"]))
    bandwidths = [t.bandwidth_GBps for t in cluster.fabric.tiers]
    assert bandwidths[0] == 100
    assert bandwidths[1] == (100 if tier == "*" else 25)


def test_faster_nics_speed_up_cross_node_data_parallelism() -> None:
    """800G NICs (100 GB/s per GPU) on every tier: the DP reduction across nodes takes less exposed time."""
    slow = predict(loader.load(A100, ["layout.zero=1"]))
    fast = predict(loader.load(A100, ["layout.zero=1", "cluster.fabric.tiers.*.bandwidth_GBps=100"]))
    assert fast.collectives["dp"]["seconds"] < slow.collectives["dp"]["seconds"] / 3
    assert fast.step_time_s <= slow.step_time_s


def test_half_the_failure_rate_halves_every_cause() -> None:
    plan = loader.load(A100)
    half = loader.load(A100, ["cluster.failures.rate_scale=0.5"])
    base = job_failure_rates(plan, loader.plan_cluster(plan))
    halved = job_failure_rates(half, loader.plan_cluster(half))
    assert halved.keys() == base.keys()
    for cause, rate in base.items():
        assert halved[cause] == pytest.approx(rate / 2)


def test_a_plan_file_names_a_cluster_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(
        "model: tiny\nlayout: {dp: 1}\ntraining: {global_batch: 8, tokens: 1e5}\n"
        "cluster:\n  name: dgx-h100-superpod\n  overrides: {nodes: 4, node.intra.latency_us: 1.5}\n"
    )
    plan = loader.load(path, ["cluster.fabric.tiers.leaf.latency_us=9"])  # --set adds to the file's what-ifs
    cluster = loader.plan_cluster(plan)
    assert cluster.nodes == 4 and cluster.node.intra.latency_us == 1.5 and cluster.fabric.tiers[0].latency_us == 9
    assert str(plan.cluster).startswith("dgx-h100-superpod (nodes=4")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cluster.fabric.tiers.9.bandwidth_GBps=1", r"fabric\.tiers has no element '9'; use an index 0-1, or a name"),
        ("cluster.fabric.tiers.core.bandwidth_GBps=1", r"no element 'core'.*leaf, spine"),
        ("cluster.nodez.x=1", r"has no section 'nodez'"),
        ("cluster.nodes=-3", r"nodes: Input should be greater than 0"),
        ("cluster.fabric.tiers.0.bandwidth_GBps=fast", r"fabric\.tiers\.0\.bandwidth_GBps: Input should be a valid"),
        ("cluster.node.intra.speed=1", r"node\.intra\.speed: unknown key"),
        ("cluster.failures.rate_scale=-1", r"failures\.rate_scale"),
        ("cluster.accelerator.device_memory_GiB=200", r"device_memory_GiB: 200\.0 GiB is more than .* 80\.0 GB"),
        ("cluster.compute.gemm_bandwidth_GBps=3000", r"compute\.gemm_bandwidth_GBps: only the model fitted"),
    ],
)
def test_a_bad_what_if_is_one_line_naming_the_field(override: str, message: str) -> None:
    with pytest.raises(PlanError, match=message) as caught:
        loader.load(A100, [override])
    assert "\n" not in str(caught.value) and str(caught.value).startswith("preset gpt3-175b-1k")


def test_a_torus_what_if_must_keep_its_chip_count() -> None:
    with pytest.raises(PlanError, match=r"torus\.dims"):
        api.load_cluster("tpu-v5p-pod", ["nodes=10"])


def test_show_marks_what_the_what_if_set_and_what_followed() -> None:
    result = CliRunner().invoke(
        app, ["show", A100, "--set", "cluster.nodes=560", "--set", "cluster.fabric.tiers.leaf.latency_us=2", "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["cluster"]["nodes"] == 560
    assert out["cluster_what_if"]["set"] == ["nodes", "fabric.tiers.0.latency_us"]
    assert out["cluster_what_if"]["derived"] == {"fabric.tiers.1.span_nodes": "grown with nodes to 560"}
    table = CliRunner().invoke(app, ["show", A100, "--set", "cluster.nodes=560"], env={"COLUMNS": "200"})
    assert "set by what-if" in table.stdout and "grown with nodes to 560" in table.stdout


def test_the_api_takes_what_ifs_as_a_mapping_or_as_set_strings() -> None:
    as_map = api.load_cluster("dgx-a100-superpod", {"nodes": 280, "fabric.tiers.spine.oversubscription": 2})
    as_set = api.load_cluster("dgx-a100-superpod", ["nodes=280", "fabric.tiers.spine.oversubscription=2"])
    assert as_map == as_set and as_map.fabric.tiers[1].oversubscription == 2 and as_map.nodes == 280


def test_a_what_if_plan_survives_the_json_round_trip() -> None:
    plan = loader.load(A100, ["cluster.nodes=300"])
    again = api.load_plan(json.loads(plan.model_dump_json()))
    assert again == plan and loader.plan_cluster(again).nodes == 300


def test_another_chip_by_name_brings_its_own_efficiencies() -> None:
    # an H100 cluster given the A100 of the catalogue: the A100's chip and kernel efficiencies (not the H100's
    # efficiencies on an A100), and a later compute override still applies on top
    h100 = api.load_cluster("dgx-h100-superpod")
    a100 = api.load_cluster("dgx-a100-superpod")
    swapped = api.load_cluster("dgx-h100-superpod", ["accelerator=a100-sxm4-80gb", "compute.kernel_overhead_us=9"])
    assert swapped.accelerator == a100.accelerator != h100.accelerator
    assert swapped.compute.gemm_peak_fraction == a100.compute.gemm_peak_fraction != h100.compute.gemm_peak_fraction
    assert swapped.compute.kernel_overhead_us == 9 and swapped.node == h100.node
    plan = loader.load("gpt-1b-h100")
    slower = api.predict(loader.load("gpt-1b-h100", ["cluster.accelerator=a100-sxm4-80gb"]))
    assert slower.step_time_s > 1.5 * api.predict(plan).step_time_s  # 312 against 989 dense bf16 TFLOP/s
    with pytest.raises(PlanError, match="unknown accelerator 'b300'; one of a100-sxm4-40gb, a100-sxm4-80gb"):
        api.load_cluster("dgx-h100-superpod", ["accelerator=b300"])


def test_more_datasheet_memory_moves_what_cuda_reports_by_the_same_ratio() -> None:
    """The memory model fits into what CUDA reports (79.11 GiB of an "80 GB" H100), so a what-if on the datasheet's
    hbm_GB scales that figure, unless the same what-if sets device_memory_GiB itself; after a chip swap the ratio is
    the new chip's."""
    h100 = api.load_cluster("dgx-h100-superpod").accelerator
    assert h100.memory_bytes == 79.11 * 2**30 > h100.hbm_GB * 1e9
    bigger, what_if = load_cluster_what_if("dgx-h100-superpod", {"accelerator.hbm_GB": 96})
    assert bigger.accelerator.memory_bytes == pytest.approx(79.11 * 96 / 80 * 2**30)
    assert "accelerator.device_memory_GiB" in what_if.derived
    given = api.load_cluster("dgx-h100-superpod", {"accelerator.hbm_GB": 96, "accelerator.device_memory_GiB": 90})
    assert given.accelerator.memory_bytes == 90 * 2**30
    swapped = api.load_cluster("dgx-h100-superpod", ["accelerator=a100-sxm4-40gb", "accelerator.hbm_GB=80"])
    assert swapped.accelerator.memory_bytes == pytest.approx(79.0 * 2**30)  # 39.5 GiB x 80 / 40
    plan = loader.load("gpt-1b-h100")
    assert predict(plan).memory.capacity == pytest.approx(79.11)  # GiB, what the memory model fits into
    capacity = predict(loader.load("gpt-1b-h100", ["cluster.accelerator.hbm_GB=40"])).memory.capacity
    assert capacity == pytest.approx(79.11 / 2)
    with pytest.raises(PlanError, match=r"replaces the chip after accelerator\.hbm_GB changed it; name the chip first"):
        api.load_cluster("dgx-h100-superpod", ["accelerator.hbm_GB=96", "accelerator=a100-sxm4-80gb"])
