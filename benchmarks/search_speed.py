"""How fast `twin search` is, and what it finds, on the issue's four questions; and what one prediction costs as the
batch grows (the steady-state extension, twin/step/steady.py).

Part 1: one `predict` of Narayanan et al. 2021's 1.7B, 146B and 1T rows, of GPT-3 175B at 1x-32x its batch, and of
GPT-3 175B under the zero-bubble schedules at 3,072 microbatches (pp 8 and 16), with the steady state extended
(default) and with every microbatch simulated; ratio to one `twin predict`.
Part 2: four searches, timed end to end in one process (worker processes: every core), with their tallies, top
layouts and the check the issue asks of each. Prints tables and writes benchmarks/results/search_speed.json.
Run: `python benchmarks/search_speed.py` (about two minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo root

from benchmarks.published import NARAYANAN_TABLE_1, narayanan_plan
from plan import loader
from twin import api
from twin.search import front
from twin.search.engine import Candidate
from twin.step.predict import PredictOptions, predict

OUT = Path(__file__).parent / "results" / "search_speed.json"
EVERY = PredictOptions(every_microbatch=True)


def timed(fn: Any, repeats: int = 3) -> tuple[float, Any]:
    best, value = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t0)
    return best, value


def prediction_cost(console: Console) -> list[dict[str, Any]]:
    rows = []
    rows_of = [r for r in NARAYANAN_TABLE_1 if r.params_b in (1.7, 145.6, 1008.0)]
    cases = [(f"Narayanan {r.params_b:g}B", narayanan_plan(r)) for r in rows_of]
    for scale in (1, 4, 32):
        batch = f"training.global_batch={1536 * scale}"
        cases.append((f"GPT-3 175B, batch x{scale}", loader.load("gpt3-175b-1k", [batch])))
    for pp in (8, 16):  # the zero-bubble schedules, whose events settle slowly, at 3,072 microbatches
        for schedule, v in (("zb-h1", 1), ("zbv", 2), ("dualpipe-v", 2)):
            sets = [f"layout.schedule={schedule}", f"layout.virtual_stages={v}", f"layout.pp={pp}", "layout.dp=1",
                    "training.global_batch=3072"]  # fmt: skip
            cases.append((f"GPT-3 175B {schedule} pp {pp}", loader.load("gpt3-175b-1k", sets)))
    table = Table(title="one prediction: steady state extended vs every microbatch simulated")
    for col in ("plan", "pp·v", "microbatches", "simulated", "extended (ms)", "every (ms)", "speed-up"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for name, plan in cases:
        t_ext, ext = timed(lambda p=plan: predict(p))
        t_all, full = timed(lambda p=plan: predict(p, options=EVERY), repeats=1)
        assert abs(ext.step_time_s / full.step_time_s - 1) < 1e-9, name
        row = {"plan": name, "stages": plan.layout.num_stages, "microbatches": plan.num_microbatches,
               "simulated": ext.microbatches_simulated, "extended_ms": t_ext * 1e3,
               "every_ms": t_all * 1e3}  # fmt: skip
        rows.append(row)
        table.add_row(name, str(row["stages"]), f"{row['microbatches']:,}", f"{row['simulated']:,}",
                      f"{row['extended_ms']:.0f}", f"{row['every_ms']:.0f}", f"{t_all / t_ext:.1f}x")  # fmt: skip
    console.print(table)
    return rows


def summary(c: Candidate) -> dict[str, Any]:
    return front.row(c, c.plan.model.seq_len)


def searches(console: Console) -> list[dict[str, Any]]:
    one_predict, _ = timed(lambda: api.predict("llama3-405b-16k"), repeats=1)
    reference = api.predict("reference-100k")
    cases: list[dict[str, Any]] = [
        {"question": "1T dense on the 100k-H100 reference fleet, batch 4M-64M tokens",
         "source": "reference-100k", "overrides": ["training.global_batch=512"], "gpus": 100_000,
         "batch": (4e6, 64e6)},
        {"question": "Llama 3 70B on 2,048 H100 (the README example's 8.4M-token batch)",
         "source": "llama3-70b", "cluster": "dgx-h100-superpod", "gpus": 2048, "batch": 1024 * 8192},
        {"question": "Llama 3 405B on 16,384 H100 at 16M tokens",
         "source": "llama3-405b-16k", "gpus": 16_384, "batch": 2048 * 8192},
        {"question": "DeepSeek-V3-like MoE on 2,048 H800",
         "source": "deepseek-v3-2k", "gpus": 2048, "batch": None},
    ]  # fmt: skip
    out = []
    for case in cases:
        t0 = time.perf_counter()
        result, notes = front.run(
            case["source"], case.get("cluster"), case.get("overrides", []), case["gpus"], case["batch"], top=5
        )
        elapsed = time.perf_counter() - t0
        given = result.given
        entry = {
            "question": case["question"], "seconds": elapsed, "ratio_to_one_predict": elapsed / one_predict,
            "tally": result.tally.__dict__, "assumed": list(notes), "top": [summary(c) for c in result.top],
            "given": summary(given) if isinstance(given, Candidate) else given,
        }  # fmt: skip
        if case["source"] == "reference-100k":
            entry["reference_preset"] = {"days_to_train": reference.days_to_train, "mfu": reference.mfu,
                                         "batch_tokens": api.load_plan("reference-100k").tokens_per_step}  # fmt: skip
        out.append(entry)
        table = Table(title=f"{case['question']}: {elapsed:.1f} s, {result.tally.simulated} simulated of "
                            f"{result.tally.shapes:,} layouts")  # fmt: skip
        for col in ("#", "layout", "GPUs", "batch", "step s", "MFU", "free GiB", "days"):
            table.add_column(col, justify="left" if col == "layout" else "right")
        for i, c in enumerate(result.top):
            o = c.outcome
            tokens = c.shape.global_batch * c.plan.model.seq_len
            table.add_row(str(i + 1), c.label, f"{c.shape.gpus:,}", f"{tokens / 1e6:.1f}M", f"{o.step_time_s:.2f}",
                          f"{o.mfu:.1%}", f"{c.headroom_GiB:.1f}", f"{o.days_to_train:.1f}")  # fmt: skip
        console.print(table)
        if isinstance(given, Candidate):
            gap = given.objective / result.top[0].objective - 1
            console.print(
                f"  the plan as given: {given.label}, MFU {given.outcome.mfu:.1%}, {gap:+.1%} days against the best"
            )
        elif given:
            console.print(f"  the plan as given cannot run: {given}")
        if "reference_preset" in entry:
            ref = entry["reference_preset"]
            days, tokens = ref["days_to_train"], ref["batch_tokens"] / 1e6
            console.print(f"  reference-100k preset: {days:.1f} days at {tokens:.0f}M tokens, MFU {ref['mfu']:.1%}")
    return out


def main() -> int:
    console = Console(width=140)
    data = {"cpu_count": os.cpu_count(), "prediction": prediction_cost(console), "searches": searches(console)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1, default=str))
    console.print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
