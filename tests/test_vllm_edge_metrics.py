"""Live metrics at the edge on the real OpenAI server (vLLM CPU build): in window mode the recorder's delivery
process counts each window it closes (`llmvisor.metering.prometheus`), the numbers reach the server's own /metrics
through prometheus_client's multiprocess directory, and a real Prometheus scraping the engine alone, after the last
window is in the ledger, holds per-tenant totals equal to the ledger's. The dashboard's engine source answers too.

Tolerance: float rounding only. The ledger holds integer nanoseconds; the counters add each window's integers / 1e9
in float64 (the error after n windows is at most about n x 2**-53 of the total), and Prometheus hands back the
float64 it scraped exactly. So the comparison is relative 1e-12: tighter than one nanosecond on any total below
1,000 s, so a single nanosecond billed differently would fail it.
"""

from __future__ import annotations

import math
import re
import signal
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="needs the vLLM CPU build (pip install -e '.[vllm]')", exc_type=ImportError)

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, func, select

from _processes import stop_process
from _prometheus import PROMETHEUS_BINARY, PrometheusServer
from _tiny_llama import write_tiny_llama
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.ledger import Ledger
from llmvisor.ledger.schema import tenant_seconds, windows
from llmvisor.service.process import ServerProcess
from test_grafana_dashboard import METRIC_NAME, dashboard, finite_values, panel_exprs, substitute, variable_queries
from test_vllm_delivery import ApiServer
from test_vllm_recorder import TINY_FIELDS

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(PROMETHEUS_BINARY is None, reason="no prometheus binary on PATH")]

REL_TOL = 1e-12
ENGINE = "llmvisor_engine"


