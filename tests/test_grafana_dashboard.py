"""The shipped Grafana dashboard: a valid dashboard shape, every metric it queries exported by the service or by
the engines (the ``source`` variable picks ``llmvisor_`` or ``llmvisor_engine_`` names; the per-tenant panels work
from both), and every panel query of the service's metrics, run against a real Prometheus scraping a real
`llmvisor serve`, answering with data (the per-tenant total equal to the ledger's). The engine source against a
real Prometheus scraping a real vLLM server: tests/test_vllm_edge_metrics.py."""

from __future__ import annotations

import copy
import json
import math
import re
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from _kv_steps import metered_run
from _prometheus import PROMETHEUS_BINARY, PrometheusServer
from _service_fixtures import T0_S, bearer, class_body, class_model, make_steps, model_path  # noqa: F401
from llmvisor import shipped
from llmvisor.ledger import Ledger
from llmvisor.metering import WindowAggregator
from llmvisor.metering.prometheus import EdgeMetrics
from llmvisor.service.app import create_app
from llmvisor.service.process import ServerProcess

CLASS_MODELLED = "aaaaaaaaaaaaaaaa"
CLASS_PENDING = "bbbbbbbbbbbbbbbb"
METRIC_NAME = re.compile(r"\bllmvisor_[a-z0-9_]+")
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")
SOURCES = ("llmvisor", "llmvisor_engine")
"""The ``source`` variable's values: the service's metric names, the engines' (llmvisor.metering.prometheus)."""
GRID_COLUMNS = 24
NO_FINGERPRINT = "(no fingerprint)"


def dashboard() -> dict:
    return json.loads(shipped.grafana_dashboard_path().read_text(encoding="utf-8"))


def query_panels(board: dict) -> list[dict]:
    return [panel for panel in board["panels"] if panel["type"] != "row"]


def panel_exprs(board: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target."""
    return [(panel["title"], target["expr"]) for panel in query_panels(board) for target in panel["targets"]]


def variable_queries(board: dict) -> dict[str, tuple[str, str]]:
    """Each query variable's (metric, label) of its label_values()."""
    found = {}
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["query"]["query"])
            assert match, f"variable {variable['name']}: not label_values(metric, label): {variable['query']}"
            found[variable["name"]] = match.groups()
    return found


def substitute(expr: str, *, tenant: str = ".*", engine_class: str = ".*", rate_interval: str = "1m", range_: str = "10m",
               source: str = "llmvisor") -> str:
    """The expr as Grafana sends it, with the variables' values (".*" is their "All" value)."""
    text = (expr.replace("$__rate_interval", rate_interval).replace("$__range", range_).replace("${source}", source)
            .replace("$tenant", tenant).replace("$engine_class", engine_class))
    assert "$" not in text, f"unknown variable left in {text!r}"
    return text


