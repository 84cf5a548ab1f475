"""Executor pieces without a launcher: layout-independent init, the data order, context-parallel attention against
unsharded attention, sanity checks, telemetry arithmetic, and the torchrun command `twin execute` builds."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.commtime import CommTimer
from executor.context_parallel import AllGatherAttention, local_positions, shard_sequence
from executor.data import Sampler, TokenCorpus, build_corpus, load_cursor, save_cursor
from executor.engine import learning_rate
from executor.model import GPT, build_stage_model, causal_attention
from executor.parallel import LayoutError, check_supported
from executor.pipeline import stage_layer_ids, stages_of_rank
from executor.sanity import SpikeDetector
from executor.telemetry import peak_flops_per_rank, stragglers
from plan import loader
from twin.cli.launch import free_port, torchrun_command

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> TokenCorpus:
    return TokenCorpus(build_corpus(tmp_path_factory.mktemp("c") / "corpus", tokens=200_000, seed=3), seq_len=32)


def test_stage_weights_equal_the_whole_models_whatever_the_split() -> None:
    spec = loader.load("cpu-tiny").model
    whole = dict(build_stage_model(spec, range(4), True, True, 7, torch.device("cpu")).named_parameters())
    for layers, first, last in ((range(0, 1), True, False), (range(1, 3), False, False), (range(3, 4), False, True)):
        part = build_stage_model(spec, layers, first, last, 7, torch.device("cpu"))
        for name, p in part.named_parameters():
            assert torch.equal(p, whole[name]), name
    other_seed = build_stage_model(spec, range(4), True, True, 8, torch.device("cpu"))
    assert not torch.equal(other_seed.layers["0"].attention.wq.weight, whole["layers.0.attention.wq.weight"])


def test_tied_embeddings_share_one_matrix() -> None:
    spec = loader.load("cpu-tiny", ["model.tied_embeddings=true", "layout.tp=1", "layout.pp=1"]).model
    model = build_stage_model(spec, range(4), True, True, 1, torch.device("cpu"))
    assert isinstance(model, GPT) and model.output is not None and model.tok_embeddings is not None
    assert model.output.weight is model.tok_embeddings.weight


def test_each_dp_rank_reads_its_share_of_the_same_global_batch(corpus: TokenCorpus) -> None:
    sampler = Sampler(corpus, global_batch=8, seed=5)
    whole, _ = sampler.batch(step=3, dp_rank=0, dp=1)
    shares = [sampler.batch(step=3, dp_rank=d, dp=4)[0] for d in range(4)]
    assert torch.equal(torch.cat(shares), whole)
    again = Sampler(corpus, global_batch=8, seed=5).batch(step=3, dp_rank=0, dp=1)[0]  # a "restart"
    assert torch.equal(again, whole)
    assert not torch.equal(sampler.batch(step=4, dp_rank=0, dp=1)[0], whole)


def test_targets_are_inputs_shifted_by_one(corpus: TokenCorpus) -> None:
    inputs, targets = Sampler(corpus, 4, 0).batch(0, 0, 1)
    assert inputs.shape == targets.shape == (4, 32)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_cursor_round_trip_and_fingerprint_stable(corpus: TokenCorpus, tmp_path: Path) -> None:
    cursor = Sampler(corpus, 4, 0).cursor(next_step=17)
    save_cursor(cursor, tmp_path / "cursor.json")
    assert load_cursor(tmp_path / "cursor.json") == cursor
    rebuilt = build_corpus(tmp_path / "again", tokens=200_000, seed=3)
    assert TokenCorpus(rebuilt, 32).fingerprint() == corpus.fingerprint()
    assert corpus.version().tokens == 200_000


def test_local_positions_partition_the_sequence_load_balanced() -> None:
    seq, cp = 16, 4
    parts = [local_positions(seq // cp, r, cp) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    assert {int(p.sum()) for p in parts} == {sum(range(seq)) // cp}  # equal causal work on every rank
    x = torch.arange(seq)[None, :]
    assert torch.equal(shard_sequence(x, 1, cp)[0], parts[1])


def _cp_worker(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=dt.timedelta(seconds=30)
    )
    gen = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(2, h, 16, 8, generator=gen) for h in (4, 2, 2, 4))  # GQA: 4 q heads, 2 kv heads
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    (causal_attention(q, k, v) * w).sum().backward()
    pos = local_positions(8, rank, 2)
    ql, kl, vl = (t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    out = AllGatherAttention(dist.group.WORLD, CommTimer())(ql, kl, vl)
    (out * w[:, :, pos]).sum().backward()
    ref = causal_attention(q.detach(), k.detach(), v.detach())
    torch.testing.assert_close(out, ref[:, :, pos], rtol=1e-5, atol=1e-6)
    for local, full in ((ql, q), (kl, k), (vl, v)):
        assert local.grad is not None and full.grad is not None
        torch.testing.assert_close(local.grad, full.grad[:, :, pos], rtol=1e-5, atol=1e-6)
    dist.destroy_process_group()


def test_all_gather_attention_matches_unsharded_attention_and_gradients() -> None:
    port = free_port()
    mp.spawn(_cp_worker, args=(port,), nprocs=2, join=True)


def test_pipeline_stage_placement() -> None:
    v_plan = loader.load("cpu-tiny", ["layout.schedule=zbv", "layout.virtual_stages=2", "layout.dp=1"])
    assert [stages_of_rank(v_plan, r) for r in range(2)] == [[0, 3], [1, 2]]
    loop = loader.load("cpu-tiny", ["layout.schedule=interleaved-1f1b", "layout.virtual_stages=2", "layout.dp=1"])
    assert [stages_of_rank(loop, r) for r in range(2)] == [[0, 2], [1, 3]]
    assert [list(stage_layer_ids(loop, s)) for s in range(4)] == [[0], [1], [2], [3]]


def test_unsupported_layouts_are_rejected_with_the_fix() -> None:
    # MoE layouts the executor does not run yet: tests/test_executor_moe.py
    with pytest.raises(LayoutError, match="tied_embeddings"):
        check_supported(loader.load("cpu-tiny", ["model.tied_embeddings=true"]))


def test_spike_detector_flags_a_jump_not_noise() -> None:
    det = SpikeDetector(window=10)
    assert all(det.observe(1.0 + 0.01 * (i % 3)) is None for i in range(10))
    spike = det.observe(5.0)
    assert spike is not None and spike["value"] == 5.0
    assert det.observe(1.01) is None  # the spike stayed out of the window


def test_stragglers_are_compared_within_their_pipeline_stage() -> None:
    busy = [1.0, 1.05, 2.0, 2.1, 1.0, 1.6]  # stage 1 is legitimately slower; rank 5 is a straggler of stage 0
    assert stragglers(busy, [0, 0, 1, 1, 0, 0]) == (5,)


def test_cpu_peak_is_shared_among_ranks_on_the_node() -> None:
    cluster = loader.load_cluster("localhost-cpu")
    per_core = cluster.accelerator.peak_tflops["fp32"] * 1e12
    assert peak_flops_per_rank(cluster, "fp32", 8) == pytest.approx(per_core * 2 / 8)
    assert peak_flops_per_rank(cluster, "fp32", 1) == pytest.approx(per_core)


def test_learning_rate_warms_up_then_decays() -> None:
    plan = loader.load("cpu-tiny")
    lrs = [learning_rate(plan, s) for s in range(plan.total_steps)]
    assert lrs[0] == pytest.approx(plan.training.lr / plan.training.warmup_steps)
    assert max(lrs) == pytest.approx(plan.training.lr)
    assert lrs[-1] == pytest.approx(0.1 * plan.training.lr, rel=0.01)


def test_twin_execute_builds_a_loopback_torchrun_command() -> None:
    plan = loader.load("cpu-tiny")
    cmd = torchrun_command("cpu-tiny", plan, overrides=["layout.zero=1"], steps=3, device="cpu", out=Path("r"))
    joined = " ".join(cmd)
    assert "--nproc-per-node 8" in joined and "--master-addr 127.0.0.1" in joined
    assert "-m executor.train --plan cpu-tiny --set layout.zero=1 --steps 3" in joined
    with pytest.raises(loader.PlanError, match="--nnodes 3"):
        torchrun_command("cpu-tiny", plan, overrides=[], steps=1, device="cpu", out=Path("r"), nnodes=3)


def test_twin_does_not_import_the_executor() -> None:
    code = "import sys, twin.cli, twin.cli.launch; sys.exit(any(m.startswith('executor') for m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False, timeout=120).returncode == 0
