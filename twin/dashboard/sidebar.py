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


def cluster_what_ifs(sb: Any, cluster_name: str, fresh: bool) -> list[str]:
    """The cluster's chip, NVLink domain, link speeds, over-subscription, size, failure rates and price; `fresh`:
    the widgets start again from the cluster's own values (a new base plan)."""
    cl = api.load_cluster(cluster_name)
    tiers = cl.fabric.tiers
    was = {
        "accelerator": AS_IN_FILE,
        "domain": int(cl.node.gpus),
        "nvlink": float(cl.node.intra.bandwidth_GBps),
        "nic": float(tiers[0].bandwidth_GBps) if tiers else 0.0,
        "oversub": float(max((t.oversubscription for t in tiers[1:]), default=1.0)),
        "nodes": int(cl.nodes),
        "rate_scale": 1.0,
        "price": float(cl.economics.usd_per_gpu_hour),
    }
    _start(was, fresh)
    with sb.expander("cluster what-ifs"):
        st.selectbox(f"accelerator (now {cl.accelerator.name})", [AS_IN_FILE, *accelerator_names()], key="accelerator")
        if not cl.fabric.torus:  # a torus fixes its chips per node by its dimensions
            c1, c2 = st.columns(2)
            c1.number_input("GPUs per NVLink domain", 1, 1024, key="domain")
            c2.number_input("NVLink GB/s per GPU", 0.1, 100_000.0, key="nvlink")
        if tiers:
            c1, c2 = st.columns(2)
            c1.number_input("NIC GB/s per GPU", 0.1, 10_000.0, key="nic")
            if len(tiers) > 1:  # the leaf's uplinks and above: where a fat tree is tapered
                c2.number_input("over-subscription above the leaf", 1.0, 64.0, key="oversub")
        c1, c2, c3 = st.columns(3)
        c1.number_input("nodes", 1, 10_000_000, key="nodes")
        c2.number_input("failure-rate ×", 0.0, 100.0, step=0.25, key="rate_scale")
        c3.number_input("USD / GPU-hour", 0.01, 100.0, key="price")
    fields = {
        "accelerator": ["accelerator"],
        "domain": ["node.gpus"],
        "nvlink": ["node.intra.bandwidth_GBps"],
        "nic": ["fabric.tiers.*.bandwidth_GBps"],
        "oversub": [f"fabric.tiers.{i}.oversubscription" for i in range(1, len(tiers))],
        "nodes": ["nodes"],
        "rate_scale": ["failures.rate_scale"],
        "price": ["economics.usd_per_gpu_hour"],
    }
    moved = {key: st.session_state[key] for key in was if st.session_state[key] != was[key]}
    return [f"cluster.{field}={value}" for key, value in moved.items() for field in fields[key]]


def recovery_what_ifs(sb: Any, reliability: dict[str, Any], fresh: bool) -> list[str]:
    """Hot spares and the time a restart takes."""
    was = {"spares": int(reliability.get("hot_spares", 0)), "restart": float(reliability.get("restart_min", 10.0))}
    _start(was, fresh)
    with sb.expander("recovery what-ifs"):
        st.number_input("hot spare nodes", 0, 100_000, key="spares")
        st.number_input("restart minutes", 0.1, 1440.0, key="restart")
    fields = {"spares": "reliability.hot_spares", "restart": "reliability.restart_min"}
    return [f"{fields[k]}={st.session_state[k]}" for k in was if st.session_state[k] != was[k]]


def _start(values: dict[str, Any], fresh: bool) -> None:
    """Widget values in session state, which the widgets then show: reset for a new base plan, else kept (a browser
    sends back what its widgets show, so a cleared key would not reset them)."""
    for key, value in values.items():
        if fresh or key not in st.session_state:
            st.session_state[key] = value