def test_the_dashboard_is_a_grafana_dashboard_with_its_variables():
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert set(variable_queries(board)) == {"tenant", "engine_class"}
    assert variables["source"]["type"] == "custom" and [o["value"] for o in variables["source"]["options"]] == list(SOURCES)
    assert variables["source"]["query"] == ",".join(f"{o['text']} : {o['value']}" for o in variables["source"]["options"])
    assert variables["source"]["current"]["value"] == "llmvisor"
    for name in ("tenant", "engine_class"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
        assert variables[name]["datasource"]["uid"] == "${datasource}"

    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
    panels = query_panels(board)
    assert {row["title"].split(":")[0] for row in board["panels"] if row["type"] == "row"} == {
        "Tenants", "Model drift per engine class", "Ingest health", "KV cache memory"}
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip(), panel["title"]
    for title, expr in panel_exprs(board):
        if "by (tenant)" in expr:
            assert '{tenant=~"$tenant"}' in expr, f"{title}: per-tenant query ignores $tenant"
        if "llmvisor_class_" in expr:  # per-class series only
            assert '{engine_class=~"$engine_class"}' in expr, f"{title}: per-class query ignores $engine_class"


def exported_names(text: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def engine_exported(model) -> set[str]:
    """What an engine's /metrics carries in window mode: llmvisor.metering.prometheus after attributed and pending windows."""
    registry = CollectorRegistry()
    metrics = EdgeMetrics(registry)
    for source, run in (((lambda: (model, 1)), "a"), ((lambda: None), "b")):
        # window format 2: each step's one request holds 2 of the pool's 4 blocks for the 50 ms since the last
        aggregator = WindowAggregator(run, CLASS_MODELLED, source, on_close=metrics.record_window, kv_pool_blocks=4,
                                      kv_block_bytes=1 << 16)
        for step_id in range(40):
            aggregator.add(step_id, T0_S + 0.05 * step_id, 0.02,
                           [[f"r{step_id % 3}", f"tenant-{step_id % 2}", 1, 100, False, 0, None, 0, 2 * 50_000_000]],
                           [50_000_000, 0, 2 * 50_000_000, 0, 0])
        aggregator.close()
    return exported_names(generate_latest(registry).decode())


def service_exported(model_path, tmp_path) -> set[str]:  # noqa: F811
    url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(url)
    admin = bearer(ledger.create_key(is_admin=True))
    ledger.close()
    with TestClient(create_app(model_path, url, registry_refresh_s=0.0)) as client:
        assert client.post("/v1/models", json={"model": class_model(CLASS_MODELLED).to_dict(), "activate": True},
                           headers=admin).status_code == 201
        assert client.post("/v1/steps", json=class_body(CLASS_MODELLED, 60, run_id="a", seed=1), headers=admin).status_code == 200
        assert client.post("/v1/steps", json=class_body(CLASS_PENDING, 20, run_id="b", seed=2), headers=admin).json()["steps_pending"] == 20
        assert client.post("/v1/steps", json={"steps": make_steps("plain", 30)}, headers=admin).status_code == 200
        assert client.post("/v1/steps", json={"steps": make_steps("gappy", 30)[5:]}, headers=admin).status_code == 200
        kv_run = metered_run(1, run_id="kv", t0_s=T0_S, tenants=("tenant-0", "tenant-1"))
        assert client.post("/v1/steps", json={"steps": kv_run}, headers=admin).status_code == 200
        return exported_names(client.get("/metrics", headers=admin).text)


def unexported(board: dict, exported: dict[str, set[str]]) -> list[str]:
    """What the dashboard asks for that its source does not export: a query naming ``${source}`` must be answered by
    each source's own metrics; any other query (and each alternative of a variable's selector) by one source's."""
    problems = []
    queries = [(title, expr) for title, expr in panel_exprs(board)]
    queries += [(f"variable {name}", metric) for name, (metric, _) in variable_queries(board).items()]
    for title, expr in queries:
        if "$source" in expr.replace("${source}", "$source"):
            for source in SOURCES:
                missing = set(METRIC_NAME.findall(substitute(expr, source=source))) - exported[source]
                if missing:
                    problems.append(f"{title} (source {source}): {sorted(missing)}")
        elif expr.startswith("{__name__=~"):
            names = METRIC_NAME.findall(expr)
            if any(not any(n in e for e in exported.values()) for n in names) or any(not set(names) & e for e in exported.values()):
                problems.append(f"{title}: {names} (each name exported by a source, each source exporting one)")
        else:
            names = set(METRIC_NAME.findall(substitute(expr)))
            if not any(names <= e for e in exported.values()):
                problems.append(f"{title}: {sorted(names)} exported by neither source alone")
    return problems


def test_every_metric_the_dashboard_queries_is_exported_by_the_service_or_the_engines(model_path, tmp_path):  # noqa: F811
    """A renamed metric breaks this test: each name in a panel or variable query must be a sample of the service's
    /metrics or of an engine's (window mode); the per-tenant panels name ``${source}``, so work from both."""
    exported = {"llmvisor": service_exported(model_path, tmp_path), "llmvisor_engine": engine_exported(class_model(CLASS_MODELLED))}
    assert all(name.startswith("llmvisor_engine_") for name in exported["llmvisor_engine"])
    board = dashboard()
    referenced = {name for _, expr in panel_exprs(board) for source in SOURCES for name in METRIC_NAME.findall(substitute(expr, source=source))}
    assert len(referenced) >= 20
    assert unexported(board, exported) == []
    tenant_panels = [expr for title, expr in panel_exprs(board) if "by (tenant)" in expr]
    assert len(tenant_panels) == 5 and all("${source}_attributed_seconds_total" in expr or "${source}_kv_gib_seconds_total" in expr
                                           for expr in tenant_panels)
    # the check can fail: a panel naming a metric neither source exports, or a ${source} one only the service has
    broken = copy.deepcopy(board)
    broken["panels"][1]["targets"][0]["expr"] = "sum(rate(llmvisor_attributed_secs_total[1m]))"
    broken["panels"][2]["targets"][0]["expr"] = "sum(${source}_tenants_folded)"
    assert len(unexported(broken, exported)) == 2


def finite_values(result: list[dict]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in result) if math.isfinite(v)]


@pytest.mark.skipif(PROMETHEUS_BINARY is None, reason="no prometheus binary on PATH (scripts/install-test.sh installs Debian's prometheus)")
def test_every_panel_query_answers_from_a_real_prometheus_and_the_total_equals_the_ledger(model_path, tmp_path):  # noqa: F811
    url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(url)
    key = ledger.create_key(is_admin=True)
    ledger.close()
    admin = bearer(key)
    drift_args = ("--drift-window-steps", "300", "--drift-alarm-steps", "100")
    with ServerProcess(model_path, url, log_path=tmp_path / "server.log", extra_args=drift_args) as server, \
            PrometheusServer([server.url.removeprefix("http://")], key, tmp_path) as prometheus, \
            httpx.Client(base_url=server.url, headers=admin, timeout=60.0) as client:
        prometheus.wait_for_scrapes_after(time.time(), 1)
        # Two rounds with a scrape between, so rate() has an increase to see.
        assert client.post("/v1/models", json={"model": class_model(CLASS_MODELLED).to_dict(), "activate": True}).status_code == 201
        for round_ in range(2):
            # The modelled class runs 20 % slower than its model: its median residual 0.2 / 1.2 leaves the band.
            slowed = class_body(CLASS_MODELLED, 150, run_id=f"slow-{round_}", seed=10 + round_, slowdown=1.2)
            assert client.post("/v1/steps", json=slowed).status_code == 200
            plain = make_steps(f"plain-{round_}", 100, n_tenants=3, seed=round_)
            assert client.post("/v1/steps", json={"steps": plain}).json()["steps_inserted"] == 100
            assert client.post("/v1/steps", json={"steps": plain[:20]}).json()["steps_duplicate"] == 20
            conflicting = copy.deepcopy(plain[:5])
            for row in conflicting[0]:
                row["step_latency_s"] = round(row["step_latency_s"] + 0.001, 6)
            assert client.post("/v1/steps", json={"steps": conflicting}).status_code == 409
            # A run of the modelled class whose steps 10..16 never arrive: 7 missing.
            gappy = class_body(CLASS_MODELLED, 60, run_id=f"gappy-{round_}", seed=30 + round_)["columns"]
            keep = [k for k, step in enumerate(gappy["step_id"]) if not 10 <= step <= 16]
            gappy = {name: [values[k] for k in keep] for name, values in gappy.items()}
            assert client.post("/v1/steps", json={"columns": gappy}).status_code == 200
            # A run metered for KV memory (trace format 3), billed to tenants the other runs have too.
            kv_run = metered_run(round_, run_id=f"kv-{round_}", t0_s=T0_S + 600 * round_, tenants=("tenant-0", "tenant-1"))
            assert client.post("/v1/steps", json={"steps": kv_run}).json()["steps_inserted"] == len(kv_run)
            pending = client.post("/v1/steps", json=class_body(CLASS_PENDING, 40, run_id=f"pending-{round_}", seed=20 + round_))
            assert pending.json()["steps_pending"] == 40
            prometheus.wait_for_scrapes_after(time.time(), 1)

        ledger_seconds = {t["tenant"]: t["attributed_s"] for t in client.get("/v1/usage/tenants").json()["tenants"]}
        drift = {c["engine_class"]: c for c in client.get("/v1/models/drift").json()["classes"]}
        board = dashboard()
        service_names = exported_names(client.get("/metrics").text)

        for name, (metric, label) in variable_queries(board).items():
            metric = substitute(metric)
            # As Grafana asks: the label's values on the metric's series over the dashboard's time range.
            now_s = time.time()
            response = httpx.get(f"{prometheus.url}/api/v1/label/{label}/values",
                                 params={"match[]": metric, "start": now_s - 600, "end": now_s}, timeout=10.0)
            values = set(response.json()["data"])
            assert values == (set(ledger_seconds) if name == "tenant" else {CLASS_MODELLED}), name

        empty = []
        for title, expr in panel_exprs(board):
            if not set(METRIC_NAME.findall(substitute(expr))) <= service_names:
                continue  # the engines' (window mode): tests/test_vllm_edge_metrics.py
            for tenant, engine_class in ((".*", ".*"), ("tenant-1", CLASS_MODELLED)):
                result = prometheus.query(substitute(expr, tenant=tenant, engine_class=engine_class))
                if not finite_values(result):
                    empty.append(f"{title}: {expr} (tenant={tenant}, engine_class={engine_class}): {result}")
                if tenant != ".*":
                    assert {s["metric"].get("tenant", tenant) for s in result} <= {tenant}, (title, result)
                    assert {s["metric"].get("engine_class", engine_class) for s in result} <= {engine_class}, (title, result)
        assert not empty, "\n".join(empty)

        [total_expr] = [expr for title, expr in panel_exprs(board) if title.startswith("Attributed engine seconds since")]
        panel_seconds = {s["metric"]["tenant"]: float(s["value"][1]) for s in prometheus.query(substitute(total_expr))}
        assert len(ledger_seconds) == 4
        assert panel_seconds == pytest.approx(ledger_seconds, rel=1e-9)

        [alarm_expr] = [expr for title, expr in panel_exprs(board) if title.startswith("Drift alarm")]
        alarms = {s["metric"]["engine_class"]: float(s["value"][1]) for s in prometheus.query(substitute(alarm_expr))}
        assert drift[CLASS_MODELLED]["alarm"] and alarms[CLASS_MODELLED] == 1.0
        assert alarms == {(name or NO_FINGERPRINT): float(state["alarm"]) for name, state in drift.items()}
        [missing_expr] = [expr for title, expr in panel_exprs(board) if title.startswith("Missing steps")]
        missing = {s["metric"]["run"]: float(s["value"][1]) for s in prometheus.query(substitute(missing_expr))}
        assert missing == {"gappy-0": 7.0, "gappy-1": 7.0}
        assert {run: client.get(f"/v1/runs/{run}/gaps").json()["num_missing"] for run in missing} == {"gappy-0": 7, "gappy-1": 7}
        [rejected_expr] = [expr for title, expr in panel_exprs(board) if title.startswith("Rejected")]
        by_reason = {s["metric"]["reason"]: float(s["value"][1]) for s in prometheus.query(substitute(rejected_expr, rate_interval="10m"))}
        assert by_reason["conflict"] > 0 and by_reason["invalid_trace"] == 0
