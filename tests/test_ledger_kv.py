"""KV memory-time through the service, the ledger and billing (issue #37, schema 9): runs metered by `KvMeter` (trace
format 3) are pushed in every body form; each tenant's KV block-ns in the ledger, in /v1/usage and in every export
(FOCUS with its GiB-Hours rows through the FOCUS validator, CloudEvents, Stripe, Lago) equal the trace's to the
block-nanosecond, byte-ns exactly; a re-push counts nothing twice; an inconsistent body is refused and stores nothing;
format 2 steps are billed for time only; a schema-8 ledger is upgraded in place; a late step of an exported hour
sends only its memory (and time) difference. SQLite and PostgreSQL."""

from __future__ import annotations

import io
import json
from collections import defaultdict
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

from _billing_checks import check_exports_tie_to_the_ledger, read_csv
from _cli import invoke_cli
from _kv_steps import as_columns, kv_per_tenant, metered_run, without_kv
from _service_fixtures import T0_S, bearer, db_url, model_path  # noqa: F401
from llmvisor.billing import usage_charges
from llmvisor.billing.charges import KV_MEMORY
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.ledger import Ledger
from llmvisor.service.app import create_app
from llmvisor.service.ingest import prepare_batch, validate_trace

HOUR0 = int(T0_S) // 3600 * 3600
PERIOD = (HOUR0, HOUR0 + 2 * 3600)
BYTES_A, BYTES_B = 2 * 4 * 8 * 64 * 2 * 16, 2 * 2 * 4 * 32 * 2 * 32  # two engines' bytes per block


def _parquet(steps) -> bytes:
    rows = [row for step in steps for row in step]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


def _post(client, admin, steps, form: str):
    if form == "rows":
        return client.post("/v1/steps", json={"steps": steps}, headers=bearer(admin))
    if form == "columns":
        return client.post("/v1/steps", json=as_columns(steps), headers=bearer(admin))
    return client.post("/v1/steps", content=_parquet(steps),
                       headers={**bearer(admin), "Content-Type": "application/vnd.apache.parquet"})


def _runs():
    """Three metered runs (two block sizes) in the first hour and one in the second, and a format-2 run."""
    return {
        "rows": metered_run(1, run_id="kv-rows", t0_s=T0_S, block_bytes=BYTES_A),
        "columns": metered_run(2, run_id="kv-cols", t0_s=T0_S + 5, block_bytes=BYTES_B, tenants=("kv-a", "kv-b")),
        "parquet": metered_run(3, run_id="kv-pq", t0_s=HOUR0 + 3600 + 20, block_bytes=BYTES_A, tenants=("kv-c", "kv-d")),
    }, without_kv(metered_run(4, run_id="v2-run", t0_s=T0_S + 9, tenants=("kv-a", "old-only")))


def _gib_price_file(path, *, gib: bool = True):
    path.write_text('[[price]]\nengine_class = ""\ncurrency = "USD"\nengine_hour_price = "3.1415"\n'
                    + ('gib_hour_price = "0.0173"\n' if gib else "") + f"valid_from = {HOUR0}\n")
    return path


@pytest.fixture
def kv_served(model_path, db_url):  # noqa: F811
    ledger = Ledger(db_url)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    runs, old = _runs()
    with TestClient(create_app(model_path, db_url)) as client:
        for form, steps in runs.items():
            response = _post(client, admin, steps, form)
            assert response.status_code == 200, response.text
            assert response.json()["steps_inserted"] == len(steps)
        assert _post(client, admin, old, "columns").status_code == 200
        again = _post(client, admin, runs["rows"], "parquet")  # a re-push in another form: duplicates, nothing counted
        assert again.status_code == 200 and again.json()["steps_duplicate"] == len(runs["rows"]), again.text
        usage = client.get("/v1/usage/tenants", headers=bearer(admin)).json()["tenants"]
        totals = client.get("/v1/usage/totals", headers=bearer(admin)).json()
        hourly = client.get("/v1/usage/tenants?bucket=hour", headers=bearer(admin)).json()["tenants"]
        requests = client.get("/v1/usage/requests?limit=10000", headers=bearer(admin)).json()["requests"]
        step = client.get("/v1/steps/kv-pq/3", headers=bearer(admin)).json()
        metrics = client.get("/metrics", headers=bearer(admin)).text
    return {"db": db_url, "runs": runs, "old": old, "usage": usage, "totals": totals, "hourly": hourly,
            "requests": requests, "step": step, "admin": admin, "metrics": metrics}


