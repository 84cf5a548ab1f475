"""The twin against published figures, row by row, with the error of each.

- nccl-tests all-reduce bus bandwidth on one 8xH100 / 8xA100 node (ring and NVLS).
- Llama 3 405B pre-training MFU (Dubey et al. 2024, Table 4).
- Megatron-LM's A100 weak-scaling table (Narayanan et al. 2021, Table 1), in the paper's own FLOP convention.
Each row says its kind: `validation` (the twin was not built from that figure) or `consistency` (a catalogue number
was derived from the same published figure, so agreement only shows the arithmetic is consistent).
Writes benchmarks/results/published_figures.json. Run: `python benchmarks/published_figures.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.published import LLAMA3_TABLE_4, NARAYANAN_TABLE_1, megatron_plan, megatron_tflops
from plan import loader
from plan.loader import load_cluster
from twin.step.collectives import InNetwork, collective_time
from twin.step.fabric import Fabric
from twin.step.predict import predict

NCCL = [  # (cluster, algorithm, published busbw GB/s, source, kind)
    # the H100 rows are consistency checks: its NVLink efficiencies were back-solved from NVIDIA's 370/480 GB/s
    ("dgx-h100-superpod", "ring", 367.6, "8xH200 16 GiB, NVLS off (stas00 ml-engineering)", "consistency"),
    ("dgx-h100-superpod", "nvls", 478.9, "Azure AI-benchmarking-guide, 8G", "consistency"),
    ("dgx-h100-superpod", "nvls", 479.7, "Voltage Park, 8 GiB", "consistency"),
    ("dgx-a100-superpod", "ring", 231.6, "Azure ND A100 v4, 8G", "validation"),
]


def nccl_rows() -> list[dict]:
    rows = []
    for name, algorithm, published, source, kind in NCCL:
        cluster = load_cluster(name)
        node = cluster.node
        net = InNetwork(nvls_link_Bps=node.intra.bandwidth_GBps * 1e9 * (node.nvls_efficiency or 0) or None)
        got = collective_time("all_reduce", 8 * 2**30, Fabric(cluster).span(list(range(8))), net, algorithm)
        rows.append(
            {
                "what": f"{name} all-reduce {algorithm} busbw GB/s",
                "published": published,
                "predicted": got.busbw_Bps / 1e9,
                "source": source,
                "kind": kind,
            }
        )
    return rows


def llama_rows() -> list[dict]:
    rows = []
    for row in LLAMA3_TABLE_4:
        plan = loader.load(
            "llama3-405b-16k", [f"layout.dp={row.dp}", f"training.global_batch={row.dp * row.batch_per_dp}"]
        )
        rows.append(
            {
                "what": f"Llama 3 405B on {row.gpus:,} H100: BF16 MFU",
                "published": row.mfu,
                "predicted": predict(plan).mfu,
                "source": "Dubey et al. 2024, Table 4",
                "kind": "validation",
            }
        )
    return rows


def megatron_rows() -> list[dict]:
    rows = []
    for row in NARAYANAN_TABLE_1:
        result = predict(megatron_plan(row))
        rows.append(
            {
                "what": f"GPT {row.params_b:g}B on {row.gpus:,} A100: TFLOP/s per GPU",
                "published": row.tflops,
                "predicted": megatron_tflops(row, result.step_time_s),
                "source": "Narayanan et al. 2021, Table 1",
                "kind": "validation",
            }
        )
    return rows


def main() -> None:
    rows = nccl_rows() + llama_rows() + megatron_rows()
    table = Table(title="twin against published figures")
    for col in ("figure", "kind", "published", "predicted", "error"):
        table.add_column(col, justify="left" if col in ("figure", "kind") else "right")
    for r in rows:
        r["error"] = (r["predicted"] - r["published"]) / r["published"]
        table.add_row(r["what"], r["kind"], f"{r['published']:g}", f"{r['predicted']:.3g}", f"{r['error']:+.1%}")
    Console(width=140).print(table)
    out = Path(__file__).parent / "results" / "published_figures.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
