"""LoRA adapters through the service and the ledger (issue #38 item 6, schema 10): steps with adapters pushed per step
(rows, and the pusher's columns body) and as window aggregates bill each tenant the same, priced by the class's LoRA
model; each request's adapter is stored, ``/v1/usage/tenants?group_by=adapter`` splits a tenant's usage per adapter
exactly; pending steps keep their adapters until a model prices them; a schema-9 ledger is upgraded in place with its
usage unchanged. SQLite and PostgreSQL."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from _lora_runs import adapter_of_slices, as_rows, header_of, lora_model, relayed_lora_run
from _service_fixtures import T0_S, admin, bearer, db_url, model_path  # noqa: F401
from llmvisor.client.push import columns_body
from llmvisor.core.relayed import step_rows
from llmvisor.core.trace import trace_from_rows
from llmvisor.ledger import Ledger
from llmvisor.metering import WindowAggregator
from llmvisor.service.app import create_app
from llmvisor.service.ingest import prepare_batch

CLASS_L = "1a1a1a1a1a1a1a1a"



def activate(client, admin, model) -> int:
    added = client.post("/v1/models", headers=bearer(admin),
                        json={"model": model.to_dict(), "engine_class": CLASS_L, "activate": True})
    assert added.status_code == 201, added.text
    return added.json()["version"]


def expected_by_adapter(model, steps, run_id) -> dict[tuple[str, str], int]:
    """(tenant, adapter) → attributed ns of per-step ingest's own attribution (`prepare_batch`)."""
    rows = [row for group in as_rows(steps, run_id, CLASS_L) for row in group]
    records = prepare_batch(model, trace_from_rows(rows), received_at_us=0).records
    adapters = adapter_of_slices(steps)
    out: dict[tuple[str, str], int] = {}
    for request, tenant, ns in zip(records.request_id.tolist(), records.tenant.tolist(), records.attributed_ns.tolist()):
        key = (tenant, adapters[request])
        out[key] = out.get(key, 0) + ns
    return out


def by_adapter(client, admin) -> dict[tuple[str, str], int]:
    answer = client.get("/v1/usage/tenants", headers=bearer(admin), params={"group_by": "adapter"})
    assert answer.status_code == 200, answer.text
    out = {}
    for t in answer.json()["tenants"]:
        assert sum(a["attributed_ns"] for a in t["adapters"]) == t["attributed_ns"]
        out.update({(t["tenant"], a["lora_adapter"]): a["attributed_ns"] for a in t["adapters"]})
    return out


def test_steps_and_windows_with_adapters_are_billed_and_stored_per_adapter(model_path, db_url, admin):
    model = lora_model(CLASS_L)
    runs = {name: relayed_lora_run(name, 60, t0_s=T0_S, seed=seed) for name, seed in (("run-rows", 1), ("run-cols", 2), ("run-win", 3))}
    with TestClient(create_app(model_path, db_url)) as client:
        version = activate(client, admin, model)
        posted = client.post("/v1/steps", headers=bearer(admin), json={"steps": as_rows(runs["run-rows"], "run-rows", CLASS_L)})
        assert posted.status_code == 200, posted.text
        header = header_of("run-cols", CLASS_L)
        posted = client.post("/v1/steps", headers={**bearer(admin), "Content-Type": "application/json"},
                             content=columns_body([step_rows(header, step) for step in runs["run-cols"]]))
        assert posted.status_code == 200, posted.text
        agg = WindowAggregator("run-win", CLASS_L, lambda: (model, version), window_s=1.0)
        windows = [w for step in runs["run-win"] for w in agg.add(*step)] + agg.close()
        assert {w.format for w in windows} == {3}
        posted = client.post("/v1/windows", headers=bearer(admin), json={"windows": [w.to_json() for w in windows]})
        assert posted.status_code == 200, posted.text
        expected: dict[tuple[str, str], int] = {}
        for name, steps in runs.items():
            for key, ns in expected_by_adapter(model, steps, name).items():
                expected[key] = expected.get(key, 0) + ns
        assert len({adapter for _, adapter in expected}) == 3
        assert by_adapter(client, admin) == expected
        # each request's adapter, per step and in windows alike
        for name, steps in runs.items():
            rows = client.get("/v1/usage/requests", headers=bearer(admin), params={"run_id": name, "limit": 10_000}).json()["requests"]
            assert {r["request_id"]: r["lora_adapter"] for r in rows} == adapter_of_slices(steps)
        # a tenant's usage without the option is what it was: the sum over its adapters
        plain = client.get("/v1/usage/tenants", headers=bearer(admin)).json()["tenants"]
        assert all(t["adapters"] is None for t in plain)
        assert {t["tenant"]: t["attributed_ns"] for t in plain} == {
            tenant: sum(ns for (t, _), ns in expected.items() if t == tenant) for tenant, _ in expected}