def test_prometheus_counts_each_tenants_kv_gib_seconds_once(kv_served):
    """`llmvisor_kv_gib_seconds_total{tenant}` is each tenant's byte-ns in GiB-seconds, the re-push not counted again
    and the format-2 run's tenant without memory."""
    from prometheus_client.parser import text_string_to_metric_families

    _, byte_ns = kv_per_tenant([s for steps in kv_served["runs"].values() for s in steps])
    counted = {sample.labels["tenant"]: sample.value for family in text_string_to_metric_families(kv_served["metrics"])
               for sample in family.samples if sample.name == "llmvisor_kv_gib_seconds_total"}
    assert counted.keys() == byte_ns.keys()
    for tenant, value in byte_ns.items():
        assert counted[tenant] == pytest.approx(value / 2**30 / 1e9, rel=1e-9)


def test_each_tenants_kv_block_ns_in_the_ledger_and_usage_api_equal_the_trace(kv_served):
    runs = kv_served["runs"]
    block_ns, byte_ns = kv_per_tenant([s for steps in runs.values() for s in steps])
    assert len(block_ns) == 4 and all(block_ns.values())
    ledger = Ledger(kv_served["db"])
    try:
        rows = {r.tenant: r for r in ledger.tenant_usage()}
        totals = ledger.totals()
    finally:
        ledger.close()
    assert {t: r.kv_block_ns for t, r in rows.items() if r.kv_block_ns is not None} == block_ns  # to the block-ns
    assert {t: r.kv_byte_ns for t, r in rows.items() if r.kv_byte_ns is not None} == byte_ns
    assert rows["old-only"].kv_block_ns is None  # format 2: time only, memory not metered (not 0)
    assert totals.kv_block_ns == sum(block_ns.values()) and totals.kv_byte_ns == sum(byte_ns.values())
    api = {t["tenant"]: t for t in kv_served["usage"]}
    assert {t: api[t]["kv_block_ns"] for t in block_ns} == block_ns
    assert {t: api[t]["kv_byte_ns"] for t in byte_ns} == byte_ns
    assert api["kv-a"]["kv_gib_s"] == pytest.approx(byte_ns["kv-a"] / 2**30 / 1e9)
    assert api["old-only"]["kv_block_ns"] is None and api["old-only"]["attributed_ns"] > 0
    assert kv_served["totals"]["kv_block_ns"] == sum(block_ns.values())
    assert kv_served["totals"]["attributed_ns"] == kv_served["totals"]["measured_ns"]
    hourly = {t["tenant"]: t for t in kv_served["hourly"]}
    for tenant, ns in block_ns.items():  # buckets add up to the tenant
        assert sum(b["kv_block_ns"] or 0 for b in hourly[tenant]["buckets"]) == ns == hourly[tenant]["kv_block_ns"]
    per_request: dict[str, int] = defaultdict(int)
    for steps in runs.values():
        for step in steps:
            for row in step:
                per_request[row["request_id"]] += row["kv_block_ns"]
    assert {r["request_id"]: r["kv_block_ns"] for r in kv_served["requests"] if r["kv_block_ns"] is not None} == dict(per_request)
    [step_rows] = [s for s in runs["parquet"] if s[0]["step_id"] == 3]
    assert {s["request_id"]: s["kv_block_ns"] for s in kv_served["step"]["slices"]} == {
        r["request_id"]: r["kv_block_ns"] for r in step_rows}


