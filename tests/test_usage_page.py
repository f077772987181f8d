"""The tenant usage page in a real headless browser (Debian's chromium driven by Selenium) against a real
`llmvisor serve` over a SQLite ledger filled by ingest of two tenants' steps: the page loads under its CSP, a bad
key is an error, the totals shown (time and cost per currency) equal the API's, the CSV holds the API's requests, and tenant A's page and CSV
never show tenant B's requests or name.

``LLMVISOR_USAGE_SCREENSHOT=PATH`` saves the logged-in page there (``scripts/usage-page-screenshot.sh``).
"""

from __future__ import annotations

import csv
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from _service_fixtures import bearer, model_path  # noqa: F401
from _usage_data import ENGINE_IDS, GLOBEX_CHAT, T0_S, usage_steps
from llmvisor.billing.prices import add_prices, parse_prices
from llmvisor.ledger import Ledger
from llmvisor.ledger.store import AdjustmentRow
from llmvisor.service.process import ServerProcess

webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
pytestmark = pytest.mark.skipif(
    not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
    reason="needs Debian's chromium and chromium-driver (scripts/install-test.sh installs them)",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_path):  # noqa: F811
    folder = tmp_path_factory.mktemp("page")
    db_url = f"sqlite:///{folder}/ledger.db"
    ledger = Ledger(db_url)
    keys = {"admin": ledger.create_key(is_admin=True), "acme": ledger.create_key("acme"), "globex": ledger.create_key("globex")}
    hour_us = 3_600_000_000
    start_us = int(T0_S * 1e6)
    ledger.add_adjustments([
        AdjustmentRow("00000000c0ffee01", start_us, start_us + hour_us, 2, tenant, "default", 1_000_000_000, 1_000_000_000 + delta_ns,
                      delta_ns, 15, int(time.time() * 1e6))
        for tenant, delta_ns in (("acme", -12_345_678), ("globex", 98_765))
    ])
    add_prices(ledger, parse_prices([{"engine_class": c, "currency": currency, "engine_hour_price": price, "valid_from": 0}
                                     for c, currency, price in (("", "EUR", "987654.25"), ("00000000c0ffee01", "USD", "123456.7"))],
                                    "test", source="test"))
    ledger.close()
    server = ServerProcess(model_path, db_url, log_path=folder / "service.log", extra_args=("--fallback-model", str(model_path))).start()
    try:
        response = httpx.post(f"{server.url}/v1/steps", json={"steps": usage_steps()}, headers=bearer(keys["admin"]), timeout=30)
        assert response.status_code == 200, response.text
        yield {"url": server.url, "keys": keys}
    finally:
        server.stop()


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,1500"):
        options.add_argument(argument)
    if os.geteuid() == 0:
        options.add_argument("--no-sandbox")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False})
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)  # the system driver: nothing downloaded
    driver.downloads = downloads
    try:
        yield driver
    finally:
        driver.quit()


