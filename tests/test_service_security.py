"""Requests that must cost the service little: bodies over the limits and keyless requests are refused before
the body is read (checked at the ASGI level, counting the bytes the app pulled), Parquet bombs are refused
before they are decoded, and the tenants named in /metrics are capped."""

from __future__ import annotations

import asyncio
import json
import re
import resource
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Route

from _service_fixtures import bearer, db_url, keys, ledger, make_steps, measured_ns, model_path  # noqa: F401
from llmvisor.service.app import create_app
from llmvisor.service.metrics import INGEST_ERROR_REASONS, ServiceMetrics

REPO = Path(__file__).resolve().parents[1]
BIG_BYTES = 30 * 1024 * 1024
CHUNK_BYTES = 64 * 1024
INGEST_LIMIT_BYTES = 4_000_000
SMALL_LIMIT_BYTES = 64 * 1024
PARQUET = {"Content-Type": "application/vnd.apache.parquet"}


@pytest.fixture
def app(model_path, db_url, keys):
    return create_app(model_path, db_url, max_body_bytes=INGEST_LIMIT_BYTES, max_small_body_bytes=SMALL_LIMIT_BYTES)


def call(app, method: str, path: str, headers: dict, total_bytes: int, *, declare_length: bool) -> tuple[int, int, bytes]:
    """One request straight through ASGI, its body (malformed JSON) sent in 64 KiB chunks; returns the status,
    the body bytes the app pulled and the answer."""
    pulled = 0
    sent = []

    async def receive():
        nonlocal pulled
        if pulled >= total_bytes and total_bytes:
            await asyncio.sleep(3600)  # the client waits for the answer; never reached when the app answers first
        chunk = (b"{" + b"x" * (CHUNK_BYTES - 1))[: min(CHUNK_BYTES, total_bytes - pulled)]
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": pulled < total_bytes}

    async def send(message):
        sent.append(message)

    header_list = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if declare_length:
        header_list.append((b"content-length", str(total_bytes).encode()))
    else:
        header_list.append((b"transfer-encoding", b"chunked"))
    header_list.append((b"content-type", b"application/json"))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": header_list,
        "client": ("127.0.0.1", 5000), "server": ("testserver", 80), "state": {},
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, pulled, body


def every_route(app) -> list[tuple[str, str]]:
    routes = []
    for route in app.routes:
        if isinstance(route, (APIRoute, Route)):
            path = re.sub(r"\{run_id\}|\{key_id\}", "x", route.path).replace("{step_id}", "1")
            routes += [(method, path) for method in sorted(route.methods) if method != "HEAD"]
    return routes


OPEN = {"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/usage", "/usage/app.js", "/usage/style.css"}


def test_every_route_is_covered(app):
    paths = {path for _, path in every_route(app)}
    assert {"/v1/steps", "/v1/keys", "/v1/usage/totals", "/metrics"} | OPEN <= paths


@pytest.mark.parametrize("declare_length", [True, False], ids=["content-length", "chunked"])
def test_a_30_mb_unauthenticated_body_is_refused_on_every_route_before_it_is_read(app, declare_length):
    for method, path in every_route(app):
        for headers in ({}, bearer("lvk_0000_nope"), {"Authorization": "Basic abc"}):
            status, pulled, answer = call(app, method, path, headers, BIG_BYTES, declare_length=declare_length)
            if declare_length:
                assert status == 413 and pulled == 0, (method, path, status, answer)
            elif path in OPEN:
                # Not a key route: the body is either never read (GET handlers ignore it) or cut at the limit.
                assert pulled <= SMALL_LIMIT_BYTES + CHUNK_BYTES, (method, path, pulled)
                assert status == 413 or pulled == 0, (method, path, status)
            else:
                assert status == 401 and pulled == 0, (method, path, status, answer)
                assert json.loads(answer)["detail"].startswith("missing or invalid API key")


def test_a_tenant_key_is_refused_on_admin_body_routes_before_the_body_is_read(app, keys):
    for path in ("/v1/steps", "/v1/keys"):
        status, pulled, _ = call(app, "POST", path, bearer(keys["tenant-0"]), BIG_BYTES, declare_length=False)
        assert status == 403 and pulled == 0, path