def test_every_export_carries_each_tenants_kv_block_ns_and_focus_passes_the_validator(kv_served, tmp_path):
    db = kv_served["db"]
    added = invoke_cli("prices", "add", str(_gib_price_file(tmp_path / "prices.toml")), "--db", db, "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["prices"][0]["gib_hour_price"] == "0.0173"
    checked = check_exports_tie_to_the_ledger(db, PERIOD, tmp_path)
    block_ns, _ = kv_per_tenant([s for steps in kv_served["runs"].values() for s in steps])
    assert checked["kv_block_ns"] == block_ns  # the exports' KV block-ns per tenant are the trace's
    rows = read_csv(tmp_path / "focus.csv")
    engine_rows = [r for r in rows if r["ConsumedUnit"] == "Engine-Seconds"]
    memory_rows = [r for r in rows if r["ConsumedUnit"] == "GiB-Hours"]
    metered = {(r["SubAccountId"], r["ChargePeriodStart"]) for r in engine_rows if r["SubAccountId"] != "old-only"}
    assert {(r["SubAccountId"], r["ChargePeriodStart"]) for r in memory_rows} == metered  # a GiB-Hours row per tenant charge
    assert len({r["SkuId"] for r in memory_rows}) == 1 and {r["x_KvBlockBytes"] for r in memory_rows} == {str(BYTES_A), str(BYTES_B)}
    if checked["focus_validated"] is None:
        pytest.skip("no FOCUS validator in .venv-focus (scripts/install-test.sh creates it)")


def test_a_book_without_a_memory_price_charges_time_only(kv_served, tmp_path):
    db = kv_served["db"]
    assert invoke_cli("prices", "add", str(_gib_price_file(tmp_path / "p.toml", gib=False)), "--db", db).returncode == 0
    ledger = Ledger(db)
    try:
        charges = usage_charges(ledger, PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000)
    finally:
        ledger.close()
    assert charges and not [c for c in charges if c.item == KV_MEMORY]


def test_a_late_step_of_an_exported_hour_sends_only_the_memory_difference(kv_served, tmp_path, model_path):  # noqa: F811
    db = kv_served["db"]
    assert invoke_cli("prices", "add", str(_gib_price_file(tmp_path / "p.toml")), "--db", db).returncode == 0
    first = tmp_path / "first.json"
    assert invoke_cli("export", "--format", "lago", "--db", db, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]),
                      "-o", str(first)).returncode == 0
    late = metered_run(5, run_id="kv-late", t0_s=T0_S + 600, tenants=("kv-a",), n_steps=6)
    with TestClient(create_app(model_path, db)) as client:
        assert _post(client, kv_served["admin"], late, "rows").status_code == 200
    second = tmp_path / "second.json"
    result = invoke_cli("export", "--format", "lago", "--db", db, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]),
                        "-o", str(second), "--force")
    assert result.returncode == 0, result.stderr
    corrections = json.loads(second.read_text())
    memory = [e for e in corrections if e["code"] == "llmvisor_kv_block_ns"]
    late_ns, _ = kv_per_tenant(late)
    assert [e["properties"]["kv_block_ns"] for e in memory] == [late_ns["kv-a"]]  # only the difference
    assert memory[0]["properties"]["revision"] == 1 and memory[0]["external_subscription_id"] == "kv-a"
    assert {e["transaction_id"] for e in corrections}.isdisjoint(e["transaction_id"] for e in json.loads(first.read_text()))
    block_ns, _ = kv_per_tenant([s for steps in kv_served["runs"].values() for s in steps] + late)
    both = json.loads(first.read_text()) + corrections
    sent = defaultdict(int)
    for e in both:
        if e["code"] == "llmvisor_kv_block_ns":
            sent[e["external_subscription_id"]] += e["properties"]["kv_block_ns"]
    assert dict(sent) == block_ns


@pytest.mark.parametrize("form", ["rows", "columns", "parquet"])
def test_an_inconsistent_kv_body_is_refused_in_one_line_and_stores_nothing(model_path, tmp_path, form):  # noqa: F811
    db = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    steps = metered_run(6, run_id="bad", t0_s=T0_S, n_steps=5)
    steps[2][0]["kv_block_ns"] += 1  # shares that no longer add up to the pool
    with TestClient(create_app(model_path, db)) as client:
        response = _post(client, admin, steps, form)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        assert "KV memory does not add up" in detail and "step 2 of run 'bad'" in detail and "\n" not in detail
        partial = [[{k: v for k, v in row.items() if k != "kv_free_block_ns"} for row in step] for step in steps]
        response = _post(client, admin, partial, form)
        assert response.status_code == 422 and "the KV memory columns come together" in response.json()["detail"]
        assert client.get("/v1/usage/totals", headers=bearer(admin)).json()["num_steps"] == 0


