"""POST /v1/windows over real databases: usage equal to per-step ingest of the same steps, idempotent re-sends,
409 on different content, named errors, gaps from the windows' step ranges; and the 4 → 5 migration."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from _service_fixtures import T0_S, admin, bearer, class_model, db_url, make_steps, model_path  # noqa: F401
from llmvisor.core.model import StepLatencyModel
from llmvisor.ledger import Ledger
from llmvisor.metering import WindowAggregator
from llmvisor.service.app import create_app

CLASS_W = "cccccccccccccccc"



@pytest.fixture
def client(model_path, db_url, admin):
    with TestClient(create_app(model_path, db_url)) as test_client:
        added = test_client.post("/v1/models", headers=bearer(admin),
                                 json={"model": class_model(CLASS_W).to_dict(), "engine_class": CLASS_W, "activate": True})
        assert added.status_code == 201, added.text
        yield test_client


def steps_of(run_id: str, n_steps: int = 60, *, skip: tuple[int, ...] = (), seed: int = 3, start_s: float = T0_S):
    """``seed`` and ``start_s``: two runs of one ledger must differ (else the second is a re-send of the first under a
    new run id, refused)."""
    groups = [g for g in make_steps(run_id, n_steps, step_interval_s=0.27, seed=seed, start_s=start_s) if g[0]["step_id"] not in skip]
    for group in groups:
        for row in group:
            row["engine_fingerprint"] = CLASS_W
    return groups


def relayed(groups):
    return [[g[0]["step_id"], g[0]["timestamp_s"], g[0]["step_latency_s"],
             [[r["request_id"], r["tenant"], r["num_new_tokens"], r["num_context_tokens"], r["phase"] == "prefill", 0, None] for r in g]]
            for g in groups]


def windows_of(client, admin, run_id, groups, *, window_s: float = 1.0):
    active = client.get(f"/v1/models/{CLASS_W}/active", headers=bearer(admin))
    assert active.status_code == 200, active.text
    model = StepLatencyModel.from_dict(active.json()["model"])
    version = active.json()["version"]
    agg = WindowAggregator(run_id, CLASS_W, lambda: (model, version), window_s=window_s)
    out = []
    for step in relayed(groups):
        out += agg.add(*step)
    return [w.to_json() for w in out + agg.close()]


def tenants(client, admin):
    body = client.get("/v1/usage/tenants", headers=bearer(admin)).json()
    return {t["tenant"]: t["attributed_ns"] for t in body["tenants"]}


def test_windows_bill_what_per_step_ingest_bills(client, admin):
    steps = steps_of("run-s")
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": steps}).status_code == 200
    per_step = tenants(client, admin)
    totals_steps = client.get("/v1/usage/totals", headers=bearer(admin)).json()
    windows = windows_of(client, admin, "run-w", steps_of("run-w"))
    answer = client.post("/v1/windows", headers=bearer(admin), json={"windows": windows})
    assert answer.status_code == 200, answer.text
    assert answer.json()["windows_inserted"] == len(windows) and answer.json()["steps_covered"] == 60
    # the same steps metered in windows add exactly what per-step ingest added, tenant by tenant
    assert tenants(client, admin) == {t: 2 * ns for t, ns in per_step.items()}
    totals = client.get("/v1/usage/totals", headers=bearer(admin)).json()
    assert totals["num_steps"] == 2 * totals_steps["num_steps"] and totals["num_slices"] == 2 * totals_steps["num_slices"]
    assert totals["measured_ns"] == 2 * totals_steps["measured_ns"] == totals["attributed_ns"]
    # request totals: one row per request, equal to the per-step sums
    by_run = {}
    for run in ("run-s", "run-w"):
        rows = client.get("/v1/usage/requests", headers=bearer(admin), params={"run_id": run}).json()["requests"]
        by_run[run] = {(r["request_id"], r["tenant"]): r["attributed_ns"] for r in rows}
    assert by_run["run-s"] == by_run["run-w"] and by_run["run-s"]


def test_resends_are_duplicates_and_different_content_is_409(client, admin):
    windows = windows_of(client, admin, "run-w", steps_of("run-w"))
    assert client.post("/v1/windows", headers=bearer(admin), json={"windows": windows}).status_code == 200
    before = tenants(client, admin)
    again = client.post("/v1/windows", headers=bearer(admin), json={"windows": windows})
    assert again.status_code == 200 and again.json()["windows_duplicate"] == len(windows) and again.json()["windows_inserted"] == 0
    changed = dict(windows[1], measured_ns=windows[1]["measured_ns"] + 1, attributed_ns=windows[1]["attributed_ns"] + 1)
    changed["requests"] = [dict(q) for q in windows[1]["requests"]]
    changed["requests"][0]["attributed_ns"] += 1
    conflict = client.post("/v1/windows", headers=bearer(admin), json={"windows": [changed]})
    assert conflict.status_code == 409, conflict.text
    assert conflict.json()["conflicting_windows"] == [{"run_id": "run-w", "window_start_us": windows[1]["window_start_us"]}]
    assert tenants(client, admin) == before


def test_a_step_is_billed_once_whatever_key_it_comes_under(client, admin):
    """A window whose steps the ledger already holds under another key is a 409 naming it, and nothing of its
    batch is stored: a delivery process restarted with another window length (or one that re-aggregated steps whose
    window was still on its way when it asked what is held), or a run switched between per-step and window
    mode. Before, only a window's own key was checked and such steps were billed twice."""
    def held():
        return client.get("/v1/windows/held", params={"run_id": "run-w"}, headers=bearer(admin)).json()

    one_s = windows_of(client, admin, "run-w", steps_of("run-w")[:30])
    assert client.post("/v1/windows", headers=bearer(admin), json={"windows": one_s}).status_code == 200
    before, held_before = tenants(client, admin), held()
    # 0.7 s windows of the same steps: only those whose keys the ledger does not hold (the others are the older
    # "different content" 409)
    keys = {w["window_start_us"] for w in one_s}
    shifted = [w for w in windows_of(client, admin, "run-w", steps_of("run-w"), window_s=0.7) if w["window_start_us"] not in keys]
    overlapping = [{"run_id": "run-w", "window_start_us": w["window_start_us"]} for w in shifted
                   if any(a <= 29 for a, _ in w["step_ranges"])]
    assert len(overlapping) >= 5 and len(overlapping) < len(shifted)
    refused = client.post("/v1/windows", headers=bearer(admin), json={"windows": shifted})
    assert refused.status_code == 409, refused.text
    assert "already holds" in refused.json()["detail"]
    assert refused.json()["conflicting_windows"] == overlapping
    assert tenants(client, admin) == before and held() == held_before  # the batch is stored whole or not at all
    # the steps after those held go through on their own, once
    rest = [w for w in shifted if {"run_id": "run-w", "window_start_us": w["window_start_us"]} not in overlapping]
    assert client.post("/v1/windows", headers=bearer(admin), json={"windows": rest}).status_code == 200
    assert client.post("/v1/windows", headers=bearer(admin), json={"windows": one_s}).json()["windows_duplicate"] == len(one_s)
    run_w_steps = sum(b - a + 1 for a, b in held()["step_ranges"])
    assert run_w_steps == 30 + sum(w["num_steps"] for w in rest)
    # per-step ingest of steps a window holds is refused too, and a window over steps stored one by one
    again = client.post("/v1/steps", headers=bearer(admin), json={"steps": steps_of("run-w")[3:5]})
    assert again.status_code == 409 and again.json()["conflicting_steps"][0] == {"run_id": "run-w", "step_id": 3}, again.text
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": steps_of("run-p", seed=4)[:20]}).status_code == 200
    over_steps = client.post("/v1/windows", headers=bearer(admin), json={"windows": windows_of(client, admin, "run-p", steps_of("run-p", seed=4))})
    assert over_steps.status_code == 409, over_steps.text
    assert "already holds" in over_steps.json()["detail"]
    # two windows of one batch, with other keys, sharing steps: refused whole
    later = steps_of("run-b")
    pair = [windows_of(client, admin, "run-b", later[4:8])[0], windows_of(client, admin, "run-b", later[4:8], window_s=0.7)[-1]]
    assert pair[0]["window_start_us"] != pair[1]["window_start_us"]
    assert set(range(pair[0]["step_ranges"][0][0], pair[0]["step_ranges"][-1][1] + 1)) & set(range(pair[1]["step_ranges"][0][0], pair[1]["step_ranges"][-1][1] + 1))
    both = client.post("/v1/windows", headers=bearer(admin), json={"windows": pair})
    assert both.status_code == 409 and "already holds" in both.json()["detail"], both.text
    assert client.get("/v1/windows/held", params={"run_id": "run-b"}, headers=bearer(admin)).json()["step_ranges"] == []
    totals = client.get("/v1/usage/totals", headers=bearer(admin)).json()
    assert totals["num_steps"] == run_w_steps + 20  # run-w's steps and run-p's 20, each once