def engine_samples(base: str) -> dict[str, list]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def ledger_windows(db_url: str, run_id: str) -> tuple[int, int, dict[str, dict[str, int]]]:
    """(windows, steps covered, per tenant: attributed_ns, measured_ns, num_slices, num_new_tokens) of the run."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            n_windows, n_steps = conn.execute(select(func.count(), func.coalesce(func.sum(windows.c.num_steps), 0))
                                              .where(windows.c.run_id == run_id)).one()
            # window usage is kept per tenant and second (schema 7), not per run: every window here is the run's
            assert conn.execute(select(func.count()).select_from(windows)).scalar() == n_windows
            t = tenant_seconds.c
            rows = conn.execute(select(t.tenant, func.sum(t.attributed_ns), func.sum(t.measured_ns), func.sum(t.num_slices),
                                       func.sum(t.num_new_tokens), func.sum(t.kv_block_ns * t.kv_block_bytes))
                                .group_by(t.tenant)).all()
    finally:
        engine.dispose()
    names = ("attributed_ns", "measured_ns", "num_slices", "num_new_tokens", "kv_byte_ns")
    return int(n_windows), int(n_steps), {row[0]: dict(zip(names, map(int, row[1:]))) for row in rows}


def by_tenant(prometheus: PrometheusServer, metric: str) -> dict[str, float]:
    return {s["metric"]["tenant"]: float(s["value"][1]) for s in prometheus.query(f"sum by (tenant) ({metric})")}


def test_prometheus_scraping_the_engine_holds_the_ledgers_per_tenant_totals(tmp_path, monkeypatch):
    model_path = tmp_path / "model.json"
    StepLatencyModel().fit(synthetic_trace(1000)).to_json(model_path)
    db_url = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db_url)
    admin_key = ledger.create_key(is_admin=True)
    ledger.close()
    monkeypatch.setenv("LLMVISOR_STORE_STEPS", "0")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # the wrapper makes one
    with ServerProcess(model_path, db_url, log_path=tmp_path / "service.log") as service:
        spec = {"url": service.url, "key": admin_key, "db_url": db_url, "model_dir": write_tiny_llama(tmp_path / "tiny", **TINY_FIELDS)}
        server = ApiServer(spec, tmp_path, "edge", entry_point="llmvisor.engines.vllm.openai_server")
        try:
            found = re.findall(r"llmvisor: engine fingerprint (\S+):", server.log())
            assert found, server.log()[-3000:]
            engine_class = found[-1]
            model = StepLatencyModel().fit(synthetic_trace(1000, seed=5))
            added = httpx.post(f"{service.url}/v1/models", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30,
                               json={"model": model.to_dict(), "engine_class": engine_class, "activate": True})
            assert added.status_code == 201, added.text
            with PrometheusServer([f"127.0.0.1:{server.port}"], admin_key, tmp_path) as prometheus:
                server.start_traffic()
                time.sleep(6)
                server.stop_traffic()
                # The last window closes once the clock is past it (window 1 s + grace 0.5 s) and goes to the service:
                # wait until the ledger holds every window the engine counted, and nothing changes for 3 s.
                deadline, stable_since, last = time.monotonic() + 60, None, None
                while time.monotonic() < deadline:
                    counted = engine_samples(server.base).get(f"{ENGINE}_windows_total", [])
                    state = (sum(s.value for s in counted), ledger_windows(db_url, server.run_id)[0])
                    if state != last:
                        last, stable_since = state, time.monotonic()
                    elif state[0] == state[1] > 0 and time.monotonic() - stable_since >= 3:
                        break
                    time.sleep(0.25)
                else:
                    raise AssertionError(f"windows counted at the engine vs stored: {last}\n{server.log()[-3000:]}")
                prometheus.wait_for_scrapes_after(time.time(), 1)
                n_windows, n_steps, ledger_tenants = ledger_windows(db_url, server.run_id)
                attributed = by_tenant(prometheus, f"{ENGINE}_attributed_seconds_total")
                measured = by_tenant(prometheus, f"{ENGINE}_tenant_measured_seconds_total")
                slices = by_tenant(prometheus, f"{ENGINE}_slices_total")
                tokens = by_tenant(prometheus, f"{ENGINE}_new_tokens_total")
                kv_gib_s = by_tenant(prometheus, f"{ENGINE}_kv_gib_seconds_total")
                [steps] = finite_values(prometheus.query(f"sum({ENGINE}_steps_total)"))
                [counted_windows] = finite_values(prometheus.query(f"sum({ENGINE}_windows_total)"))
                versions = {s["metric"]["model_version"] for s in prometheus.query(f"{ENGINE}_windows_total")}
                [median] = finite_values(prometheus.query(
                    f"histogram_quantile(0.5, sum by (le) ({ENGINE}_model_relative_residual_distribution_bucket))"))
                pusher_counters = prometheus.query("llmvisor_pusher_steps_pushed_total")
                board = dashboard()
                answers = {}
                for title, expr in panel_exprs(board):
                    text = substitute(expr, source=ENGINE, rate_interval="1m", range_="10m")
                    if set(METRIC_NAME.findall(text)) and all(n.startswith(f"{ENGINE}_") for n in METRIC_NAME.findall(text)):
                        answers[(title, expr)] = prometheus.query(text)
                variables = {}
                for name, (metric, label) in variable_queries(board).items():
                    now_s = time.time()
                    response = httpx.get(f"{prometheus.url}/api/v1/label/{label}/values", timeout=10.0,
                                         params={"match[]": substitute(metric, source=ENGINE), "start": now_s - 600, "end": now_s})
                    variables[name] = set(response.json()["data"])
            server.interrupt()
        finally:
            stop_process(server.process, sig=signal.SIGKILL)
    mine = {t: v for t, v in ledger_tenants.items() if t.startswith(server.run_id)}
    print(f"{n_windows} windows, {n_steps} steps, {len(mine)} tenants, {sum(v['attributed_ns'] for v in mine.values()) / 1e9:.6f} s "
          f"attributed; residual median {median:+.3f}; worst relative difference "
          f"{max(abs(attributed[t] - v['attributed_ns'] / 1e9) / (v['attributed_ns'] / 1e9) for t, v in mine.items()):.2e}")
    assert len(mine) >= 5 and set(mine) == set(ledger_tenants) == set(attributed) == set(measured)
    assert counted_windows == n_windows and steps == n_steps and versions == {"1"}
    for tenant, totals in mine.items():
        assert math.isclose(attributed[tenant], totals["attributed_ns"] / 1e9, rel_tol=REL_TOL), tenant
        assert math.isclose(measured[tenant], totals["measured_ns"] / 1e9, rel_tol=REL_TOL), tenant
        assert slices[tenant] == totals["num_slices"] and tokens[tenant] == totals["num_new_tokens"], tenant
        # KV memory (trace format 3 metered by the recorder, window format 2): the engine's counter is the ledger's
        assert totals["kv_byte_ns"] > 0 and math.isclose(kv_gib_s[tenant], totals["kv_byte_ns"] / 2**30 / 1e9,
                                                         rel_tol=REL_TOL), tenant
    assert math.isfinite(median)
    assert pusher_counters, "the delivery process's own counters reach the engine's /metrics too"
    # The dashboard, Source = engines: every query of the engines' metrics answers; all but the pending ones (no
    # window was pending) with data; the per-tenant total panel is the ledger's; the variables list the run's values.
    empty = [f"{title}: {expr}" for (title, expr), result in answers.items() if "pending" not in expr and not finite_values(result)]
    assert not empty, "\n".join(empty)
    assert len(answers) >= 8
    [total] = [result for (title, _), result in answers.items() if title.startswith("Attributed engine seconds since")]
    assert {s["metric"]["tenant"]: float(s["value"][1]) for s in total} == pytest.approx(
        {t: v["attributed_ns"] / 1e9 for t, v in mine.items()}, rel=REL_TOL)
    assert variables == {"tenant": set(mine), "engine_class": {engine_class}}