def test_a_step_resent_with_other_kv_figures_is_a_conflict(model_path, tmp_path):  # noqa: F811
    db = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    steps = metered_run(7, run_id="r", t0_s=T0_S, n_steps=4)
    changed = [[dict(row) for row in step] for step in steps]
    for row in changed[1]:  # the same pool, another interval: still consistent, but other content
        row["kv_free_block_ns"] += row["kv_pool_blocks"]
        row["kv_interval_ns"] += 1
    with TestClient(create_app(model_path, db)) as client:
        assert _post(client, admin, steps, "rows").status_code == 200
        response = _post(client, admin, changed, "columns")
        assert response.status_code == 409 and response.json()["conflicting_steps"], response.text
        assert _post(client, admin, steps, "columns").json()["steps_duplicate"] == len(steps)


def test_a_schema_8_ledger_is_upgraded_in_place_and_bills_its_old_usage_for_time_only(model_path, tmp_path):  # noqa: F811
    db = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    old = without_kv(metered_run(8, run_id="old", t0_s=T0_S))
    with TestClient(create_app(model_path, db)) as client:
        assert _post(client, admin, old, "rows").status_code == 200
    before = Ledger(db)
    usage_before = [(r.tenant, r.attributed_ns, r.num_new_tokens) for r in before.tenant_usage()]
    before.close()
    engine = create_engine(db)
    with engine.begin() as conn:  # what schema 8 had: no KV columns, version 8
        for table, column in (("usage_per_second", "kv_block_ns"), ("usage_per_second", "kv_block_bytes"),
                              ("tenant_seconds", "kv_block_ns"), ("tenant_seconds", "kv_block_bytes"),
                              ("request_totals", "kv_block_ns"), ("request_totals", "kv_block_bytes"),
                              ("billing_lines", "kv_block_bytes"), ("prices", "gib_hour_price")):
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))
        conn.execute(text("UPDATE ledger_info SET value = '8' WHERE name = 'schema_version'"))
    engine.dispose()
    upgraded = Ledger(db)
    try:
        assert [(r.tenant, r.attributed_ns, r.num_new_tokens) for r in upgraded.tenant_usage()] == usage_before
        assert all(r.kv_block_ns is None for r in upgraded.tenant_usage())
    finally:
        upgraded.close()
    with create_engine(db).connect() as conn:
        assert conn.execute(text("SELECT value FROM ledger_info WHERE name = 'schema_version'")).scalar() == "10"
    new = metered_run(9, run_id="new", t0_s=T0_S + 30)
    with TestClient(create_app(model_path, db)) as client:
        assert _post(client, admin, new, "columns").status_code == 200
    upgraded = Ledger(db)
    try:
        assert {r.tenant: r.kv_block_ns for r in upgraded.tenant_usage()} == kv_per_tenant(new)[0]
    finally:
        upgraded.close()


_MODEL = StepLatencyModel().fit(synthetic_trace(800))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seeds=st.lists(st.integers(0, 10**6), min_size=1, max_size=3, unique=True),
       pools=st.lists(st.integers(8, 4096), min_size=3, max_size=3), split=st.integers(1, 12))
def test_generated_runs_pushed_in_any_batches_keep_every_tenants_kv_exactly(tmp_path_factory, seeds, pools, split):
    """Hypothesis: metered runs of random pools and block sizes, stored in batches cut anywhere (a request's usage in
    one second merged across batches): the ledger's block-ns and byte-ns per tenant equal the trace's."""
    db = f"sqlite:///{tmp_path_factory.mktemp('kv')}/ledger.db"
    ledger = Ledger(db)
    steps = []
    for k, seed in enumerate(seeds):
        steps += metered_run(seed, run_id=f"h{k}", t0_s=T0_S + k, pool=pools[k], block_bytes=1 + seed % 70_000,
                             n_steps=12, tenants=("x", "y", "z")[: 1 + seed % 3])
    try:
        for start in range(0, len(steps), split):
            batch = validate_trace(steps[start:start + split])
            ledger.ingest(prepare_batch(_MODEL, batch, received_at_us=0).records)
        block_ns, byte_ns = kv_per_tenant(steps)
        rows = ledger.tenant_usage()
        assert {r.tenant: r.kv_block_ns for r in rows} == block_ns
        assert {r.tenant: r.kv_byte_ns for r in rows} == byte_ns
        hourly: dict[str, int] = defaultdict(int)
        for *_key, tenant, _ns, _tok, _a, _b, _c, block_bytes, kv in ledger.hourly_usage(HOUR0 * 1_000_000, (HOUR0 + 7200) * 1_000_000):
            hourly[tenant] += kv * block_bytes
        assert dict(hourly) == byte_ns
    finally:
        ledger.close()


