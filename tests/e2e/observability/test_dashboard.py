"""The live dashboard in a real browser: Debian's headless Chromium, driven by Selenium through Debian's
chromedriver (never a downloaded one), against the observed toy system (``conftest.observed``).

It loads ``/dashboard`` on a recent ``code`` group, waits for a poll to be drawn, reads every chart's traces
from the plotly graph divs (``gd.data``), checks the tables and the group's timeline, and saves a screenshot
(the test's tmp dir, copied to :data:`SCREENSHOT`).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import httpx
import pytest

from scheduler_service.routes.dashboard import CACHE_S
from tests.e2e.observability.conftest import MIN_VERSION

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOT = Path("/tmp/flywheel-dashboard.png")
CHARTS = ("chart-reward", "chart-pass", "chart-length", "chart-diversity", "chart-eval", "chart-staleness",
          "chart-throughput", "chart-spend", "chart-trace")
DOMAINS = {"toy", "code"}

_TRACES_JS = """
return arguments[0].map((id) => {
  const gd = document.getElementById(id);
  return [id, (gd && gd.data ? gd.data : []).map((t) => [t.name, (t.x || []).length, (t.y || []).length])];
});
"""


@pytest.fixture
def browser(monkeypatch):
    """A headless Chromium session (closed after the test); Selenium Manager is made to fail if it ever runs."""
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is missing (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.selenium_manager import SeleniumManager

    def no_manager(*_a, **_k):
        raise AssertionError("Selenium Manager ran (it would download a driver)")

    monkeypatch.setattr(SeleniumManager, "binary_paths", no_manager)
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1200"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _code_group(url: str) -> tuple[str, dict]:
    """A recent code group whose trace reached the most services, and its timeline from the REST API."""
    deadline = time.monotonic() + 60
    while True:
        groups = httpx.get(f"{url}/v1/dashboard/data", timeout=30).json()["traces"]["groups"]
        code = sorted((g for g in groups if g["domain"] == "code"), key=lambda g: -len(g["services"]))
        if code and len(code[0]["services"]) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert code, f"no code group among the span store's recent groups: {groups}"
    gid = code[0]["group_id"]
    return gid, httpx.get(f"{url}/v1/dashboard/trace/{gid}", timeout=30).json()


def _time_data_call(url: str, n: int = 5) -> dict:
    """Median wall ms of ``GET /v1/dashboard/data`` built (past the cache) and cached, against ``/healthz``
    (the API's floor on this machine), over ``n`` calls each on one connection; the payloads' ``build_ms``."""
    out: dict = {"built": [], "cached": [], "healthz": [], "build_ms": [], "same": []}
    with httpx.Client(base_url=url, timeout=30) as c:
        for _ in range(n):
            time.sleep(CACHE_S + 0.1)
            t0 = time.perf_counter()
            built = c.get("/v1/dashboard/data")
            t1 = time.perf_counter()
            cached = c.get("/v1/dashboard/data")
            t2 = time.perf_counter()
            c.get("/healthz")
            t3 = time.perf_counter()
            out["built"].append((t1 - t0) * 1e3)
            out["cached"].append((t2 - t1) * 1e3)
            out["healthz"].append((t3 - t2) * 1e3)
            out["build_ms"].append(built.json()["build_ms"])
            out["same"].append(cached.json()["time"] == built.json()["time"])
            out["bytes"] = len(built.content)
    return {k: (statistics.median(v) if k not in ("same", "bytes") else v) for k, v in out.items()}


def _fit_window(driver, width: int = 1600) -> None:
    """Make the viewport as tall as the page (so the screenshot shows all of it), then let plotly relayout."""
    for _ in range(3):
        inner, page = driver.execute_script("return [window.innerHeight, document.documentElement.scrollHeight]")
        if page <= inner:
            break
        outer = driver.get_window_size()["height"]
        driver.set_window_size(width, min(page + outer - inner, 4000))
        time.sleep(1.0)


def _rows(driver, table: str) -> list[list[str]]:
    return driver.execute_script(
        "return [...document.querySelectorAll(`#${arguments[0]} tbody tr`)].map("
        "(tr) => [...tr.cells].map((td) => td.textContent));", table)


def test_the_dashboard_shows_live_charts_tables_and_a_group_timeline(observed, browser, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    url = observed.url
    gid, timeline = _code_group(url)
    browser.get(f"{url}/dashboard?group={gid}")
    WebDriverWait(browser, 90, poll_frequency=0.5).until(
        lambda d: int(d.execute_script("return document.body.dataset.polls || 0")) >= 1)

    charts = dict(browser.execute_script(_TRACES_JS, list(CHARTS)))
    for chart in CHARTS:
        assert charts[chart], f"{chart}: no trace"
        empty = [name for name, nx, ny in charts[chart] if min(nx, ny) == 0]
        assert not empty, f"{chart}: traces without data points: {empty} ({charts[chart]})"
    for chart in ("chart-reward", "chart-pass", "chart-length", "chart-diversity"):
        assert {name for name, _, _ in charts[chart]} == DOMAINS, charts[chart]
    assert {name for name, _, _ in charts["chart-eval"]} == DOMAINS | {"all domains"}
    assert all(nx >= len(observed.eval_rounds) for _, nx, _ in charts["chart-eval"]), charts["chart-eval"]

    services = {name for name, _, _ in charts["chart-trace"]}  # one plotly trace per service
    assert {"scheduler", "rollout", "verifier"} <= services, (services, timeline["services"])
    assert services <= set(timeline["services"]) and len(services) >= 3
    assert sum(nx for _, nx, _ in charts["chart-trace"]) >= len(services)
    assert browser.find_element("id", "trace-group").get_attribute("value") == gid

    assert int(browser.find_element("id", "st-version").text.replace(",", "")) >= MIN_VERSION
    paused = httpx.get(f"{url}/v1/status", timeout=30).json()["training_paused"]
    assert browser.find_element("id", "st-training").text.startswith("paused" if paused else "running")
    breakers = _rows(browser, "breakers-table")
    assert {r[0] for r in breakers} == DOMAINS and all(r[1] in ("closed", "open", "half_open") for r in breakers)
    alerts = _rows(browser, "alerts-table")
    assert alerts == [["none"]] or (alerts and all(len(r) == 8 for r in alerts)), alerts
    assert {r[0] for r in _rows(browser, "spend-table")} == DOMAINS

    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe

    _fit_window(browser)
    png = tmp_path / "flywheel-dashboard.png"
    assert browser.save_screenshot(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    shutil.copy(png, SCREENSHOT)
    print(f"\ndashboard screenshot: {png} (copy: {SCREENSHOT})")

    browser.get("about:blank")  # no more polls: the next calls are the test's own
    t = _time_data_call(url)
    assert all(t["same"]), "a second call within 2 s was not served from the cache"
    print(f"GET /v1/dashboard/data, median of 5: {t['built']:.1f} ms when built ({t['build_ms']:.1f} ms of it "
          f"building), {t['cached']:.1f} ms cached, /healthz {t['healthz']:.1f} ms; {t['bytes']} bytes")
