"""ClusterTwin's what-if dashboard: `streamlit run app.py` (127.0.0.1 by .streamlit/config.toml).

UI only: every number comes from the Python API (twin/api.py), every figure from twin/dashboard/figures.py. The
sidebar holds the plan — a preset, a catalogue model or one's own, on a cluster changed by what-ifs, laid out
with widgets that offer valid values — and the tabs show what follows: the step, the whole run, the layout search,
scenarios side by side, the same model on other fleets and calibrated profiles.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import streamlit as st
import yaml

from plan import loader
from plan.errors import PlanError
from twin import api, fit
from twin.calibrate.report import phase_figure, read_rows, step_figure
from twin.dashboard import figures, sidebar
from twin.step.predict import PredictOptions, StepPrediction

st.set_page_config(page_title="ClusterTwin", layout="wide")


@st.cache_data(show_spinner=False, max_entries=64)
def predicted(plan_json: str, timeline: bool = False) -> StepPrediction:
    """One step of the resolved plan (cached on its JSON: a what-if back to a plan seen before is instant)."""
    return api.predict(json.loads(plan_json), PredictOptions(every_microbatch=timeline))


@st.cache_data(show_spinner=False, max_entries=16)
def runs_of(plan_json: str, seeds: int) -> Any:
    return api.simulate_runs(json.loads(plan_json), seeds)


@st.cache_data(show_spinner=False, max_entries=8)
def sweep_of(plan_json: str, seeds: int) -> Any:
    return api.sweep_checkpoint(json.loads(plan_json), seeds)


def divisors(n: int, most: int = 64) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def _with(options: list[int], key: str) -> list[int]:
    """A widget's valid options, and the plan's own value first where it is not one of them (shown, then judged)."""
    value = st.session_state[key]
    return options if value in options else [value, *options]


def start_values(layout: dict[str, Any], batch: int) -> dict[str, Any]:
    """The layout widgets' values for a plan: what they show until the user moves them."""
    return {
        "tp": int(layout.get("tp", 1)),
        "pp": int(layout.get("pp", 1)),
        "dp": int(layout.get("dp", 1)),
        "cp": int(layout.get("cp", 1)),
        "ep": int(layout.get("ep", 1)),
        "mbs": int(layout.get("microbatch_size", 1)),
        "schedule": layout.get("schedule", "1f1b"),
        "v": max(2, int(layout.get("virtual_stages", 1))),
        "zero": int(layout.get("zero", 0)),
        "recompute": layout.get("recompute", "none"),
        "sp": bool(layout.get("sequence_parallel", False)),
        "fold": layout.get("expert_tp") == 1,
        "batch": batch,
    }


