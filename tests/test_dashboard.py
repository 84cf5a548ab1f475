"""The dashboard (app.py) under Streamlit's own test runner: every preset renders, a widget change shows what the
API predicts for the changed plan, a bad layout shows the loader's line, search and compare run; and its figures
(twin/dashboard/figures.py) without Streamlit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from plan import loader
from twin import api
from twin.dashboard import figures

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def _app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    return at


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _open(at: AppTest, page: str) -> AppTest:
    """Open a tab, as a click on it does (only the open tab computes)."""
    at.session_state["page"] = page
    return at.run()


@pytest.mark.parametrize("preset", loader.plan_presets())
def test_every_preset_renders_its_headline(preset: str) -> None:
    at = _app()
    at.selectbox(key="preset").set_value(preset).run()
    assert not at.exception, [e.value for e in at.exception]
    shown = _metrics(at)
    pred = api.predict(preset)
    assert shown["step time"] == f"{pred.step_time_s:.3f} s"
    assert {"MFU / HFU", "days to train", "memory per GPU"} <= set(shown)
    _open(at, "Run")
    assert not at.exception, [e.value for e in at.exception]
    assert {"goodput", "wall days"} <= set(_metrics(at))


def test_a_widget_change_shows_the_apis_prediction_for_the_changed_plan() -> None:
    at = _app()
    at.selectbox(key="preset").set_value("gpt3-175b-1k").run()
    at.selectbox(key="tp").set_value(4).run()
    at.number_input(key="dp").set_value(32).run()
    at.selectbox(key="zero").set_value(1).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    expected = api.predict(api.load_plan("gpt3-175b-1k", ["layout.tp=4", "layout.dp=32", "layout.zero=1"]))
    assert _metrics(at)["step time"] == f"{expected.step_time_s:.3f} s"


def test_an_invalid_layout_shows_the_loaders_line_and_no_traceback() -> None:
    at = _app()
    at.selectbox(key="preset").set_value("gpt3-175b-1k").run()
    at.number_input(key="dp").set_value(7).run()  # 1536 sequences do not split over 7 replicas
    assert not at.exception
    assert any("global_batch" in e.value and "multiple of dp" in e.value for e in at.error)
    assert "step time" not in _metrics(at)


def test_search_and_compare_run_on_a_small_case() -> None:
    at = _app()
    at.selectbox(key="preset").set_value("gpt-1b-h100").run()
    _open(at, "Search")
    at.button(key="search").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.dataframe and any(len(d.value) >= 1 for d in at.dataframe)
    _open(at, "Compare")
    at.button(key="add").click().run()
    at.text_input(key="scenario_name").set_value("zero 1").run()
    at.selectbox(key="zero").set_value(1).run()
    assert not at.error, [e.value for e in at.error]
    at.button(key="add").click().run()
    assert not at.exception
    compared = [d.value for d in at.dataframe if "scenario" in d.value.columns]
    assert compared and len(compared[-1]) == 2


def test_fleets_compare_the_sidebars_model_on_each_fleet_at_its_best_layout() -> None:
    at = _app()
    at.selectbox(key="preset").set_value("gpt-1b-h100").run()
    _open(at, "Fleets")
    at.multiselect(key="fleets").set_value(["dgx-h100-superpod", "dgx-a100-superpod"]).run()
    at.number_input(key="fleet_gpus").set_value(16).run()
    at.button(key="compare_fleets").click().run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    shown = next(d.value for d in at.dataframe if "fleet" in d.value.columns)
    assert list(shown["fleet"]) == ["dgx-h100-superpod", "dgx-a100-superpod"]  # the faster fleet first
    assert (shown["GPUs"] == 16).all() and (shown["MFU"] > 0).all()


def test_fleet_figures_follow_the_comparison() -> None:
    fleets = ["dgx-h100-superpod", "dgx-a100-superpod", "no-such"]
    pins = ["layout.cp=1", "layout.microbatch_size=1"]
    frame = api.compare_fleets("llama3-8b", fleets, gpus=16, batch_tokens=2**20, fixes=pins, workers=1)
    table = figures.fleet_table(frame)
    assert list(table["fleet"])[-1] == "no-such" and "unknown cluster" in table["why it cannot run"].iloc[-1]
    for name in ("dgx-h100-superpod", "dgx-a100-superpod"):  # each fleet quotes its own accelerator's record
        found = api.published_fidelity(frame.attrs["plans"][name]).found
        shown = table.set_index("fleet").loc[name]
        assert found is not None and shown["published runs checked"] == found.rows > 0
        assert shown["their mean error"] == pytest.approx(found.mean_abs_error)
    bars = figures.fleet_bars(frame)
    assert {b.name for b in bars.data} == {label for _, label in figures.FLEET_FIGURES}
    for bar in bars.data:  # each figure against the best fleet: the best is 1, the other at least 1
        assert list(bar.x) == ["dgx-h100-superpod", "dgx-a100-superpod"] and min(bar.y) == pytest.approx(1.0)


def test_figures_follow_the_numbers() -> None:
    plan = api.load_plan("gpt3-175b-1k")
    pred = api.predict(plan)
    bar = figures.breakdown_bar(pred)
    assert sum(t.x[0] for t in bar.data) == pytest.approx(sum(v for v in pred.breakdown_s.values() if v > 0))
    ranks = api.memory_by_rank(plan)
    assert max(r.peak for r in ranks) == pytest.approx(pred.memory.peak)
    mem = figures.memory_bars(ranks)
    totals = [sum(t.y[i] for t in mem.data) for i in range(len(ranks))]
    assert totals == pytest.approx([r.peak for r in ranks])
    table = figures.collectives_table(pred)
    assert set(table["axis"]) == set(pred.collectives)


@pytest.fixture
def browser() -> Iterator[tuple[Any, str]]:
    """`streamlit run app.py` on loopback and a headless Chromium (Debian's chromium and chromium-driver) driving
    it: (driver, url)."""
    import shutil
    import subprocess
    import sys
    import time
    import urllib.request

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from twin.cli.launch import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", APP, "--server.headless", "true", "--server.address", "127.0.0.1",
         "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1600,1400"):
        options.add_argument(arg)
    driver = None
    try:
        for _ in range(120):
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=1).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.5)
        driver = webdriver.Chrome(service=webdriver.ChromeService(chromedriver), options=options)
        yield driver, url
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)


def _tab(driver: Any, name: str) -> None:
    from selenium.webdriver.common.by import By

    next(t for t in driver.find_elements(By.CSS_SELECTOR, "[role=tab]") if t.text == name).click()


def _text(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.TAG_NAME, "body").text)


@pytest.mark.slow
def test_every_page_in_a_real_browser(browser: tuple[Any, str], tmp_path: Path) -> None:
    """Each tab opened in headless Chromium, a screenshot per page under the test's output, the headline shown and
    no error text."""
    import time

    from selenium.webdriver.support.ui import WebDriverWait

    driver, url = browser
    driver.get(url)
    pages = {"Step": "MFU / HFU", "Run": "goodput", "Search": "objective", "Compare": "scenario name",
             "Fleets": "compare fleets", "Calibrate": "calibrated profile"}  # fmt: skip
    WebDriverWait(driver, 120).until(lambda d: "step time" in _text(d))
    for name, shows in pages.items():
        _tab(driver, name)
        try:
            WebDriverWait(driver, 60).until(lambda d, shows=shows: shows in _text(d))
        finally:
            time.sleep(1)  # let the tab's charts draw
            driver.save_screenshot(str(tmp_path / f"{name.lower()}.png"))
        text = _text(driver)
        assert "Traceback" not in text and "Error" not in text, (name, text[:500])
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "calibrate.png",
        "compare.png",
        "fleets.png",
        "run.png",
        "search.png",
        "step.png",
    ]


@pytest.mark.slow
def test_a_click_on_the_pareto_front_loads_that_layout(browser: tuple[Any, str], tmp_path: Path) -> None:
    """Search cpu-tiny's layouts in the browser, click a point of the Pareto scatter: the sidebar's layout becomes
    that point's (a browser sends back what its widgets show, which AppTest does not: only a browser sees this)."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver, url = browser
    driver.get(f"{url}/?plan=cpu-tiny")
    WebDriverWait(driver, 120).until(lambda d: "step time" in _text(d))
    _tab(driver, "Search")

    def click_search(d: Any) -> bool:  # the page may still be re-rendering the tab: its button can go stale
        button = next((b for b in d.find_elements(By.TAG_NAME, "button") if b.text == "search"), None)
        if button is not None:
            button.click()
        return button is not None

    WebDriverWait(driver, 60, ignored_exceptions=(StaleElementReferenceException,)).until(click_search)
    WebDriverWait(driver, 120).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".scatterlayer .point"))

    def shown() -> tuple[str | None, ...]:  # the sidebar's pp and dp
        return tuple(
            driver.find_element(By.CSS_SELECTOR, f"input[aria-label='{axis}']").get_attribute("value")
            for axis in ("pp", "dp")
        )

    before = shown()
    points = driver.find_elements(By.CSS_SELECTOR, ".scatterlayer .point")
    driver.save_screenshot(str(tmp_path / "search-result.png"))
    for point in points[:8]:  # the first point whose layout differs from the plan's in pp or dp
        ActionChains(driver).move_to_element(point).pause(0.5).click().perform()
        try:
            WebDriverWait(driver, 10).until(lambda d: shown() != before)
            break
        except TimeoutException:  # a point of the same pp and dp: try the next
            continue
    else:
        pytest.fail(f"no click on the first 8 of {len(points)} Pareto points changed the sidebar's pp, dp {before}")
    driver.save_screenshot(str(tmp_path / "loaded.png"))
    assert "Traceback" not in _text(driver)


