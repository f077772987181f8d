"""The HTTP API in process (FastAPI's TestClient) over real databases: ingest, validation, isolation, metrics."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from _service_fixtures import T0_S, bearer, db_url, keys, ledger, make_steps, measured_ns, model_path  # noqa: F401
from llmvisor.core.trace import trace_from_rows, write_trace
from llmvisor.service.app import create_app


@pytest.fixture
def app(model_path, db_url, keys):
    return create_app(model_path, db_url, max_body_bytes=2_000_000, max_steps_per_request=500)


@pytest.fixture
def client(app):
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def admin(keys):
    return bearer(keys["admin"])


def post(client, groups, headers):
    return client.post("/v1/steps", json={"steps": groups}, headers=headers)


def totals(client, admin):
    response = client.get("/v1/usage/totals", headers=admin)
    assert response.status_code == 200
    return response.json()


def metric_values(client, admin) -> dict[tuple[str, tuple], float]:
    text = client.get("/metrics", headers=admin).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_ingest_is_idempotent_and_reconciles(client, admin):
    groups = make_steps(n_steps=40)
    first = post(client, groups, admin)
    assert first.status_code == 200
    body = first.json()
    assert body["steps_inserted"] == 40 and body["steps_duplicate"] == 0
    assert body["attributed_ns"] == measured_ns(groups)
    again = post(client, groups[::-1], admin).json()
    assert again["steps_inserted"] == 0 and again["steps_duplicate"] == 40 and again["attributed_ns"] == 0
    result = totals(client, admin)
    assert result["num_steps"] == 40 and result["measured_ns"] == result["attributed_ns"] == measured_ns(groups)


def as_columns(groups):
    rows = [row for group in groups for row in group]
    return {"columns": {name: [row.get(name) for row in rows] for name in rows[0]}}


def test_columns_form_is_the_same_ledger_entry_as_the_rows_form(client, admin):
    groups = make_steps(n_steps=30)
    first = client.post("/v1/steps", json=as_columns(groups[:20]), headers=admin).json()
    assert first["steps_inserted"] == 20 and first["attributed_ns"] == measured_ns(groups[:20])
    mixed = post(client, groups, admin).json()
    assert mixed["steps_duplicate"] == 20 and mixed["steps_inserted"] == 10
    again = client.post("/v1/steps", json=as_columns(groups[::-1]), headers=admin).json()
    assert again["steps_duplicate"] == 30
    changed = json.loads(json.dumps(groups[4:5]))
    changed[0][0]["num_new_tokens"] = 2 if changed[0][0]["phase"] == "prefill" else 1
    changed[0][0]["num_context_tokens"] += 1
    conflict = client.post("/v1/steps", json=as_columns(changed), headers=admin)
    assert conflict.status_code == 409 and conflict.json()["conflicting_steps"] == [{"run_id": "run-a", "step_id": 4}]
    assert totals(client, admin)["measured_ns"] == measured_ns(groups)
    assert client.post("/v1/steps", json={"columns": {}}, headers=admin).json()["steps_received"] == 0


def _columns(**changes):
    columns = {"run_id": ["r", "r"], "step_id": [1, 2], "step_latency_s": [0.02, 0.03], "request_id": ["q", "q"],
               "tenant": ["t", "u"], "num_new_tokens": [1, 1], "num_context_tokens": [10, 11], "phase": ["decode", "decode"]}
    columns.update(changes)
    return json.dumps({"columns": columns}).encode()


BAD_COLUMN_BODIES = [
    (b'{"columns": [1]}', 422, '"columns" must map'),
    (_columns(step_id=7), 422, "column step_id: expected a list"),
    (_columns(step_id=[1]), 422, "columns differ in length"),
    (_columns(step_id=[1.0, 2.0]), 422, "column step_id: expected integer values, got Arrow type double"),
    (_columns(step_id=[1, "2"]), 422, "column step_id"),
    (_columns(step_id=[1, 2**70]), 422, "column step_id"),
    (_columns(step_id=[1, None]), 422, "row 2: step_id: missing value"),
    (_columns(num_new_tokens=[True, 1]), 422, "num_new_tokens"),
    (_columns(phase=["decode", "idle"]), 422, 'row 2: phase: must be "prefill" or "decode"'),
    (_columns(tenant=["t", {"a": 1}]), 422, "tenant"),
    (_columns(tenant=["t", "u\x00"]), 422, "NUL"),
    (_columns(step_id=[1, 1], step_latency_s=[0.02, 0.02]), 422, "appears twice in one step"),
    (_columns(timestamp_s=[1.0, "noon"]), 422, "timestamp_s: expected Unix seconds"),
    (json.dumps({"columns": {"run_id": ["r"]}}).encode(), 422, "missing column(s) step_id"),
    (b'{"columns": {"run_id": ["r\\ud800", "r"], "step_id": [1, 2], "step_latency_s": [0.1, 0.1], "request_id": ["q", "q"], '
     b'"tenant": ["t", "t"], "num_new_tokens": [1, 1], "num_context_tokens": [1, 1], "phase": ["decode", "decode"]}}', 422, "column run_id"),
    (_columns(**{**{k: v * 501 for k, v in json.loads(_columns())["columns"].items()}, "step_id": list(range(1002))}), 413,
     "steps, at most 500"),
]


@pytest.mark.parametrize("body, status, message", BAD_COLUMN_BODIES, ids=[m for _, _, m in BAD_COLUMN_BODIES])
def test_malformed_column_payloads_get_4xx_with_the_reason(client, admin, body, status, message):
    response = client.post("/v1/steps", content=body, headers={**admin, "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    assert totals(client, admin)["num_steps"] == 0


PARQUET = {"Content-Type": "application/vnd.apache.parquet"}


def parquet_body(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def test_a_parquet_trace_file_is_the_same_ledger_entry_as_the_json_forms(client, admin, tmp_path):
    groups = make_steps(n_steps=30)
    path = tmp_path / "steps.parquet"
    write_trace(trace_from_rows([dict(r, engine="vllm") for g in groups[:20] for r in g]), path)
    first = client.post("/v1/steps", content=path.read_bytes(), headers={**admin, **PARQUET})
    assert first.status_code == 200, first.text
    assert first.json()["steps_inserted"] == 20 and first.json()["attributed_ns"] == measured_ns(groups[:20])
    mixed = post(client, groups, admin).json()
    assert mixed["steps_duplicate"] == 20 and mixed["steps_inserted"] == 10
    table = pa.Table.from_pylist([r for g in groups for r in g])
    again = client.post("/v1/steps", content=parquet_body(table), headers={**admin, "Content-Type": "application/vnd.apache.parquet; x=1"})
    assert again.json()["steps_duplicate"] == 30
    assert totals(client, admin)["measured_ns"] == measured_ns(groups)


def _parquet_table(**changes) -> pa.Table:
    """Rows of three steps; each change is a column name to drop (None) or to replace by ``f(num_rows)``."""
    table = pa.Table.from_pylist([r for g in make_steps(n_steps=3, batch_size=4, seed=9) for r in g])
    for name, make in changes.items():
        if make is None:
            table = table.drop_columns([name])
        else:
            table = table.set_column(table.schema.get_field_index(name), name, make(table.num_rows))
    return table


BAD_PARQUET_BODIES = [
    (b"PAR1 not really", 400, "not a readable Parquet file"),
    (parquet_body(_parquet_table(tenant=None)), 422, "missing column(s) tenant"),
    (parquet_body(_parquet_table(step_id=lambda n: pa.array([0.0] * n))), 422, "step_id: expected integer values"),
    (parquet_body(_parquet_table(phase=lambda n: pa.array(["decode"] * (n - 1) + [None]))), 422, "phase: missing value"),
    (parquet_body(_parquet_table(timestamp_s=lambda n: pa.array(["noon"] * n))), 422, "timestamp_s: expected Unix seconds"),
    (parquet_body(_parquet_table(num_new_tokens=lambda n: pa.array([0] * n))), 422, "num_new_tokens"),
    (parquet_body(pa.Table.from_pylist([r for g in make_steps(n_steps=501, batch_size=1) for r in g])), 413, "steps, at most 500"),
]


@pytest.mark.parametrize("body, status, message", BAD_PARQUET_BODIES, ids=[m for _, _, m in BAD_PARQUET_BODIES])
def test_malformed_parquet_bodies_get_4xx_with_the_reason(client, admin, body, status, message):
    response = client.post("/v1/steps", content=body, headers={**admin, **PARQUET})
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    assert totals(client, admin)["num_steps"] == 0


def test_conflicting_resend_is_409_naming_the_step_and_stores_nothing(client, admin):
    groups = make_steps(n_steps=10)
    post(client, groups, admin)
    before = totals(client, admin)
    changed = json.loads(json.dumps(groups[3:5]))
    changed[0][0]["tenant"] = "someone-else"
    response = post(client, make_steps(n_steps=3, first_step=50) + changed, admin)
    assert response.status_code == 409
    assert "step 3 of run 'run-a'" in response.json()["detail"]
    assert response.json()["conflicting_steps"] == [{"run_id": "run-a", "step_id": 3}]
    assert totals(client, admin) == before


def _rows(**changes):
    row = {"run_id": "r", "step_id": 1, "step_latency_s": 0.02, "request_id": "q", "tenant": "t",
           "num_new_tokens": 1, "num_context_tokens": 10, "phase": "decode"}
    row.update(changes)
    return row


BAD_BODIES = [
    (b"not json", 400, "not valid JSON"),
    (b"[1, 2]", 422, "expected a JSON object"),
    (b'{"rows": []}', 422, "expected a JSON object"),
    (b'{"steps": {"a": 1}}', 422, '"steps" must be a list'),
    (b'{"steps": [[]]}', 422, "steps[0]: expected a non-empty list"),
    (b'{"steps": [[1]]}', 422, "steps[0][0]: expected a JSON object"),
    (b'{"steps": [[{"run_id": "r"}]]}', 422, "missing column(s) step_id"),
    (json.dumps({"steps": [[_rows(phase="idle")]]}).encode(), 422, 'row 1 (steps[0][0]): phase: must be "prefill" or "decode"'),
    (json.dumps({"steps": [[_rows()], [_rows(step_id=2, num_new_tokens=0)]]}).encode(), 422, "row 2 (steps[1][0]): num_new_tokens"),
    (json.dumps({"steps": [[_rows(step_latency_s="fast")]]}).encode(), 422, "step_latency_s: expected a number"),
    (json.dumps({"steps": [[_rows(step_latency_s=-1)]]}).encode(), 422, "latency must be > 0"),
    (json.dumps({"steps": [[_rows(), _rows()]]}).encode(), 422, "appears twice in one step"),
    (json.dumps({"steps": [[_rows(), _rows(request_id="p", step_latency_s=0.03)]]}).encode(), 422, "disagree on step_latency_s"),
    (json.dumps({"steps": [[_rows()], [_rows(request_id="p")]]}).encode(), 422, "steps[1]: step 1 of run 'r' is also steps[0]"),
    (json.dumps({"steps": [[_rows(), _rows(step_id=2)]]}).encode(), 422, "steps[0][1]: row of step 2"),
    (json.dumps({"steps": [[_rows(step_id=2**70)]]}).encode(), 422, "out of range"),
    (json.dumps({"steps": [[_rows(num_context_tokens=10**12)]]}).encode(), 422, "num_context_tokens"),
    (json.dumps({"steps": [[_rows(tenant="a\x00b")]]}).encode(), 422, "NUL"),
    (json.dumps({"steps": [[_rows(request_id="x" * 600)]]}).encode(), 422, "at most 512"),
    (b'{"steps": [[{"run_id": "r\\ud800", "step_id": 1, "step_latency_s": 0.1, "request_id": "q", "tenant": "t", '
     b'"num_new_tokens": 1, "num_context_tokens": 1, "phase": "decode"}]]}', 422, "not valid Unicode"),
    (json.dumps({"steps": [[_rows(timestamp_s="yesterday")]]}).encode(), 422, "timestamp_s: expected Unix seconds"),
    (json.dumps({"steps": [[_rows(timestamp_s=1.0), _rows(request_id="p", timestamp_s=2.0)]]}).encode(), 422, "disagree on timestamp_s"),
    (json.dumps({"steps": [[_rows(step_latency_s=1e7)]]}).encode(), 422, "at most 1e+06 s"),
    (json.dumps({"steps": [[_rows(step_id=i)] for i in range(501)]}).encode(), 413, "at most 500 per request"),
    (b'{"steps": [[' + b" " * 2_000_001 + b"]]}", 413, "at most 2000000"),
]


@pytest.mark.parametrize("body, status, message", BAD_BODIES, ids=[m for _, _, m in BAD_BODIES])
def test_malformed_payloads_get_4xx_with_the_reason_and_store_nothing(client, admin, body, status, message):
    post(client, make_steps(n_steps=3), admin)
    before = totals(client, admin)
    response = client.post("/v1/steps", content=body, headers={**admin, "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    assert "Traceback" not in response.text
    assert totals(client, admin) == before


def test_ingest_needs_an_admin_key(client, keys):
    groups = make_steps(n_steps=2)
    assert post(client, groups, {}).status_code == 401
    assert post(client, groups, bearer("lvk_0000_nope")).status_code == 401
    assert post(client, groups, {"Authorization": "Basic abc"}).status_code == 401
    assert post(client, groups, bearer(keys["tenant-0"])).status_code == 403


def _seed_two_tenants(client, admin):
    groups = make_steps("run-a", 30, batch_size=6, n_tenants=2, step_interval_s=50.0)
    assert post(client, groups, admin).status_code == 200
    return groups


def test_a_tenant_key_reads_only_its_own_tenant_on_every_read_path(app, client, admin, keys):
    _seed_two_tenants(client, admin)
    other = bearer(keys["tenant-1"])
    # Every route is listed here, so a new read path fails this test until its isolation is checked.
    routes = {(method, route.path) for route in app.routes if isinstance(route, APIRoute) for method in route.methods}
    assert routes == {
        ("POST", "/v1/steps"), ("GET", "/v1/usage/tenants"), ("GET", "/v1/usage/requests"), ("GET", "/v1/usage/top"),
        ("GET", "/v1/usage/totals"), ("GET", "/v1/whoami"), ("POST", "/v1/keys"), ("GET", "/v1/keys"),
        ("DELETE", "/v1/keys/{key_id}"), ("GET", "/metrics"), ("GET", "/healthz"), ("GET", "/v1/steps/{run_id}/{step_id}"),
        ("GET", "/v1/models"), ("POST", "/v1/models"), ("POST", "/v1/models/{engine_class}/{version}/activate"),
        ("GET", "/v1/models/drift"), ("GET", "/v1/adjustments"), ("GET", "/v1/runs/{run_id}/gaps"),
        ("GET", "/v1/usage/requests/{request_id}"), ("GET", "/v1/usage/classes"), ("GET", "/v1/prices"), ("POST", "/v1/prices"), ("POST", "/v1/windows"), ("GET", "/v1/models/{engine_class}/active"),
        ("GET", "/v1/windows/held"), ("POST", "/v1/runs/{run_id}/end"),
        ("GET", "/usage"), ("GET", "/usage/app.js"), ("GET", "/usage/style.css"),  # the page's static files: no data
    }
    forbidden = [
        ("GET", "/v1/adjustments?tenant=tenant-0"),
        ("GET", "/v1/usage/tenants?tenant=tenant-0"),
        ("GET", "/v1/usage/tenants?tenant=tenant-0&bucket=hour"),
        ("GET", "/v1/usage/requests?tenant=tenant-0"),
        ("GET", "/v1/usage/classes?tenant=tenant-0"),
        ("GET", "/v1/usage/top"),
        ("GET", "/v1/usage/totals"),
        ("GET", "/v1/keys"),
        ("POST", "/v1/keys"),
        ("DELETE", f"/v1/keys/{keys['tenant-0'].split('_')[1]}"),
        ("GET", "/metrics"),
        ("POST", "/v1/steps"),
        ("GET", "/v1/steps/run-a/0"),
        ("GET", "/v1/models"),
        ("POST", "/v1/models"),
        ("POST", "/v1/models/abc/1/activate"),
        ("GET", "/v1/models/drift"),
        ("GET", "/v1/runs/run-a/gaps"),
        ("POST", "/v1/prices"),
        ("POST", "/v1/windows"),
        ("GET", "/v1/models/abc/active"),
        ("GET", "/v1/windows/held?run_id=run-a"),
        ("POST", "/v1/runs/run-a/end"),
    ]
    for method, path in forbidden:
        kwargs = {"json": {"tenant": "tenant-0"}} if path == "/v1/keys" and method == "POST" else {}
        if path == "/v1/models" and method == "POST":
            kwargs = {"json": {"model": {}, "engine_class": "tenant-0"}}
        if path == "/v1/steps":
            kwargs = {"json": {"steps": make_steps(n_steps=1, first_step=999)}}
        if path.endswith("/end"):
            kwargs = {"json": {"last_step_id": 29, "num_steps": 30}}
        response = client.request(method, path, headers=other, **kwargs)
        assert response.status_code == 403, (method, path, response.text)
        assert "tenant-0" not in response.text.replace("tenant=tenant-0", "")

    # tenant-0's request, looked up with tenant-1's key: not found (its existence is not revealed either).
    hidden = client.get("/v1/usage/requests?run_id=run-a&request_id=req-0", headers=other)
    assert hidden.status_code == 404
    assert client.get("/v1/usage/requests?run_id=run-a&request_id=req-0", headers=bearer(keys["tenant-0"])).status_code == 200
    assert client.get("/v1/usage/requests/req-0", headers=other).status_code == 404
    assert client.get("/v1/usage/requests/req-0", headers=bearer(keys["tenant-0"])).json()["tenant"] == "tenant-0"
    assert client.get("/v1/usage/classes", headers=other).json()["tenant"] == "tenant-1"

    # Unfiltered reads with tenant-1's key see tenant-1 only.
    own = client.get("/v1/usage/tenants?bucket=minute", headers=other).json()
    assert [t["tenant"] for t in own["tenants"]] == ["tenant-1"]
    requests = client.get("/v1/usage/requests", headers=other).json()["requests"]
    assert requests and {r["tenant"] for r in requests} == {"tenant-1"}
    assert client.get("/v1/usage/tenants?tenant=tenant-1", headers=other).status_code == 200
    assert client.get("/v1/whoami", headers=other).json()["tenant"] == "tenant-1"

    assert client.get("/v1/adjustments", headers=other).json() == {"adjustments": []}
    for path in ("/v1/usage/tenants", "/v1/usage/requests", "/v1/usage/top", "/v1/usage/totals", "/v1/keys", "/metrics",
                 "/v1/whoami", "/v1/steps/run-a/0", "/v1/adjustments", "/v1/usage/requests/req-0", "/v1/usage/classes"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers=bearer("lvk_x_y")).status_code == 401


def test_usage_queries_sum_to_the_totals_in_every_bucket_and_range(client, admin):
    groups = _seed_two_tenants(client, admin)
    total_ns = measured_ns(groups)
    for bucket in ("minute", "hour", "day"):
        tenants = client.get(f"/v1/usage/tenants?bucket={bucket}", headers=admin).json()["tenants"]
        assert sum(t["attributed_ns"] for t in tenants) == total_ns
        for tenant in tenants:
            assert sum(b["attributed_ns"] for b in tenant["buckets"]) == tenant["attributed_ns"]
    split_s = T0_S + 15 * 50.0
    iso = "2025-06-15T15:19:10+00:00"  # split_s written as ISO 8601; "+" sent unescaped reads as a space
    left = client.get(f"/v1/usage/tenants?end={iso}", headers=admin).json()["tenants"]
    assert left == client.get("/v1/usage/tenants", params={"end": iso}, headers=admin).json()["tenants"]
    right = client.get(f"/v1/usage/tenants?start={split_s}", headers=admin).json()["tenants"]
    assert sum(t["attributed_ns"] for t in left + right) == total_ns
    assert sum(t["attributed_ns"] for t in left) == measured_ns(groups[:15])
    top = client.get("/v1/usage/top?n=1", headers=admin).json()["tenants"]
    everyone = client.get("/v1/usage/tenants", headers=admin).json()["tenants"]
    assert top[0]["attributed_ns"] == max(t["attributed_ns"] for t in everyone)
    requests = client.get("/v1/usage/requests?limit=10000", headers=admin).json()["requests"]
    assert sum(r["attributed_ns"] for r in requests) == total_ns
    page = client.get("/v1/usage/requests?limit=2&offset=1", headers=admin).json()["requests"]
    assert page == requests[1:3]


@pytest.mark.parametrize(
    "query, message",
    [
        ("/v1/usage/tenants?bucket=week", "bucket"),
        ("/v1/usage/tenants?start=soon", "start: expected an ISO 8601 time or Unix seconds"),
        ("/v1/usage/tenants?start=nan", "out of range"),
        ("/v1/usage/tenants?start=10&end=5", "end must be after start"),
        ("/v1/usage/tenants?start=10.5", "usage is kept per second; give a whole second, not '10.5'"),
        ("/v1/usage/totals?end=2025-06-15T15:19:10.25", "end: usage is kept per second"),
        ("/v1/usage/top?n=0", "'n'"),
        ("/v1/usage/requests?limit=100000", "'limit'"),
        ("/v1/usage/requests?tenant=a%00b", "NUL"),
    ],
)
def test_bad_query_parameters_are_422_with_a_message(client, admin, query, message):
    response = client.get(query, headers=admin)
    assert response.status_code == 422
    assert message in response.json()["detail"]


def test_a_step_reads_back_with_its_shares_for_an_admin(client, admin):
    groups = make_steps(n_steps=5, batch_size=6, seed=2)
    assert post(client, groups, admin).status_code == 200
    step = client.get("/v1/steps/run-a/3", headers=admin)
    assert step.status_code == 200
    body = step.json()
    assert body["measured_ns"] == measured_ns(groups[3:4])
    assert sum(x["attributed_ns"] for x in body["slices"]) == body["measured_ns"]
    assert sorted(x["request_id"] for x in body["slices"]) == sorted(r["request_id"] for r in groups[3])
    assert [x["request_id"] for x in body["slices"]] == sorted(x["request_id"] for x in body["slices"])
    missing = client.get("/v1/steps/run-a/99", headers=admin)
    assert missing.status_code == 404 and "no step 99 of run 'run-a'" in missing.json()["detail"]
    assert client.get("/v1/steps/run-a/x", headers=admin).status_code == 422


def test_metrics_count_what_was_ingested_and_rejected(client, admin):
    groups = _seed_two_tenants(client, admin)
    post(client, groups[:10], admin)
    changed = json.loads(json.dumps(groups[:1]))
    changed[0][0]["num_context_tokens"] += 1
    assert post(client, changed, admin).status_code == 409
    assert client.post("/v1/steps", content=b"{", headers=admin).status_code == 400
    assert post(client, [[_rows(phase="x")]], admin).status_code == 422
    values = metric_values(client, admin)
    tenants = client.get("/v1/usage/tenants", headers=admin).json()["tenants"]
    for tenant in tenants:
        counted = values[("llmvisor_attributed_seconds_total", (("tenant", tenant["tenant"]),))]
        assert counted == pytest.approx(tenant["attributed_ns"] / 1e9, rel=1e-12)
    assert values[("llmvisor_measured_seconds_total", ())] == pytest.approx(measured_ns(groups) / 1e9, rel=1e-12)
    assert values[("llmvisor_steps_ingested_total", ())] == 30
    assert values[("llmvisor_steps_duplicate_total", ())] == 10
    assert values[("llmvisor_slices_ingested_total", ())] == sum(len(g) for g in groups)
    assert values[("llmvisor_ingest_errors_total", (("reason", "conflict"),))] == 1
    assert values[("llmvisor_ingest_errors_total", (("reason", "bad_json"),))] == 1
    assert values[("llmvisor_ingest_errors_total", (("reason", "invalid_trace"),))] == 1
    assert values[("llmvisor_model_residual_seconds_count", ())] == 30
    assert values[("llmvisor_model_residual_distribution_seconds_bucket", (("le", "+Inf"),))] == 30
    assert values[("llmvisor_model_abs_relative_residual_count", ())] == 30
    model = client.app.state.model
    from llmvisor.service.ingest import validate_trace

    trace = validate_trace(groups)
    residual_sum = float((trace.step_latency_s_per_step - model.predict(trace)).sum())
    assert values[("llmvisor_model_residual_seconds_sum", ())] == pytest.approx(residual_sum, rel=1e-9, abs=1e-12)


def test_keys_through_the_api(client, admin):
    created = client.post("/v1/keys", json={"tenant": "tenant-7"}, headers=admin)
    assert created.status_code == 201
    key = created.json()["key"]
    assert client.get("/v1/whoami", headers=bearer(key)).json() == {"key_id": created.json()["key_id"], "tenant": "tenant-7", "is_admin": False}
    listed = client.get("/v1/keys", headers=admin).json()
    assert key not in json.dumps(listed) and created.json()["key_id"] in json.dumps(listed)
    assert client.post("/v1/keys", json={"tenant": "x", "admin": True}, headers=admin).status_code == 422
    assert client.post("/v1/keys", json={}, headers=admin).status_code == 422
    assert client.delete(f"/v1/keys/{created.json()['key_id']}", headers=admin).status_code == 204
    assert client.get("/v1/whoami", headers=bearer(key)).status_code == 401
    assert client.delete(f"/v1/keys/{created.json()['key_id']}", headers=admin).status_code == 404


def test_health_openapi_and_public_metrics(model_path, db_url, keys):
    with TestClient(create_app(model_path, db_url, public_metrics=True)) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/metrics").status_code == 200
        spec = client.get("/openapi.json").json()
        schema = spec["paths"]["/v1/steps"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        rows, columns = schema["oneOf"]
        assert rows["properties"]["steps"]["items"]["items"]["required"][:2] == ["run_id", "step_id"]
        assert columns["properties"]["columns"]["properties"]["step_id"] == {"type": "array", "items": {"type": "integer"}}
        assert "bearer" in json.dumps(spec["components"]["securitySchemes"]).lower()