def api(served, path: str, tenant: str) -> dict:
    response = httpx.get(f"{served['url']}{path}", headers=bearer(served["keys"][tenant]), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def log_in(driver, key: str) -> None:
    field = driver.find_element(By.ID, "key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()


def visible(driver, element_id: str):
    return WebDriverWait(driver, 20).until(expected_conditions.visibility_of_element_located((By.ID, element_id)))


def test_a_bad_key_is_an_error_and_a_tenant_sees_its_own_usage_only(served, browser):
    browser.get(f"{served['url']}/usage")
    assert browser.find_element(By.ID, "login").is_displayed() and not browser.find_element(By.ID, "usage").is_displayed()

    log_in(browser, "llmvisor-not-a-key")
    assert "refused" in visible(browser, "error").text
    assert not browser.find_element(By.ID, "usage").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('llmvisor-key')") is None

    log_in(browser, served["keys"]["acme"])
    visible(browser, "usage")
    assert not browser.find_element(By.ID, "error").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('llmvisor-key')") == served["keys"]["acme"]

    usage = api(served, "/v1/usage/tenants", "acme")["tenants"]
    assert [u["tenant"] for u in usage] == ["acme"]
    assert browser.find_element(By.ID, "tenant").text == "acme"
    assert browser.find_element(By.ID, "total-attributed-ns").text == f"{usage[0]['attributed_ns']} ns"
    assert browser.find_element(By.ID, "total-adjustments-ns").text == f"{usage[0]['adjustments_ns']} ns" == "-12345678 ns"
    assert browser.find_element(By.ID, "total-adjusted-ns").text == f"{usage[0]['adjusted_ns']} ns"
    cost = usage[0]["cost"]  # per currency, as the API gives it (the ledger's two classes are priced in two)
    assert sorted(cost) == ["EUR", "USD"]
    assert browser.find_element(By.ID, "total-cost").text == f"{cost['EUR']} EUR, {cost['USD']} USD"

    classes = api(served, "/v1/usage/classes?bucket=hour", "acme")
    class_rows = browser.find_elements(By.CSS_SELECTOR, "#classes tbody tr")
    assert len(class_rows) == len(classes["buckets"]) >= 4  # two classes over two hours
    shown_s = [float(row.find_elements(By.TAG_NAME, "td")[2].text.split()[0]) for row in class_rows]
    assert shown_s == [round(b["attributed_ns"] / 1e9, 6) for b in classes["buckets"]]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#versions li")) == len(classes["model_versions"]) == 2

    top = api(served, "/v1/usage/requests?limit=20", "acme")["requests"]
    shown_ids = [row.find_elements(By.TAG_NAME, "td")[0].text for row in browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr")]
    assert shown_ids == [r["request_id"] for r in top] and set(shown_ids) == set(ENGINE_IDS["acme"])
    assert len(browser.find_elements(By.CSS_SELECTOR, "#adjustments tbody tr")) == 1

    page = browser.page_source
    for foreign in ("globex", GLOBEX_CHAT, *ENGINE_IDS["globex"]):
        assert foreign not in page, foreign

    browser.find_element(By.ID, "csv").click()
    deadline = time.monotonic() + 20
    while not (files := [p for p in browser.downloads.iterdir() if p.suffix == ".csv"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert files, "the CSV was not downloaded"
    text = Path(files[0]).read_text()
    rows = list(csv.DictReader(text.splitlines()))
    everything = api(served, "/v1/usage/requests?limit=10000", "acme")["requests"]
    assert [(r["run_id"], r["request_id"], int(r["attributed_ns"])) for r in rows] == [
        (r["run_id"], r["request_id"], r["attributed_ns"]) for r in everything]
    assert sum(int(r["attributed_ns"]) for r in rows) == usage[0]["attributed_ns"]
    assert "globex" not in text and GLOBEX_CHAT not in text

    browser.refresh()  # the key stays for the tab
    visible(browser, "usage")
    if os.environ.get("LLMVISOR_USAGE_SCREENSHOT"):
        browser.save_screenshot(os.environ["LLMVISOR_USAGE_SCREENSHOT"])
    violations = [entry["message"] for entry in browser.get_log("browser") if "Content Security Policy" in entry["message"]]
    assert not violations, violations


@pytest.fixture(scope="module")
def served_kv(tmp_path_factory, model_path):  # noqa: F811
    """A ledger with KV memory-time (trace format 3, made by the meter) for tenant kv-a over two hours."""
    from _kv_steps import metered_run

    folder = tmp_path_factory.mktemp("page-kv")
    db_url = f"sqlite:///{folder}/ledger.db"
    ledger = Ledger(db_url)
    keys = {"admin": ledger.create_key(is_admin=True), "kv-a": ledger.create_key("kv-a")}
    ledger.close()
    hour0 = int(T0_S) // 3600 * 3600
    steps = (metered_run(11, run_id="page-kv-0", t0_s=T0_S, tenants=("kv-a", "zz-other"))
             + metered_run(12, run_id="page-kv-1", t0_s=hour0 + 3600 + 7, tenants=("kv-a",), block_bytes=8192))
    server = ServerProcess(model_path, db_url, log_path=folder / "service.log").start()
    try:
        response = httpx.post(f"{server.url}/v1/steps", json={"steps": steps}, headers=bearer(keys["admin"]), timeout=30)
        assert response.status_code == 200, response.text
        yield {"url": server.url, "keys": keys}
    finally:
        server.stop()


def test_the_page_charts_kv_memory_beside_engine_time(served_kv, browser):
    browser.get(f"{served_kv['url']}/usage")
    log_in(browser, served_kv["keys"]["kv-a"])
    visible(browser, "usage")
    [usage] = api(served_kv, "/v1/usage/tenants", "kv-a")["tenants"]
    assert usage["kv_block_ns"] > 0
    assert browser.find_element(By.ID, "total-kv-block-ns").text == f"{usage['kv_block_ns']} block-ns"
    assert browser.find_element(By.ID, "total-kv-gib-s").text == f"{usage['kv_gib_s']:.6f} GiB·s"
    [hourly] = api(served_kv, "/v1/usage/tenants?bucket=hour", "kv-a")["tenants"]
    rows = browser.find_elements(By.CSS_SELECTOR, "#memory tbody tr")
    assert len(rows) == len(hourly["buckets"]) == 2  # the second chart: one bar per hour
    cells = [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]
    assert [int(c[3]) for c in cells] == [b["kv_block_ns"] for b in hourly["buckets"]]
    assert sum(int(c[3]) for c in cells) == usage["kv_block_ns"]
    assert all(row.find_elements(By.CSS_SELECTOR, ".bar") for row in rows)
    assert not browser.find_element(By.ID, "memory-none").is_displayed()
    assert "zz-other" not in browser.page_source
    violations = [entry["message"] for entry in browser.get_log("browser") if "Content Security Policy" in entry["message"]]
    assert not violations, violations


def test_the_memory_chart_says_when_nothing_is_metered(served, browser):
    browser.get(f"{served['url']}/usage")
    log_in(browser, served["keys"]["acme"])
    visible(browser, "usage")
    assert visible(browser, "memory-none").is_displayed() and not browser.find_element(By.ID, "memory").is_displayed()
    assert browser.find_element(By.ID, "total-kv-gib-s").text == "not metered"


@pytest.fixture(scope="module")
def served_lora(tmp_path_factory, model_path):  # noqa: F811
    """A ledger where tenant tenant-0 ran two LoRA adapters and the base model (trace format 4, a LoRA model)."""
    from _lora_runs import as_rows, lora_model, relayed_lora_run

    folder = tmp_path_factory.mktemp("page-lora")
    db_url = f"sqlite:///{folder}/ledger.db"
    ledger = Ledger(db_url)
    keys = {"admin": ledger.create_key(is_admin=True), "tenant-0": ledger.create_key("tenant-0")}
    ledger.close()
    engine_class = "1a1a1a1a1a1a1a1a"
    server = ServerProcess(model_path, db_url, log_path=folder / "service.log").start()
    try:
        added = httpx.post(f"{server.url}/v1/models", json={"model": lora_model(engine_class).to_dict(), "engine_class": engine_class,
                                                             "activate": True}, headers=bearer(keys["admin"]), timeout=30)
        assert added.status_code == 201, added.text
        steps = as_rows(relayed_lora_run("page-lora", 40, t0_s=T0_S, seed=3), "page-lora", engine_class)
        response = httpx.post(f"{server.url}/v1/steps", json={"steps": steps}, headers=bearer(keys["admin"]), timeout=30)
        assert response.status_code == 200, response.text
        yield {"url": server.url, "keys": keys}
    finally:
        server.stop()


def test_the_page_shows_usage_per_lora_adapter(served_lora, browser):
    browser.get(f"{served_lora['url']}/usage")
    log_in(browser, served_lora["keys"]["tenant-0"])
    visible(browser, "adapters")
    [usage] = api(served_lora, "/v1/usage/tenants?group_by=adapter", "tenant-0")["tenants"]
    rows = browser.find_elements(By.CSS_SELECTOR, "#adapters tbody tr")
    cells = [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]
    assert [(c[0], c[4]) for c in cells] == [(a["lora_adapter"] or "(base model)", f"{a['attributed_ns']} ns") for a in usage["adapters"]]
    assert {c[0] for c in cells} == {"(base model)", "adapter-r8", "adapter-r64"}
    assert sum(int(c[4].split()[0]) for c in cells) == usage["attributed_ns"]
    violations = [entry["message"] for entry in browser.get_log("browser") if "Content Security Policy" in entry["message"]]
    assert not violations, violations


def test_the_adapter_table_stays_hidden_without_adapters(served, browser):
    browser.get(f"{served['url']}/usage")
    log_in(browser, served["keys"]["acme"])
    visible(browser, "usage")
    assert not browser.find_element(By.ID, "adapters").is_displayed()
    assert not browser.find_element(By.ID, "adapters-title").is_displayed()
