"""`llmvisor adjust`: after a refit, a past period's bills are corrected by adjustment entries, never rewritten.

The steps are billed by a model fitted on another engine (decode context priced ~5x too low, so long-context
tenants are under-billed); a refit from the ledger fits the engine the steps came from; the adjustment's entries
must equal, per tenant, the re-attributed minus the billed time exactly, sum to 0, and sit beside the unchanged
usage in the API.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from _cli import invoke_cli
from _processes import cli_process
from _service_fixtures import T0_S, bearer, class_body, class_model, db_url, model_path  # noqa: F401
from llmvisor.core.synthetic import DEFAULT_COEF_S
from llmvisor.core.trace import trace_from_rows
from llmvisor.ledger import Ledger
from llmvisor.service.app import create_app
from llmvisor.service.ingest import ModelChoice, prepare_batch
from llmvisor.service.refit import refit_class
from llmvisor.service.registry import load_version

CLASS_A = "aaaaaaaaaaaaaaaa"
PERIOD = (int(T0_S), int(T0_S) + 60)
"""The period adjusted, in Unix seconds (as the command and the API take it)."""
PERIOD_US = tuple(t * 1_000_000 for t in PERIOD)


def run_cli(*args):
    """``llmvisor ARGS`` as its own process (`cli_process`), for the refusals; the adjustments checked by their output run in this
    process (`invoke_cli`)."""
    return cli_process(*args, timeout_s=120)


def wrong_coef() -> dict:
    """The engine's coefficients with decode attention priced 5x too low and the per-decode term raised to compensate."""
    coef = dict(DEFAULT_COEF_S)
    coef["decode_context_tokens"] = DEFAULT_COEF_S["decode_context_tokens"] / 5
    coef["decode_requests"] = DEFAULT_COEF_S["decode_requests"] * 3
    return coef


def per_tenant(tenants, values) -> dict[str, int]:
    out: dict[str, int] = {}
    for tenant, value in zip(tenants.tolist(), np.asarray(values).tolist()):
        out[tenant] = out.get(tenant, 0) + int(value)
    return out


@pytest.fixture
def billed_by_a_wrong_model(model_path, db_url):  # noqa: F811
    """A ledger whose class-A steps were billed by v1, fitted on another engine; returns (db_url, admin, tenant key, bodies)."""
    ledger = Ledger(db_url)
    admin, tenant_key = ledger.create_key(is_admin=True), ledger.create_key("tenant-0")
    ledger.close()
    bodies = [class_body(CLASS_A, 250, run_id=f"r{k}", seed=40 + k, first_timestamp_s=T0_S + 15 * k) for k in range(3)]
    app = create_app(model_path, db_url, registry_refresh_s=0.0)
    with TestClient(app) as client:
        client.post("/v1/models", json={"model": class_model(CLASS_A, coef_s=wrong_coef()).to_dict(), "activate": True},
                    headers=bearer(admin))
        for body in bodies:
            assert client.post("/v1/steps", json=body, headers=bearer(admin)).status_code == 200
    return db_url, admin, tenant_key, bodies, model_path


