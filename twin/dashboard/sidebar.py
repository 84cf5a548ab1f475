"""The dashboard sidebar's what-if widgets (Streamlit): a model of one's own, the cluster and the recovery.

Each returns what it changed as `--set` strings (only the fields the user moved), so the plan shown is the base
plan plus exactly those overrides and the loader judges them like any other: an invalid value comes back as its
one-line reason under the layout.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from plan.clusters import accelerator_names
from twin import api

AS_IN_FILE = "as in the cluster file"

WIDGETS = ("accelerator", "domain", "nvlink", "nic", "oversub", "nodes", "rate_scale", "price", "spares", "restart")
"""Widget keys reset when the base plan changes (app.py resets its layout widgets with these)."""


def own_model(sb: Any) -> dict[str, Any]:
    """A model of the user's own: the sizes a planner knows (Llama 3 8B's to start from)."""
    with sb.expander("my model", expanded=True):
        c1, c2 = st.columns(2)
        sizes = {
            "layers": c1.number_input("layers", 1, 1000, 32, key="m_layers"),
            "hidden": c2.number_input("hidden", 64, 65536, 4096, 64, key="m_hidden"),
            "heads": c1.number_input("heads", 1, 1024, 32, key="m_heads"),
            "kv_heads": c2.number_input("kv heads", 1, 1024, 8, key="m_kv"),
            "ffn_hidden": c1.number_input("ffn hidden", 64, 262144, 14336, 64, key="m_ffn"),
            "vocab": c2.number_input("vocab", 256, 1_000_000, 128256, key="m_vocab"),
            "seq_len": c1.number_input("sequence", 128, 1_048_576, 8192, 128, key="m_seq"),
            "experts": c2.number_input("experts (0: dense)", 0, 1024, 0, key="m_experts"),
        }
        if sizes["experts"]:
            sizes["top_k"] = c1.number_input("top-k", 1, 64, 2, key="m_topk")
            sizes["moe_ffn_hidden"] = c2.number_input("expert ffn hidden", 64, 65536, 2048, 64, key="m_moe_ffn")
    return {"name": "my model", **{k: int(v) for k, v in sizes.items()}}


def cluster_what_ifs(sb: Any, cluster_name: str) -> list[str]:
    """The cluster's chip, NVLink domain, link speeds, over-subscription, size, failure rates and price."""
    cl = api.load_cluster(cluster_name)
    out: list[str] = []
    with sb.expander("cluster what-ifs"):
        chip = st.selectbox(
            f"accelerator (now {cl.accelerator.name})", [AS_IN_FILE, *accelerator_names()], key="accelerator"
        )
        if chip != AS_IN_FILE:
            out.append(f"cluster.accelerator={chip}")
        changes: list[tuple[str, Any, Any]] = []
        if not cl.fabric.torus:  # a torus fixes its chips per node by its dimensions
            c1, c2 = st.columns(2)
            domain = c1.number_input("GPUs per NVLink domain", 1, 1024, int(cl.node.gpus), key="domain")
            nvlink = c2.number_input("NVLink GB/s per GPU", 0.1, 100_000.0, cl.node.intra.bandwidth_GBps, key="nvlink")
            changes += [
                ("node.gpus", domain, cl.node.gpus),
                ("node.intra.bandwidth_GBps", nvlink, cl.node.intra.bandwidth_GBps),
            ]
        tiers = cl.fabric.tiers
        if tiers:
            c1, c2 = st.columns(2)
            nic = c1.number_input("NIC GB/s per GPU", 0.1, 10_000.0, float(tiers[0].bandwidth_GBps), key="nic")
            changes.append(("fabric.tiers.*.bandwidth_GBps", nic, tiers[0].bandwidth_GBps))
            if len(tiers) > 1:  # the leaf's uplinks and above: where a fat tree is tapered
                was = max(t.oversubscription for t in tiers[1:])
                oversub = c2.number_input("over-subscription above the leaf", 1.0, 64.0, float(was), key="oversub")
                if oversub != was:
                    out += [f"cluster.fabric.tiers.{i}.oversubscription={oversub}" for i in range(1, len(tiers))]
        c1, c2, c3 = st.columns(3)
        changes += [
            ("nodes", c1.number_input("nodes", 1, 10_000_000, int(cl.nodes), key="nodes"), cl.nodes),
            ("failures.rate_scale", c2.number_input("failure-rate ×", 0.0, 100.0, 1.0, 0.25, key="rate_scale"), 1.0),
            (
                "economics.usd_per_gpu_hour",
                c3.number_input("USD / GPU-hour", 0.01, 100.0, float(cl.economics.usd_per_gpu_hour), key="price"),
                cl.economics.usd_per_gpu_hour,
            ),
        ]
        out += [f"cluster.{field}={value}" for field, value, was in changes if value != was]
    return out


def recovery_what_ifs(sb: Any, reliability: dict[str, Any]) -> list[str]:
    """Hot spares and the time a restart takes."""
    out = []
    with sb.expander("recovery what-ifs"):
        spares = st.number_input("hot spare nodes", 0, 100_000, int(reliability.get("hot_spares", 0)), key="spares")
        was = float(reliability.get("restart_min", 10.0))
        restart = st.number_input("restart minutes", 0.1, 1440.0, was, key="restart")
        if spares != reliability.get("hot_spares", 0):
            out.append(f"reliability.hot_spares={spares}")
        if restart != was:
            out.append(f"reliability.restart_min={restart}")
    return out