def test_a_model_of_ones_own_on_a_catalogue_cluster() -> None:
    at = _app()
    at.radio(key="start").set_value("my model").run()
    at.selectbox(key="cluster").set_value("dgx-h100-superpod").run()
    at.number_input(key="m_layers").set_value(16).run()
    at.selectbox(key="tp").set_value(8).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert "step time" in _metrics(at)
    at.number_input(key="spares").set_value(2).run()
    assert not at.exception


def test_a_searched_layout_loads_as_the_plan() -> None:
    at = _app()
    at.selectbox(key="preset").set_value("gpt-1b-h100").run()
    _open(at, "Search")
    at.button(key="search").click().run()
    result = at.session_state["search_result"]
    best = result.top[0]
    at.selectbox(key="load_choice").set_value(best.label).run()
    at.button(key="load").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.selectbox(key="tp").value == best.shape.tp and at.number_input(key="dp").value == best.shape.dp
    _open(at, "Step")
    assert _metrics(at)["step time"] == f"{best.outcome.step_time_s:.3f} s"


def test_a_loop_report_opens_on_the_calibrate_page(tmp_path: Path) -> None:
    from twin.calibrate.fit import PHASE_GROUPS
    from twin.calibrate.report import Row, read_rows, write_report

    phases = dict.fromkeys(PHASE_GROUPS, 0.1)
    rows = [
        Row(f"plan{i}", "fit" if i else "held out", 1.0 + i, 0.05, 2, 0.5 + i, 1.02 + i, 0.9 + i, 1.1 + i,
            phases, phases)
        for i in range(3)
    ]  # fmt: skip
    write_report(tmp_path, rows, "a loop", [])
    assert read_rows(tmp_path) == rows
    at = _app()
    _open(at, "Calibrate")
    at.text_input(key="loop_dir").set_value(str(tmp_path)).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert len(at.get("plotly_chart")) == 2
    at.text_input(key="loop_dir").set_value(str(tmp_path / "nothing")).run()
    assert any("no rows.json" in e.value for e in at.error)