def test_adjust_after_a_refit_equals_reattributed_minus_billed_exactly(billed_by_a_wrong_model):
    db_url, admin, tenant_key, bodies, model_path = billed_by_a_wrong_model
    ledger = Ledger(db_url)
    before = {row.tenant: row.attributed_ns for row in ledger.tenant_usage(*PERIOD_US)}
    refit = refit_class(ledger, CLASS_A, newest_steps=10_000, test_fraction=0.2)
    assert refit.activated and refit.version == 2 and refit.new_error < refit.active_error
    new_model = load_version(ledger, CLASS_A, 2)
    ledger.close()

    dry = invoke_cli("adjust", "--class", CLASS_A, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]), "--db", db_url, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["written"] is False and Ledger(db_url).adjustment_rows() == []

    done = invoke_cli("adjust", "--class", CLASS_A, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]), "--db", db_url, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["to_version"] == 2 and result["from_versions"] == "1" and result["num_steps"] == 750

    # Independently: the same steps attributed with v2 as the service bills (integer ns per step).
    expected_ns: dict[str, int] = {}
    for body in bodies:
        columns = body["columns"]
        trace = trace_from_rows([dict(zip(columns, values)) for values in zip(*columns.values())])
        records = prepare_batch(new_model, trace, received_at_us=0, choose=lambda _c: ModelChoice(new_model, 2)).records
        for tenant, ns in per_tenant(records.tenant, records.attributed_ns).items():
            expected_ns[tenant] = expected_ns.get(tenant, 0) + ns
    entries = {e["tenant"]: e for e in result["tenants"]}
    assert set(entries) == set(before) == set(expected_ns)
    for tenant, entry in entries.items():
        assert entry["billed_ns"] == before[tenant]
        assert entry["reattributed_ns"] == expected_ns[tenant]
        assert entry["delta_ns"] == expected_ns[tenant] - before[tenant]
    assert sum(e["delta_ns"] for e in entries.values()) == 0 == result["total_delta_ns"]
    assert max(abs(e["delta_ns"]) for e in entries.values()) > 1e6, "the wrong model should have mis-billed someone by > 1 ms"

    # The bill is not rewritten; the API shows the adjustments beside it, a tenant key only its own.
    app = create_app(model_path, db_url, registry_refresh_s=0.0)
    with TestClient(app) as client:
        span = {"start": str(PERIOD[0]), "end": str(PERIOD[1])}
        usage = client.get("/v1/usage/tenants", params=span, headers=bearer(admin)).json()["tenants"]
        for row in usage:
            assert row["attributed_ns"] == before[row["tenant"]]
            assert row["adjustments_ns"] == entries[row["tenant"]]["delta_ns"]
            assert row["adjusted_ns"] == expected_ns[row["tenant"]]
        own = client.get("/v1/adjustments", headers=bearer(tenant_key)).json()["adjustments"]
        assert [a["tenant"] for a in own] == ["tenant-0"]
        assert own[0]["from_versions"] == "1" and own[0]["to_version"] == 2 and own[0]["delta_ns"] == entries["tenant-0"]["delta_ns"]
        assert client.get("/v1/adjustments", params={"tenant": "tenant-1"}, headers=bearer(tenant_key)).status_code == 403
        everyone = client.get("/v1/adjustments", headers=bearer(admin)).json()["adjustments"]
        assert len(everyone) == len(entries)
        # A range that does not hold the whole period shows the bill without the adjustment.
        inside = client.get("/v1/usage/tenants", params={"start": str(PERIOD[0] + 1), "end": str(PERIOD[1])}, headers=bearer(admin))
        assert all(row["adjustments_ns"] == 0 for row in inside.json()["tenants"])

    # A rerun never counts twice; an overlapping period is refused; both leave the entries as they were.
    again = run_cli("adjust", "--class", CLASS_A, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]), "--db", db_url)
    assert again.returncode == 2 and "already adjusted to model version 2" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr
    overlap = run_cli("adjust", "--class", CLASS_A, "--start", str(PERIOD[0] + 10), "--end", str(PERIOD[1] + 10), "--db", db_url)
    assert overlap.returncode == 2 and "overlaps one adjusted before" in overlap.stderr
    assert len(Ledger(db_url).adjustment_rows()) == len(entries)


def test_a_second_adjustment_corrects_what_the_first_left(billed_by_a_wrong_model, tmp_path):
    """Adjusting the same period to a later version: billed_ns includes the earlier entries, so usage plus every
    adjustment equals the latest re-attribution per tenant, and each adjustment still sums to 0."""
    db_url, _admin, _tenant, _bodies, _model = billed_by_a_wrong_model
    ledger = Ledger(db_url)
    from llmvisor.service.adjust import adjust_period

    version_2 = ledger.add_model(CLASS_A, json.dumps(class_model(CLASS_A, coef_s=DEFAULT_COEF_S, seed=1).to_dict()), "v2", activate=True)
    first = adjust_period(ledger, CLASS_A, *PERIOD_US)
    version_3 = ledger.add_model(CLASS_A, json.dumps(class_model(CLASS_A, coef_s=DEFAULT_COEF_S, seed=2).to_dict()), "v3", activate=True)
    second = adjust_period(ledger, CLASS_A, *PERIOD_US)
    assert (first.to_version, second.to_version) == (version_2, version_3)
    billed = {row.tenant: row.attributed_ns for row in ledger.tenant_usage(*PERIOD_US)}
    for entry in second.entries:
        earlier = next(e for e in first.entries if e.tenant == entry.tenant)
        assert entry.billed_ns == billed[entry.tenant] + earlier.delta_ns
        assert billed[entry.tenant] + earlier.delta_ns + entry.delta_ns == entry.reattributed_ns
    assert first.total_delta_ns == 0 == second.total_delta_ns
    with pytest.raises(Exception, match="no billed steps"):
        adjust_period(ledger, CLASS_A, PERIOD_US[1] + 100_000_000, PERIOD_US[1] + 200_000_000)
    ledger.close()


def test_adjust_refuses_bad_periods_in_one_line(tmp_path):
    db = f"sqlite:///{tmp_path}/ledger.db"
    for args, reason in (
        (["--start", "10", "--end", "5"], "must end after it starts"),
        (["--start", "10.5", "--end", "20"], "not a whole second"),
        (["--start", "yesterday", "--end", "20"], "expected an ISO 8601 time"),
        (["--start", "0", "--end", "20"], "has no active model version"),
    ):
        done = run_cli("adjust", "--class", CLASS_A, *args, "--db", db)
        assert done.returncode == 2, (args, done.stderr)
        assert reason in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