@pytest.mark.parametrize("declare_length", [True, False], ids=["content-length", "chunked"])
def test_an_admins_body_over_the_route_limit_is_413_before_it_is_parsed(app, keys, declare_length):
    admin = bearer(keys["admin"])
    for method, path, limit in (("POST", "/v1/steps", INGEST_LIMIT_BYTES), ("POST", "/v1/keys", SMALL_LIMIT_BYTES),
                                ("GET", "/v1/usage/totals", SMALL_LIMIT_BYTES), ("DELETE", "/v1/keys/x", SMALL_LIMIT_BYTES)):
        status, pulled, answer = call(app, method, path, admin, BIG_BYTES, declare_length=declare_length)
        if declare_length or method == "POST":
            assert status == 413, (path, answer)
            assert f"at most {limit}" in json.loads(answer)["detail"]
        assert pulled <= limit + CHUNK_BYTES, (path, pulled)
    # Under the limit the body is parsed: the same malformed JSON is then the client's error, not the size.
    status, _, answer = call(app, "POST", "/v1/keys", admin, 1000, declare_length=declare_length)
    assert status == 422, answer


def metric_values(client, admin) -> dict[tuple[str, tuple], float]:
    values = {}
    for family in text_string_to_metric_families(client.get("/metrics", headers=admin).text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_refusals_by_the_guard_are_counted_as_ingest_errors(app, keys):
    admin = bearer(keys["admin"])
    with TestClient(app) as client:
        assert client.post("/v1/steps", content=b"{").status_code == 401
        assert client.post("/v1/steps", content=b"{", headers=bearer(keys["tenant-0"])).status_code == 403
        assert client.post("/v1/steps", content=b" " * (INGEST_LIMIT_BYTES + 1), headers=admin).status_code == 413
        assert client.post("/v1/keys", content=b" " * (SMALL_LIMIT_BYTES + 1), headers=admin).status_code == 413
        values = metric_values(client, admin)
    errors = {reason: values[("llmvisor_ingest_errors_total", (("reason", reason),))] for reason in INGEST_ERROR_REASONS}
    assert errors == {reason: (1 if reason in ("unauthorized", "forbidden", "too_large") else 0) for reason in INGEST_ERROR_REASONS}


# ---------------------------------------------------------------------------------------------------------
# Parquet bombs


def bomb_columns(n_rows: int, text: pa.Array) -> dict:
    return {
        "run_id": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n_rows, np.int32)), pa.array(["r"])),
        "step_id": pa.array(np.arange(n_rows, dtype=np.int64) // 50),
        "step_latency_s": pa.array(np.full(n_rows, 0.02)),
        "request_id": text,
        "tenant": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n_rows, np.int32)), pa.array(["t"])),
        "num_new_tokens": pa.array(np.ones(n_rows, np.int64)),
        "num_context_tokens": pa.array(np.zeros(n_rows, np.int64)),
        "phase": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n_rows, np.int32)), pa.array(["decode"])),
    }


def write_parquet(columns: dict, **options) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink, compression="zstd", **options)
    return sink.getvalue().to_pybytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_a_dictionary_bomb_is_refused_before_its_strings_are_expanded(app, keys):
    """A million rows of one 512-character request id: a few kB on disk, 512 MB as strings."""
    n_rows = 1_000_000
    text = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n_rows, np.int32)), pa.array(["q" * 512]))
    body = write_parquet(bomb_columns(n_rows, text))
    assert len(body) < 200_000
    declared = sum(pq.ParquetFile(pa.BufferReader(body)).metadata.row_group(g).total_byte_size
                   for g in range(pq.ParquetFile(pa.BufferReader(body)).metadata.num_row_groups))
    assert declared < INGEST_LIMIT_BYTES  # the footer alone does not give it away
    before = peak_rss_bytes()
    with TestClient(app) as client:
        response = client.post("/v1/steps", content=body, headers={**bearer(keys["admin"]), **PARQUET})
    assert response.status_code == 413, response.text
    assert f"string columns expand to {n_rows * (512 + 1 + 1 + 6)} bytes, at most {INGEST_LIMIT_BYTES}" in response.json()["detail"]
    assert peak_rss_bytes() - before < 200 * 1024 * 1024