def test_bad_windows_are_422_naming_the_field_and_store_nothing(client, admin):
    windows = windows_of(client, admin, "run-w", steps_of("run-w"))
    bad = dict(windows[0], step_ranges="x")
    answer = client.post("/v1/windows", headers=bearer(admin), json={"windows": [windows[1], bad]})
    assert answer.status_code == 422 and "windows[1].step_ranges" in answer.json()["detail"]
    unknown = dict(windows[0], model_version=9)
    answer = client.post("/v1/windows", headers=bearer(admin), json={"windows": [unknown]})
    assert answer.status_code == 422 and "windows[0].model_version" in answer.json()["detail"]
    assert tenants(client, admin) == {}


def test_a_backlog_of_windows_larger_than_a_small_body_is_taken_in_one_post(client, admin):
    """After an outage the pusher sends up to 200 windows at once (~10 kB each at B = 32): the windows route takes
    bodies up to the ingest limit, not the 64 KiB of the other routes (it answered 413 to a fleet's backlog)."""
    import json

    from llmvisor.service.config import DEFAULT_MAX_SMALL_BODY_BYTES

    windows = windows_of(client, admin, "run-big", steps_of("run-big", 600))
    body = json.dumps({"windows": windows}).encode()
    assert len(body) > DEFAULT_MAX_SMALL_BODY_BYTES
    answer = client.post("/v1/windows", headers={**bearer(admin), "Content-Type": "application/json"}, content=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["windows_inserted"] == len(windows)


def test_gaps_show_from_window_step_ranges(client, admin):
    windows = windows_of(client, admin, "run-w", steps_of("run-w", skip=(7, 8, 30)))
    assert client.post("/v1/windows", headers=bearer(admin), json={"windows": windows}).status_code == 200
    gaps = client.get("/v1/runs/run-w/gaps", headers=bearer(admin)).json()
    assert [(g["first_step_id"], g["last_step_id"]) for g in gaps["gaps"]] == [(7, 8), (30, 30)]


def missing_gauge(client, admin_key: str, run_id: str) -> float:
    for line in client.get("/metrics", headers=bearer(admin_key)).text.splitlines():
        if line.startswith("llmvisor_steps_missing{") and f'run="{run_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_missing_steps_gauge_follows_holes_as_windows_arrive_one_by_one(client, admin):
    """Windows posted one per request, as a delivery process sends them: the gauge shows a hole as soon as a
    window past it is stored, keeps it while later windows only grow the range beyond it (the ledger then
    skips re-reading the run's gaps), and drops it when the hole's own steps arrive."""
    groups = steps_of("run-g", 90)
    by_id = {g[0]["step_id"]: g for g in groups}
    first, hole, after = [by_id[i] for i in range(0, 20)], [by_id[i] for i in range(20, 30)], [by_id[i] for i in range(30, 90)]
    windows = windows_of(client, admin, "run-g", first + after)
    refill = windows_of(client, admin, "run-g-fill", hole)  # the hole's steps in windows of their own
    assert len(windows) >= 4

    def post(window):
        answer = client.post("/v1/windows", headers=bearer(admin), json={"windows": [window]})
        assert answer.status_code == 200, answer.text

    seen = []
    for window in windows:
        post(window)
        seen.append(missing_gauge(client, admin, "run-g"))
    past_hole = next(k for k, w in enumerate(windows) if w["step_ranges"][-1][1] >= 30)
    assert seen[:past_hole] == [0.0] * past_hole and seen[past_hole:] == [10.0] * (len(windows) - past_hole)
    for window in refill:
        post({**window, "run_id": "run-g", "window_start_us": window["window_start_us"] + 1})
    assert missing_gauge(client, admin, "run-g") == 0.0
    gaps = client.get("/v1/runs/run-g/gaps", headers=bearer(admin)).json()
    assert gaps["gaps"] == []


def test_what_the_ledger_holds_of_a_run_is_its_step_ranges_and_last_window_end(client, admin, db_url):
    """GET /v1/windows/held, where a replacement delivery process resumes: the step ids stored (in windows and
    one by one) from ``from_step_id`` on and where the last window ends; admin only, a named 422 for bad input."""
    groups = steps_of("run-h", skip=(7, 8, 30))
    windows = windows_of(client, admin, "run-h", groups[:40])
    assert client.post("/v1/windows", headers=bearer(admin), json={"windows": windows}).status_code == 200
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": groups[45:]}).status_code == 200
    first_after, last = groups[45][0]["step_id"], groups[-1][0]["step_id"]
    held = client.get("/v1/windows/held", params={"run_id": "run-h"}, headers=bearer(admin))
    assert held.status_code == 200, held.text
    covered = sorted({i for w in windows for a, b in w["step_ranges"] for i in range(a, b + 1)})
    assert held.json()["step_ranges"] == [[0, 6], [9, 29], [31, covered[-1]], [first_after, last]]
    assert held.json()["num_windows"] == len(windows)
    assert held.json()["last_window_end_us"] == max(w["window_end_us"] for w in windows)
    later = client.get("/v1/windows/held", params={"run_id": "run-h", "from_step_id": 20}, headers=bearer(admin)).json()
    assert later["step_ranges"] == [[20, 29], [31, covered[-1]], [first_after, last]] and later["from_step_id"] == 20
    nothing = client.get("/v1/windows/held", params={"run_id": "run-none"}, headers=bearer(admin)).json()
    assert (nothing["step_ranges"], nothing["num_windows"], nothing["last_window_end_us"]) == ([], 0, None)
    bad = client.get("/v1/windows/held", params={"run_id": "run-h", "from_step_id": -1}, headers=bearer(admin))
    assert bad.status_code == 422 and "from_step_id" in bad.text
    assert client.get("/v1/windows/held", headers=bearer(admin)).status_code == 422  # no run_id
    ledger = Ledger(db_url)
    tenant_key = ledger.create_key("tenant-0")
    ledger.close()
    refused = client.get("/v1/windows/held", params={"run_id": "run-h"}, headers=bearer(tenant_key))
    assert refused.status_code == 403 and "run-h" not in refused.text


def test_exported_charges_count_window_usage_like_per_step_usage(client, admin, db_url):
    from llmvisor.billing.charges import usage_charges

    def by_key():
        ledger = Ledger(db_url)
        try:
            start_us = int(T0_S // 3600 * 3600 * 1_000_000)
            return {(c.engine_class, c.model_version, c.tenant): c.attributed_ns
                    for c in usage_charges(ledger, start_us, start_us + 2 * 3600 * 1_000_000)}
        finally:
            ledger.close()

    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": steps_of("run-s")}).status_code == 200
    per_step = by_key()
    assert per_step and all(version == 1 for _, version, _ in per_step)
    answer = client.post("/v1/windows", headers=bearer(admin), json={"windows": windows_of(client, admin, "run-w", steps_of("run-w"))})
    assert answer.status_code == 200, answer.text
    # the same steps metered in windows are charged under the same class and version, the same nanoseconds again
    assert by_key() == {key: 2 * ns for key, ns in per_step.items()}


def test_the_model_versions_that_billed_a_tenant_include_those_of_its_windows(client, admin, db_url):
    answer = client.post("/v1/windows", headers=bearer(admin), json={"windows": windows_of(client, admin, "run-w", steps_of("run-w"))})
    assert answer.status_code == 200, answer.text
    ledger = Ledger(db_url)
    try:
        tenant = ledger.request_usage(limit=1)[0].tenant
        assert ledger.billing_versions(tenant=tenant) == [(CLASS_W, 1)]
        assert ledger.billing_versions(tenant="nobody") == []
    finally:
        ledger.close()


def test_a_window_of_a_busy_engine_may_be_as_large_as_a_steps_body_and_a_tenant_key_is_refused(client, admin, db_url):
    """A window lists every request of its steps: a busy engine's is hundreds of kilobytes, past the 64 KiB other
    routes take; POST /v1/windows is ingest and takes what POST /v1/steps takes (and needs an admin key)."""
    groups = steps_of("run-big", 200)
    for group in groups:
        for k, row in enumerate(group):
            row["request_id"] = f"request-{row['step_id']}-{k}-" + "x" * 60
    windows = windows_of(client, admin, "run-big", groups)
    body = json.dumps({"windows": windows}).encode()
    assert len(body) > 64 * 1024
    answer = client.post("/v1/windows", headers={**bearer(admin), "Content-Type": "application/json"}, content=body)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["steps_covered"] == 200
    ledger = Ledger(db_url)
    try:
        tenant_key = ledger.create_key("tenant-0")
    finally:
        ledger.close()
    refused = client.post("/v1/windows", headers={**bearer(tenant_key), "Content-Type": "application/json"}, content=body)
    assert refused.status_code == 403


def test_the_services_metrics_count_each_stored_window_once(client, admin):
    """The service's /metrics count what window ingest stored, as they count stored steps: per tenant the windows'
    attributed seconds (the dashboard's service source works in window mode too), a re-send not again."""
    from prometheus_client.parser import text_string_to_metric_families

    def attributed_seconds() -> dict[str, float]:
        text = client.get("/metrics", headers=bearer(admin)).text
        return {s.labels["tenant"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "llmvisor_attributed_seconds_total"}

    windows = windows_of(client, admin, "run-m", steps_of("run-m"))
    for _ in range(2):
        assert client.post("/v1/windows", headers=bearer(admin), json={"windows": windows}).status_code == 200
    billed = tenants(client, admin)
    counted = attributed_seconds()
    assert billed and set(counted) == set(billed)
    for tenant, ns in billed.items():
        assert counted[tenant] == pytest.approx(ns / 1e9, rel=1e-12), tenant


def test_a_service_keeping_no_request_rows_bills_the_same_tenants_and_lists_no_window_requests(model_path, db_url, admin, monkeypatch):
    """LLMVISOR_REQUEST_TOTALS=0: tenant usage and totals as with the rows kept, GET /v1/usage/requests lists no request
    of window-metered runs (their usage is in the archive); a value other than 1 or 0 is refused at start."""
    answers = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("LLMVISOR_REQUEST_TOTALS", setting)
        with TestClient(create_app(model_path, db_url)) as c:
            if setting == "1":
                assert c.post("/v1/models", headers=bearer(admin), json={"model": class_model(CLASS_W).to_dict(),
                              "engine_class": CLASS_W, "activate": True}).status_code == 201
            run = f"run-{setting}"
            before = tenants(c, admin)
            # the same work 1,000 s later: the same bill, not a re-send of the first run
            steps = steps_of(run, start_s=T0_S + (1000.0 if setting == "0" else 0.0))
            assert c.post("/v1/windows", headers=bearer(admin), json={"windows": windows_of(c, admin, run, steps)}).status_code == 200
            after = tenants(c, admin)
            answers[setting] = ({t: ns - before.get(t, 0) for t, ns in after.items()},
                                c.get("/v1/usage/requests", headers=bearer(admin), params={"run_id": run}).json()["requests"])
            one = c.get("/v1/usage/requests", headers=bearer(admin), params={"run_id": run, "request_id": steps[0][0]["request_id"]})
            assert one.status_code == (200 if setting == "1" else 404), one.text
            assert ("LLMVISOR_REQUEST_TOTALS=0" in one.text) == (setting == "0")
    (kept_tenants, kept_requests), (left_tenants, left_requests) = answers["1"], answers["0"]
    assert kept_tenants == left_tenants and sum(kept_tenants.values()) > 0
    assert sum(r["attributed_ns"] for r in kept_requests) == sum(kept_tenants.values()) and left_requests == []
    monkeypatch.setenv("LLMVISOR_REQUEST_TOTALS", "maybe")
    with pytest.raises(Exception, match=r"LLMVISOR_REQUEST_TOTALS='maybe': give 1 or 0"):
        create_app(model_path, db_url)