def choose_plan() -> tuple[dict[str, Any] | None, str]:
    """The sidebar: a base plan and its what-ifs; returns the plan data (None if invalid) and its source label."""
    sb = st.sidebar
    sb.title("Plan")
    query = st.query_params.get("plan")
    presets = loader.plan_presets()
    start = sb.radio("start from", ["preset", "model", "my model", "upload"], horizontal=True, key="start")
    overrides: list[str] = []
    if start == "upload":
        upload = sb.file_uploader("plan YAML", type=["yaml", "yml"])
        if upload is None:
            sb.info("Upload a plan file, or start from a preset.")
            return None, ""
        base = yaml.safe_load(upload.getvalue().decode("utf-8", errors="replace"))
        label = upload.name
    elif start in ("model", "my model"):
        if start == "model":
            model: Any = sb.selectbox("model", loader.model_presets(), key="model")
        else:
            model = sidebar.own_model(sb)
        cluster = sb.selectbox("cluster", loader.cluster_names(), key="cluster")
        label = model if isinstance(model, str) else "my-model"
        base = {
            "schema_version": 1,
            "name": f"{label}-what-if",
            "model": model,
            "cluster": cluster,
            "layout": {"dp": 1},
            "training": {"global_batch": 8, "tokens": 1.0e12},
        }
    else:
        default = presets.index(query) if query in presets else presets.index("llama3-405b-16k")
        name = sb.selectbox("preset", presets, index=default, key="preset")
        base, _ = loader.plan_data(name)
        label = name
    base = loader.expand_model(dict(base), label)
    model, layout = base["model"], dict(base.get("layout") or {})
    fresh = st.session_state.get("_base") != label  # a new base plan: its own values, not the last plan's
    st.session_state["_base"] = label
    loaded = st.session_state.pop("load_layout", None)
    if loaded:  # a layout picked in the search
        base["layout"] = layout = {**layout, **loaded["layout"], "stage_layers": None}
        base["training"] = {**base["training"], "global_batch": loaded["global_batch"]}
    if fresh or loaded:
        # set, not cleared: a browser sends back what its widgets show, which would outlive a cleared key
        st.session_state.update(start_values(layout, int(base["training"]["global_batch"])))

    cluster = base["cluster"] if isinstance(base["cluster"], str) else base["cluster"]["name"]
    overrides += sidebar.cluster_what_ifs(sb, cluster, fresh)
    overrides += sidebar.recovery_what_ifs(sb, dict(base.get("reliability") or {}), fresh)

    sb.subheader("layout")
    heads = int(model["heads"])
    c1, c2, c3 = sb.columns(3)
    tps = divisors(heads)
    tp = c1.selectbox("tp", _with(tps, "tp"), key="tp")
    pp = c2.number_input("pp", 1, int(model["layers"]), key="pp")
    dp = c3.number_input("dp", 1, 1_000_000, key="dp")
    c4, c5, c6 = sb.columns(3)
    cps = [c for c in range(1, 65) if int(model["seq_len"]) % (2 * c) == 0 or c == 1]  # 2·cp chunks of the sequence
    cp = c4.selectbox("cp", _with(cps, "cp"), key="cp")
    eps = divisors(int(model.get("experts") or 1), 1024)  # experts split evenly over the ep ranks
    ep = c5.selectbox("ep", _with(eps, "ep"), key="ep")
    mbs = c6.number_input("micro-batch", 1, 64, key="mbs")
    schedule = sb.selectbox(
        "schedule", ["1f1b", "interleaved-1f1b", "gpipe", "zb-h1", "zbv", "dualpipe-v"], key="schedule"
    )
    if schedule == "interleaved-1f1b":
        v = sb.number_input("virtual stages", 2, 64, key="v")
    else:
        v = 2 if schedule in ("zbv", "dualpipe-v") else 1  # the only value these schedules take
    c7, c8 = sb.columns(2)
    zero = c7.selectbox("ZeRO", [0, 1, 2, 3], key="zero")
    recompute = c8.selectbox("recompute", ["none", "selective", "full"], key="recompute")
    sp = sb.checkbox("sequence parallel", key="sp", disabled=tp == 1)
    moe_tp = bool(model.get("experts")) and tp > 1  # Megatron-Core's folding: ep over tp·cp·dp, whole experts
    fold = sb.checkbox("whole experts, ep over tp·cp·dp (expert TP 1)", key="fold", disabled=not moe_tp)
    batch = sb.number_input("global batch (sequences)", 1, 10_000_000, key="batch")
    chosen = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "ep": ep,
        "microbatch_size": mbs,
        "schedule": schedule,
        "virtual_stages": v,
        "zero": zero,
        "recompute": recompute,
        "sequence_parallel": sp and tp > 1,
        "expert_tp": 1 if fold and moe_tp else None,
    }
    if pp != layout.get("pp", 1) or v != layout.get("virtual_stages", 1):
        overrides.append("layout.stage_layers=null")
    overrides += [f"layout.{k}={json.dumps(val)}" for k, val in chosen.items() if layout.get(k) != val]
    if batch != base["training"]["global_batch"]:
        overrides.append(f"training.global_batch={batch}")
    check = api.validate(base, overrides, allow_oom=True)  # a plan over memory is shown, with the verdict
    if not check.ok:
        sb.error(check.reasons[0])
        return None, label
    assert check.plan is not None
    if not check.facts["fits"]:
        sb.warning(fit.oom_message(check.plan, api.cluster_of(check.plan), api.memory(check.plan), allow_hint=False))
    data = check.plan.model_dump(mode="json")
    sb.download_button("download plan YAML", yaml.safe_dump(data, sort_keys=False), f"{check.plan.name}.yaml")
    return data, label


def step_tab(data: dict[str, Any]) -> None:
    plan_json = json.dumps(data, sort_keys=True)
    pred = predicted(plan_json)
    price = api.cluster_of(data).economics.usd_per_gpu_hour
    cols = st.columns(3) + st.columns(3)
    for col, (name, value) in zip(cols, figures.headline(pred, price).items(), strict=True):
        col.metric(name, value)
    if not pred.fits:
        st.warning(pred.memory.reason)
    st.caption(f"Checked on: {api.published_fidelity(data).line}")
    left, right = st.columns(2)
    left.subheader("where the step goes")
    left.plotly_chart(figures.breakdown_bar(pred), width="stretch")
    right.subheader("memory per GPU by pipeline rank")
    right.plotly_chart(figures.memory_bars(api.memory_by_rank(data)), width="stretch")
    st.subheader("one step, every pipeline rank")
    if pred.num_microbatches * data["layout"]["pp"] * data["layout"]["virtual_stages"] <= 20_000:
        st.plotly_chart(figures.timeline_gantt(predicted(plan_json, timeline=True)), width="stretch")
    else:
        st.info("The step has too many actions to draw; `twin predict --trace` writes it for Perfetto.")
    st.subheader("collectives")
    st.dataframe(figures.collectives_table(pred), hide_index=True)