def test_block_ns_sums_past_64_bits_stay_exact(tmp_path):
    """A tenant's month of block-ns can pass 2^63 (SQLite's SUM of integers fails there): the ledger sums halves."""
    db = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db)
    big = 2**62 + 12345
    try:
        with ledger.write_transaction() as conn:
            for k in range(4):
                conn.execute(text(
                    "INSERT INTO usage_per_second (run_id, request_id, tenant, second_us, attributed_ns, num_slices, num_new_tokens,"
                    " first_timestamp_us, last_timestamp_us, kv_block_ns, kv_block_bytes) VALUES "
                    f"('r', 'q{k}', 't', {int(T0_S) * 1_000_000}, 1, 1, 1, 0, 0, {big}, 3)"))
        [row] = ledger.tenant_usage()
        assert row.kv_block_ns == 4 * big and row.kv_byte_ns == 12 * big
        assert ledger.totals().kv_block_ns == 4 * big
    finally:
        ledger.close()


def test_memory_cost_is_block_ns_times_block_bytes_at_the_gib_hour_price():
    from llmvisor.billing.prices import Price, exact_memory_cost, gib_hours

    price = Price(engine_class="", version=1, valid_from_us=0, currency="USD", engine_hour_price=Decimal("1"),
                  gib_hour_price=Decimal("0.5"))
    one_gib_hour = 3_600_000_000_000 * 2**30 // 65536  # block-ns of 64 KiB blocks making one GiB-hour
    assert gib_hours(one_gib_hour, 65536) == 1 and exact_memory_cost(one_gib_hour, 65536, price) == Fraction(1, 2)
    assert np.isclose(float(gib_hours(10**15, 12288)), 10**15 * 12288 / 2**30 / 3.6e12)


def test_the_audit_ties_each_tenants_kv_from_the_archive_to_the_ledger(kv_served, tmp_path, model_path):  # noqa: F811
    """The archive (what the delivery process writes, `ArchiveWriter`) keeps the KV columns; `llmvisor audit`
    recomputes each tenant's block-ns and byte-ns from it and ties them to the ledger; a changed ledger row fails."""
    from llmvisor.archive import ArchiveWriter, read_archive

    archive = tmp_path / "archive"
    writer = ArchiveWriter(str(archive), window_s=60.0)
    for steps in (*kv_served["runs"].values(), kv_served["old"]):
        for step in steps:
            writer.add_step(step)
    assert writer.close()
    archived = read_archive(str(archive), PERIOD[0] * 1_000_000, HOUR0 * 1_000_000 + 1800 * 1_000_000, tenant="kv-b")
    assert "kv_block_ns" in archived.extra  # format-3 files only in this half hour: the KV columns kept
    block_ns, byte_ns = kv_per_tenant([s for steps in kv_served["runs"].values() for s in steps])
    db = kv_served["db"]

    def audit(tenant):
        out = invoke_cli("audit", "--archive", str(archive), "--db", db, "--tenant", tenant, "--start", str(PERIOD[0]),
                         "--end", str(PERIOD[1]), "--model", str(model_path), "--json")
        return out.returncode, json.loads(out.stdout)

    for tenant in ("kv-c", "kv-d"):  # their steps are all in format-3 files of the second hour
        code, report = audit(tenant)
        assert code == 0 and report["ok"] and report["kv_checked"], report
        assert report["kv_block_ns_archive"] == report["kv_block_ns_ledger"] == block_ns[tenant]
        assert report["kv_byte_ns_archive"] == report["kv_byte_ns_ledger"] == byte_ns[tenant]
    code, report = audit("kv-a")  # its hour mixes format-2 and format-3 files: time is audited, memory not checkable
    assert code == 0 and report["ok"] and not report["kv_checked"], report
    ledger = Ledger(db)
    try:
        with ledger.write_transaction() as conn:  # one usage row of kv-d: one block-ns more
            key = conn.execute(text("SELECT run_id, request_id, second_us FROM usage_per_second WHERE tenant = 'kv-d' "
                                    "AND kv_block_ns IS NOT NULL ORDER BY run_id, request_id, second_us")).first()
            conn.execute(text("UPDATE usage_per_second SET kv_block_ns = kv_block_ns + 1 WHERE tenant = 'kv-d' AND run_id = :r "
                              "AND request_id = :q AND second_us = :s"), {"r": key[0], "q": key[1], "s": key[2]})
    finally:
        ledger.close()
    code, report = audit("kv-d")
    assert code == 1 and not report["ok"] and report["kv_block_ns_ledger"] == block_ns["kv-d"] + 1