def test_cluster_what_ifs_show_the_apis_prediction_for_the_changed_cluster() -> None:
    # another chip, a bigger NVLink domain and a tapered fabric: the step shown is the API's for the same what-ifs
    at = _app()
    at.selectbox(key="preset").set_value("gpt3-175b-1k").run()
    at.selectbox(key="accelerator").set_value("h100-sxm5-80gb").run()
    at.number_input(key="domain").set_value(16).run()
    at.number_input(key="oversub").set_value(2.0).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    changed = ["cluster.accelerator=h100-sxm5-80gb", "cluster.node.gpus=16"]
    changed.append("cluster.fabric.tiers.1.oversubscription=2.0")  # the spine (its leaf is tier 0)
    expected = api.predict(api.load_plan("gpt3-175b-1k", changed))
    assert _metrics(at)["step time"] == f"{expected.step_time_s:.3f} s"
    assert expected.step_time_s < 0.6 * api.predict("gpt3-175b-1k").step_time_s  # H100s in place of A100s


def test_layout_widgets_offer_only_valid_degrees() -> None:
    # ep splits DeepSeek's 256 experts evenly; cp cuts its 4,096-token sequence into 2·cp equal chunks
    at = _app()
    at.selectbox(key="preset").set_value("deepseek-v3-2k").run()
    assert at.selectbox(key="ep").options == [str(2**i) for i in range(9)]
    assert at.selectbox(key="cp").options == [str(2**i) for i in range(7)]
    assert at.selectbox(key="ep").value == api.load_plan("deepseek-v3-2k").layout.ep


def test_folding_the_experts_lets_ep_exceed_dp() -> None:
    # DeepSeek-V3 at TP2 with EP64 over 32 replicas: the loader refuses it until the experts fold over tp and dp
    at = _app()
    at.selectbox(key="preset").set_value("deepseek-v3-2k").run()
    assert at.checkbox(key="fold").disabled  # tp 1: nothing to fold over
    at.selectbox(key="tp").set_value(2).run()
    at.number_input(key="dp").set_value(32).run()
    assert any("set expert_tp" in e.value for e in at.error)
    at.checkbox(key="fold").check().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    changed = ["layout.tp=2", "layout.dp=32", "layout.expert_tp=1"]
    expected = api.predict(api.load_plan("deepseek-v3-2k", changed))
    assert _metrics(at)["step time"] == f"{expected.step_time_s:.3f} s"