def run_tab(data: dict[str, Any]) -> None:
    seeds = st.slider("seeds", 1, 20, 3, key="seeds")
    try:
        summary = runs_of(json.dumps(data, sort_keys=True), seeds)
    except PlanError as exc:
        st.error(str(exc))
        return
    stats = summary.stats
    cols = st.columns(4)
    for col, (key, label, fmt) in zip(
        cols,
        (
            ("goodput", "goodput", "{:.1%}"),
            ("wall_days", "wall days", "{:,.1f}"),
            ("cost_usd", "cost ($M)", "{:,.2f}"),
            ("mtbf_hours", "MTBF (h)", "{:,.1f}"),
        ),
        strict=True,
    ):
        s = stats[key]
        scale = 1e-6 if key == "cost_usd" else 1.0
        col.metric(
            label,
            fmt.format(s["mean"] * scale),
            help=f"5th-95th percentile: {fmt.format(s['p5'] * scale)} - {fmt.format(s['p95'] * scale)}",
        )
    left, right = st.columns(2)
    left.subheader("where the lost time goes")
    left.plotly_chart(figures.lost_time_bar(summary.runs), width="stretch")
    right.subheader(f"interruptions of seed {summary.runs[0].seed}")
    right.plotly_chart(figures.failure_timeline(summary.runs[0]), width="stretch")
    if st.button("sweep the checkpoint interval", key="sweep"):
        with st.spinner("simulating 13 intervals"):
            try:
                st.plotly_chart(figures.checkpoint_sweep(sweep_of(json.dumps(data, sort_keys=True), 2)))
            except PlanError as exc:
                st.error(str(exc))


def search_tab(data: dict[str, Any]) -> None:
    c1, c2, c3, c4 = st.columns(4)
    gpus = c1.number_input(
        "at most GPUs",
        1,
        10_000_000,
        int(data["layout"]["dp"] * data["layout"]["tp"] * data["layout"]["pp"] * data["layout"]["cp"]),
    )
    tokens = c2.number_input(
        "batch tokens", 1, 10**10, int(data["training"]["global_batch"] * data["model"]["seq_len"])
    )
    objective = c3.selectbox("objective", ["time", "cost", "mfu", "goodput-time"])
    top = c4.number_input("top", 1, 20, 5)
    if st.button("search", key="search"):
        st.session_state["search_result"] = run_search(data, int(gpus), float(tokens), objective, int(top))
    result = st.session_state.get("search_result")
    if result is None:
        return
    st.dataframe(figures.candidates_table(result.top), hide_index=True)
    picked = st.plotly_chart(
        figures.pareto_scatter(result), width="stretch", on_select="rerun", selection_mode="points", key="pareto"
    )
    points = picked.selection.points if picked else []
    clicked = points[0].get("customdata") if points else None
    clicked = clicked[0] if isinstance(clicked, list) else clicked
    if clicked == st.session_state.get("loaded_point"):
        clicked = None  # the selection that was loaded last time stays selected: load it once
    labels = [c.label for c in result.top]
    choice = st.selectbox("a top layout", labels, key="load_choice")
    if clicked is not None or st.button("load it as the plan", key="load"):
        st.session_state["loaded_point"] = clicked
        cand = result.simulated[int(clicked)] if clicked is not None else result.top[labels.index(choice)]
        st.session_state["load_layout"] = {
            "layout": cand.plan.layout.model_dump(mode="json"),
            "global_batch": cand.plan.training.global_batch,
        }
        st.rerun()


def run_search(data: dict[str, Any], gpus: int, tokens: float, objective: str, top: int) -> Any:
    """`api.search` on the sidebar's plan with a live line of progress; None (and the reason shown) if it fails."""
    with st.status("searching layouts", expanded=True) as status:
        line = st.empty()
        try:
            result = api.search(
                data,
                gpus=gpus,
                batch_tokens=tokens,
                objective=objective,
                top=top,
                progress=lambda t: line.write(f"{t.shapes:,} layouts, {t.pruned:,} pruned, {t.simulated:,} simulated"),
            )
        except PlanError as exc:
            status.update(label="search failed", state="error")
            st.error(str(exc))
            return None
        status.update(label=f"{result.tally.simulated} layouts simulated", state="complete")
    return result