def test_a_pending_steps_memory_is_billed_once_when_it_is_attributed(model_path, tmp_path):  # noqa: F811
    """A step of a class without a model is stored pending (its KV columns kept in its blob); activating a model bills
    its time and its memory together, once, and a re-send is still a duplicate."""
    from _service_fixtures import class_model

    db = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    engine_class = "00000000c0ffee07"
    steps = metered_run(13, run_id="pend", t0_s=T0_S, engine_fingerprint=engine_class)
    with TestClient(create_app(model_path, db, registry_refresh_s=0.0)) as client:
        assert _post(client, admin, steps, "columns").json()["steps_pending"] == len(steps)
        assert all(t["kv_block_ns"] is None for t in client.get("/v1/usage/tenants", headers=bearer(admin)).json()["tenants"])
        added = client.post("/v1/models", json={"model": class_model(engine_class).to_dict()}, headers=bearer(admin))
        activation = client.post(f"/v1/models/{engine_class}/{added.json()['version']}/activate", headers=bearer(admin))
        assert activation.json()["pending_steps_attributed"] == len(steps)
        tenants = client.get("/v1/usage/tenants", headers=bearer(admin)).json()["tenants"]
        assert {t["tenant"]: t["kv_block_ns"] for t in tenants} == kv_per_tenant(steps)[0]
        assert _post(client, admin, steps, "rows").json()["steps_duplicate"] == len(steps)


def test_the_pushers_body_carries_the_kv_columns_to_the_ledger(model_path, tmp_path):  # noqa: F811
    """The body the engine's pusher and delivery process send (`columns_body`): before it named the KV columns, the
    service got steps without them and billed time only."""
    from llmvisor.client.push import columns_body

    db = f"sqlite:///{tmp_path}/ledger.db"
    ledger = Ledger(db)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    steps = metered_run(14, run_id="pushed", t0_s=T0_S)
    with TestClient(create_app(model_path, db)) as client:
        response = client.post("/v1/steps", content=columns_body(steps),
                               headers={**bearer(admin), "Content-Type": "application/json"})
        assert response.status_code == 200, response.text
        tenants = client.get("/v1/usage/tenants", headers=bearer(admin)).json()["tenants"]
    assert {t["tenant"]: t["kv_block_ns"] for t in tenants} == kv_per_tenant(steps)[0]


def test_the_top_tenants_carry_their_kv_memory(kv_served, model_path):  # noqa: F811
    block_ns, byte_ns = kv_per_tenant([s for steps in kv_served["runs"].values() for s in steps])
    with TestClient(create_app(model_path, kv_served["db"])) as client:
        top = client.get("/v1/usage/top?n=3", headers=bearer(kv_served["admin"])).json()["tenants"]
    assert len(top) == 3 and [t["attributed_ns"] for t in top] == sorted((t["attributed_ns"] for t in top), reverse=True)
    for t in top:
        assert (t["kv_block_ns"], t["kv_byte_ns"]) == (block_ns.get(t["tenant"]), byte_ns.get(t["tenant"]))