def test_a_compression_bomb_is_refused_from_its_footer_before_any_column_is_read(app, keys, monkeypatch):
    """Plain-encoded repeated strings under zstd: small on disk, its footer declares the size it unpacks to."""
    n_rows = 50_000
    body = write_parquet(bomb_columns(n_rows, pa.array(["q" * 500] * n_rows)), use_dictionary=False)
    assert len(body) < 100_000

    def no_read(*args, **kwargs):
        raise AssertionError("a column was read")

    monkeypatch.setattr(pq.ParquetFile, "read", no_read)
    with TestClient(app) as client:
        response = client.post("/v1/steps", content=body, headers={**bearer(keys["admin"]), **PARQUET})
    assert response.status_code == 413, response.text
    assert re.search(rf"Parquet columns declare \d+ bytes uncompressed, at most {INGEST_LIMIT_BYTES}", response.json()["detail"])


def test_a_parquet_body_within_the_limits_is_still_read(app, keys):
    groups = make_steps(n_steps=20)
    body = write_parquet({name: [r[name] for g in groups for r in g] for name in groups[0][0]})
    with TestClient(app) as client:
        response = client.post("/v1/steps", content=body, headers={**bearer(keys["admin"]), **PARQUET})
    assert response.status_code == 200, response.text
    assert response.json()["attributed_ns"] == measured_ns(groups)


def test_nested_parquet_columns_are_refused_before_they_are_read(app, keys):
    groups = make_steps(n_steps=2)
    columns = {name: [r[name] for g in groups for r in g] for name in groups[0][0]}
    columns["timestamp_s"] = [[1.0] * 1000 for _ in columns["run_id"]]
    with TestClient(app) as client:
        response = client.post("/v1/steps", content=write_parquet(columns), headers={**bearer(keys["admin"]), **PARQUET})
    assert response.status_code == 422 and "column timestamp_s: expected a flat column" in response.json()["detail"]


# ---------------------------------------------------------------------------------------------------------
# Label cardinality


def test_tenants_past_the_label_cap_are_folded_into_other(model_path, db_url, keys):
    groups = make_steps(n_steps=40, batch_size=8, n_tenants=7)
    with TestClient(create_app(model_path, db_url, max_tenant_labels=3)) as client:
        admin = bearer(keys["admin"])
        assert client.post("/v1/steps", json={"steps": groups}, headers=admin).status_code == 200
        values = metric_values(client, admin)
        usage = {t["tenant"]: t["attributed_ns"] for t in client.get("/v1/usage/tenants", headers=admin).json()["tenants"]}
    named = {labels[0][1]: value for (name, labels), value in values.items() if name == "llmvisor_attributed_seconds_total"}
    assert len(usage) == 7 and len(named) == 4 and "other" in named
    assert values[("llmvisor_tenants_folded", ())] == 4
    assert sum(named.values()) == pytest.approx(measured_ns(groups) / 1e9, rel=1e-12)
    for tenant, seconds in named.items():
        if tenant != "other":
            assert seconds == pytest.approx(usage[tenant] / 1e9, rel=1e-12)
    assert named["other"] == pytest.approx(sum(ns for t, ns in usage.items() if t not in named) / 1e9, rel=1e-12)


def test_the_label_cap_keeps_the_first_tenants_and_counts_each_folded_tenant_once():
    metrics = ServiceMetrics(max_tenant_labels=2)
    for _ in range(3):
        metrics.record_ingest(np.array(["a", "b", "c", "d", "a"], dtype=object), np.full(5, 10**9), np.array([5 * 10**9]),
                              np.zeros(1), np.ones(1), 1, 0)
    assert metrics.attributed_seconds.labels("a")._value.get() == 6.0
    assert metrics.attributed_seconds.labels("other")._value.get() == 6.0
    assert metrics.tenants_folded._value.get() == 2


# ---------------------------------------------------------------------------------------------------------
# Docs


def test_the_docs_list_exactly_the_ingest_error_reasons_the_code_counts():
    code = "\n".join(p.read_text() for p in (REPO / "src/llmvisor/service").rglob("*.py"))
    used = set(re.findall(r'PayloadError\(\s*\d+,\s*"(\w+)"', code))
    used |= set(re.findall(r'(?:count_ingest_error|refuse)\("(\w+)"', code))
    doc = (REPO / "docs/service.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `llmvisor_ingest_errors_total{reason}`"))
    documented = set(re.findall(r"`(\w+)`", row.split("|")[2]))
    assert used == documented == set(INGEST_ERROR_REASONS)