def compare_tab(data: dict[str, Any]) -> None:
    scenarios: dict[str, dict[str, Any]] = st.session_state.setdefault("scenarios", {})
    name = st.text_input("scenario name", data["name"], key="scenario_name")
    a, b = st.columns(2)
    if a.button("add this plan", key="add") and len(scenarios) < 4:
        scenarios[name] = data
    if b.button("clear", key="clear"):
        scenarios.clear()
    if not scenarios:
        st.info("Add two to four plans (change the sidebar between them) to see them side by side.")
        return
    preds = {n: predicted(json.dumps(d, sort_keys=True)) for n, d in scenarios.items()}
    st.dataframe(figures.compare_table(preds), hide_index=True)
    st.plotly_chart(figures.compare_bars(preds), width="stretch")


@st.cache_data(show_spinner=False, max_entries=16)
def fleets_of(plan_json: str, clusters: tuple[str, ...], gpus: int) -> Any:
    """The sidebar's model, batch and policy on each fleet at its best layout (cached: a search per fleet)."""
    return api.compare_fleets(json.loads(plan_json), list(clusters), gpus=gpus or None)


def fleets_tab(data: dict[str, Any]) -> None:
    names = [n for n in loader.cluster_names() if not n.startswith("calibrated/")]
    world = data["layout"]["dp"] * data["layout"]["tp"] * data["layout"]["pp"] * data["layout"]["cp"]
    picked = st.multiselect("fleets", names, default=[data["cluster"]["name"]], key="fleets")
    gpus = st.number_input("GPUs per fleet (0: the whole fleet)", 0, 10_000_000, int(world), key="fleet_gpus")
    if not picked or not st.button("compare fleets", key="compare_fleets"):
        st.caption("Each fleet runs this model and batch at its own best layout (a search per fleet), then the whole "
                   "run with its failures: days, cost, energy and goodput side by side.")  # fmt: skip
        return
    with st.spinner(f"searching {len(picked)} fleets"):
        frame = fleets_of(json.dumps(data, sort_keys=True), tuple(picked), int(gpus))
    st.dataframe(figures.fleet_table(frame), hide_index=True)
    st.plotly_chart(figures.fleet_bars(frame), width="stretch")


def calibrate_tab() -> None:
    profiles = [n for n in loader.cluster_names() if n.startswith("calibrated/")]
    cal = api.load_cluster(st.selectbox("calibrated profile", profiles)).calibration if profiles else None
    if cal is None:
        st.info("No calibrated profile with a calibration record yet: run `twin loop` or `twin calibrate`.")
    else:
        st.metric("residual RMS", f"{cal.residual_rms:.1%}", help=f"run-to-run spread {cal.step_cv:.1%}")
        knobs = [{"knob": p.path, "before": p.before, "fitted": p.value, "±1σ": p.std} for p in cal.parameters]
        st.dataframe(knobs, hide_index=True)
    report = st.text_input("a `twin loop` output directory", key="loop_dir")
    if not report:
        return
    out = Path(report).expanduser()
    if not (out / "rows.json").is_file():
        st.error(f"{out}: no rows.json here; give the --out directory of a `twin loop` run")
        return
    try:
        rows = read_rows(out)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        st.error(f"{out / 'rows.json'}: cannot be read ({exc}); run `twin loop` again to rewrite it")
        return
    st.subheader("predicted against measured, per layout (95% intervals of the calibrated profile)")
    st.plotly_chart(step_figure(rows), width="stretch")
    st.subheader("where each step went, measured and predicted")
    st.plotly_chart(phase_figure(rows), width="stretch")
    st.dataframe([r.to_json() for r in rows], hide_index=True)


PAGES = ("Step", "Run", "Search", "Compare", "Fleets", "Calibrate")


def main() -> None:
    data, label = choose_plan()
    st.title(f"ClusterTwin — {data['name'] if data else label or 'no plan'}")
    # only the open tab computes (a tab switch reruns): a what-if redraws what the planner is looking at
    tabs = dict(zip(PAGES, st.tabs(PAGES, key="page", on_change="rerun"), strict=True))
    page = st.session_state.get("page") or PAGES[0]
    with tabs[page]:
        if page == "Calibrate":
            calibrate_tab()
        elif data is None:
            st.info("Fix the plan in the sidebar: the line under the layout says what is wrong.")
        elif page == "Step":
            step_tab(data)
        elif page == "Run":
            run_tab(data)
        elif page == "Search":
            search_tab(data)
        elif page == "Fleets":
            fleets_tab(data)
        else:
            compare_tab(data)


main()