def test_pending_steps_keep_their_adapters_until_a_lora_model_prices_them(model_path, db_url, admin):
    model = lora_model(CLASS_L)
    steps = relayed_lora_run("run-p", 40, t0_s=T0_S, seed=6)
    with TestClient(create_app(model_path, db_url)) as client:
        posted = client.post("/v1/steps", headers=bearer(admin), json={"steps": as_rows(steps, "run-p", CLASS_L)})
        assert posted.status_code == 200, posted.text
        assert client.get("/v1/usage/totals", headers=bearer(admin)).json()["pending_steps"] == 40
        activate(client, admin, model)
        assert by_adapter(client, admin) == expected_by_adapter(model, steps, "run-p")


def test_a_schema_9_ledger_is_upgraded_in_place_its_usage_unchanged(model_path, db_url, admin):
    base_steps = relayed_lora_run("run-old", 30, t0_s=T0_S, seed=7, lora_ranks=None)
    with TestClient(create_app(model_path, db_url)) as client:
        rows = as_rows(base_steps, "run-old", None)
        assert client.post("/v1/steps", headers=bearer(admin), json={"steps": rows}).status_code == 200
    ledger = Ledger(db_url)
    before = [(r.tenant, r.attributed_ns, r.num_new_tokens) for r in ledger.tenant_usage()]
    ledger.close()
    engine = create_engine(db_url)
    with engine.begin() as conn:  # what schema 9 had: no adapter columns, version 9
        for table in ("usage_per_second", "tenant_seconds", "request_totals", "billing_lines"):
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN lora_name"))
        conn.execute(text("UPDATE ledger_info SET value = '9' WHERE name = 'schema_version'"))
    engine.dispose()
    upgraded = Ledger(db_url)
    try:
        assert [(r.tenant, r.attributed_ns, r.num_new_tokens) for r in upgraded.tenant_usage()] == before
        assert {(r.tenant, r.lora_name) for r in upgraded.tenant_usage(by_adapter=True)} == {(t, "") for t, _, _ in before}
    finally:
        upgraded.close()
    with create_engine(db_url).connect() as conn:
        assert conn.execute(text("SELECT value FROM ledger_info WHERE name = 'schema_version'")).scalar() == "10"
    # and the upgraded ledger takes adapters
    model = lora_model(CLASS_L)
    steps = relayed_lora_run("run-new", 20, t0_s=T0_S + 100, seed=8)
    with TestClient(create_app(model_path, db_url)) as client:
        activate(client, admin, model)
        assert client.post("/v1/steps", headers=bearer(admin), json={"steps": as_rows(steps, "run-new", CLASS_L)}).status_code == 200
        got = by_adapter(client, admin)
    for key, ns in expected_by_adapter(model, steps, "run-new").items():
        assert got[key] - (dict(((t, ""), n) for t, n, _ in before).get(key, 0) if key[1] == "" else 0) == ns


def test_a_window_with_an_adapter_is_a_conflict_if_resent_with_another(model_path, db_url, admin):
    model = lora_model(CLASS_L)
    with TestClient(create_app(model_path, db_url)) as client:
        version = activate(client, admin, model)
        agg = WindowAggregator("run-x", CLASS_L, lambda: (model, version), window_s=60.0)
        steps = relayed_lora_run("run-x", 8, t0_s=T0_S, seed=9)
        (window,) = [w for step in steps for w in agg.add(*step)] + agg.close()
        body = window.to_json()
        assert client.post("/v1/windows", headers=bearer(admin), json={"windows": [body]}).status_code == 200
        other = json.loads(json.dumps(body))
        request = next(q for q in other["requests"] if q["lora_name"])
        request["lora_name"] = "someone-else"
        assert client.post("/v1/windows", headers=bearer(admin), json={"windows": [other]}).status_code == 409
