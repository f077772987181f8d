"""`GET /v1/usage/requests/{id}` by the id the OpenAI server answered with, `/v1/usage/classes`, and the usage page's
headers, over a real SQLite ledger and PostgreSQL where one is set up (FastAPI's TestClient): a tenant key reads its own requests and nothing else."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from _service_fixtures import bearer, db_url, model_path  # noqa: F401
from _usage_data import ACME_COMPLETION, ACME_OTHER, ENGINE_IDS, GLOBEX_CHAT, usage_steps
from llmvisor.ledger import Ledger
from llmvisor.service.app import create_app


@pytest.fixture
def served(model_path, db_url):  # noqa: F811
    ledger = Ledger(db_url)
    keys = {"admin": ledger.create_key(is_admin=True), "acme": ledger.create_key("acme"), "globex": ledger.create_key("globex")}
    ledger.close()
    app = create_app(model_path, db_url, fallback_model_path=model_path)
    with TestClient(app) as client:
        response = client.post("/v1/steps", json={"steps": usage_steps()}, headers=bearer(keys["admin"]))
        assert response.status_code == 200, response.text
        yield client, {name: bearer(key) for name, key in keys.items()}


def engine_rows(client, headers, tenant):
    response = client.get("/v1/usage/requests", params={"tenant": tenant, "limit": 100}, headers=headers)
    return response.json()["requests"]


def test_a_caller_reads_its_completion_by_the_id_it_was_answered_with(served):
    client, keys = served
    rows = engine_rows(client, keys["admin"], "acme")
    parts = [r for r in rows if r["request_id"] in ENGINE_IDS["acme"][:2]]
    assert len(parts) == 4  # two prompts, each on two runs
    response = client.get(f"/v1/usage/requests/{ACME_COMPLETION}", headers=keys["acme"])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tenant"] == "acme" and body["runs"] == sorted({p["run_id"] for p in parts})
    assert body["attributed_ns"] == sum(p["attributed_ns"] for p in parts) > 0
    assert body["num_new_tokens"] == sum(p["num_new_tokens"] for p in parts)
    assert sorted((p["run_id"], p["request_id"]) for p in body["parts"]) == sorted((p["run_id"], p["request_id"]) for p in parts)
    # The engine's own id works too, and names that request alone.
    engine_id = ENGINE_IDS["acme"][0]
    exact = client.get(f"/v1/usage/requests/{engine_id}", headers=keys["acme"]).json()
    assert exact["attributed_ns"] == sum(r["attributed_ns"] for r in rows if r["request_id"] == engine_id) and len(exact["parts"]) == 2


def test_a_tenant_key_never_reads_another_tenants_request(served):
    client, keys = served
    assert client.get(f"/v1/usage/requests/{GLOBEX_CHAT}", headers=keys["globex"]).status_code == 200
    refused = client.get(f"/v1/usage/requests/{GLOBEX_CHAT}", headers=keys["acme"])
    assert refused.status_code == 404 and "globex" not in refused.text
    assert client.get(f"/v1/usage/requests/{ACME_OTHER}", headers=keys["globex"]).status_code == 404
    assert client.get("/v1/usage/requests/cmpl-unknown", headers=keys["acme"]).status_code == 404
    assert client.get(f"/v1/usage/requests/{GLOBEX_CHAT}").status_code == 401
    # A prefix that is not the whole caller id matches nothing: only vLLM's suffixes are added.
    assert client.get(f"/v1/usage/requests/{ACME_COMPLETION[:-4]}", headers=keys["acme"]).status_code == 404
    assert client.get("/v1/usage/requests/cmpl-%25", headers=keys["acme"]).status_code == 404  # '%' is no wildcard


def test_class_usage_per_tenant_sums_to_its_usage_and_names_the_billing_versions(served):
    client, keys = served
    for tenant in ("acme", "globex"):
        classes = client.get("/v1/usage/classes", params={"bucket": "hour"}, headers=keys[tenant]).json()
        usage = client.get("/v1/usage/tenants", headers=keys[tenant]).json()["tenants"]
        assert classes["tenant"] == tenant and [u["tenant"] for u in usage] == [tenant]
        assert sum(b["attributed_ns"] for b in classes["buckets"]) == usage[0]["attributed_ns"]
        assert {b["engine_class"] for b in classes["buckets"]} == {"", "00000000c0ffee01"}
        assert len({b["start"] for b in classes["buckets"]}) >= 2  # two hours of steps
        assert {(v["engine_class"], v["model_version"]) for v in classes["model_versions"]} == {("", None), ("00000000c0ffee01", None)}
    assert client.get("/v1/usage/classes", params={"tenant": "globex"}, headers=keys["acme"]).status_code == 403


def test_the_usage_page_is_open_and_served_with_a_strict_policy(served):
    client, _keys = served
    for path, kind in (("/usage", "text/html"), ("/usage/app.js", "text/javascript"), ("/usage/style.css", "text/css")):
        response = client.get(path)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        policy = response.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src 'self'" in policy and "unsafe" not in policy
        assert response.headers["x-content-type-options"] == "nosniff"
    page = client.get("/usage").text
    assert "<script src=\"/usage/app.js\"" in page and "http" not in page.replace("http-equiv", "")  # nothing from elsewhere


def test_tenant_usage_carries_its_cost_per_currency_once_priced(served, db_url):  # noqa: F811
    """Two classes priced in two currencies: each tenant's cost is its per-class, per-hour usage × price, rounded
    half to even once per line group (class and month) (computed here from /v1/usage/classes with exact fractions), per currency; a tenant key
    reads only its own; unpriced or not on whole hours, no cost."""
    from decimal import Decimal
    from fractions import Fraction

    from llmvisor.billing import tenant_cost
    from llmvisor.service.routes.usage import COST_END_US

    client, keys = served
    assert all(t["cost"] is None for t in client.get("/v1/usage/tenants", headers=keys["admin"]).json()["tenants"])
    prices = {"": ("EUR", "987654.25"), "00000000c0ffee01": ("USD", "123456.7")}
    body = {"prices": [{"engine_class": c, "currency": cur, "engine_hour_price": p, "valid_from": 0} for c, (cur, p) in prices.items()]}
    assert client.post("/v1/prices", json=body, headers=keys["admin"]).status_code == 201
    everyone = {t["tenant"]: t for t in client.get("/v1/usage/tenants", headers=keys["admin"]).json()["tenants"]}
    assert set(everyone) == {"acme", "globex"}
    for tenant in ("acme", "globex"):
        exact: dict[tuple[str, str], Fraction] = {}  # rounded once per line group (class; one month of data here)
        for b in client.get("/v1/usage/classes", params={"bucket": "hour"}, headers=keys[tenant]).json()["buckets"]:
            currency, price = prices[b["engine_class"]]
            key = (currency, b["engine_class"])
            exact[key] = exact.get(key, Fraction(0)) + Fraction(b["attributed_ns"]) * Fraction(price) * 100 / 3_600_000_000_000
        expected: dict[str, Decimal] = {}
        for (currency, _), amount in exact.items():
            expected[currency] = expected.get(currency, Decimal("0.00")) + Decimal(round(amount)).scaleb(-2)
        [own] = client.get("/v1/usage/tenants", headers=keys[tenant]).json()["tenants"]
        assert own["cost"] == everyone[tenant]["cost"] == {c: str(v) for c, v in sorted(expected.items())}
        assert set(own["cost"]) == {"EUR", "USD"} and all(Decimal(v) > 0 for v in own["cost"].values())
        ledger = Ledger(db_url)
        assert own["cost"] == {c: str(v) for c, v in tenant_cost(ledger, tenant, 0, COST_END_US).items()}
        ledger.close()
        bucketed = client.get("/v1/usage/tenants", params={"bucket": "hour"}, headers=keys[tenant]).json()["tenants"][0]
        assert bucketed["cost"] == own["cost"]
    assert client.get("/v1/usage/tenants", params={"tenant": "globex"}, headers=keys["acme"]).status_code == 403
    partial = client.get("/v1/usage/tenants", params={"start": "2000-01-01T00:00:30Z"}, headers=keys["acme"]).json()["tenants"]
    assert partial and partial[0]["cost"] is None  # not a whole hour: no hourly charge is inside it exactly
