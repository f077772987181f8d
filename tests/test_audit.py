"""`llmvisor audit`: a ledger built by real ingest equals, per tenant and to the nanosecond, the archive's
re-attribution of the same steps with the versions that billed them; a changed ledger row is caught; bad input is
one line and exit 2."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from _cli import invoke_cli
from _processes import cli_process
from _service_fixtures import T0_S, bearer, class_body, class_model, db_url, make_steps, model_path  # noqa: F401
from llmvisor.archive import ArchiveWriter
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import DEFAULT_COEF_S, synthetic_trace
from llmvisor.core.trace import SHARING_COLUMNS
from llmvisor.ledger import Ledger
from llmvisor.service.adjust import adjust_period
from llmvisor.service.app import create_app
from llmvisor.service.audit import audit_tenant

CLASS_A = "aaaaaaaaaaaaaaaa"
PERIOD = (int(T0_S), int(T0_S) + 60)
PERIOD_US = tuple(t * 1_000_000 for t in PERIOD)


def run_cli(*args):
    """``llmvisor ARGS`` as its own process (`cli_process`), for the refusals; the audits and refits checked by their
    output run in this process (`invoke_cli`)."""
    return cli_process(*args, timeout_s=120)


def steps_of(body: dict) -> list[list[dict]]:
    """A POST /v1/steps column body as steps of row dicts (what the delivery process hands the archive)."""
    columns = body["columns"]
    steps: list[list[dict]] = []
    for values in zip(*columns.values()):
        row = dict(zip(columns, values))
        if not steps or steps[-1][0]["step_id"] != row["step_id"]:
            steps.append([])
        steps[-1].append(row)
    return steps


@pytest.fixture
def billed_and_archived(model_path, db_url, tmp_path):  # noqa: F811
    """Steps of class A (registry v1; two runs with shared prefixes, one of them billed without the sharing
    columns) and steps without a fingerprint (the service's
    --model), ingested by the real service and written to the archive; returns (db_url, archive dir, model path)."""
    ledger = Ledger(db_url)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    bodies = [class_body(CLASS_A, 200, run_id=f"r{k}", seed=50 + k, first_timestamp_s=T0_S + 12 * k,
                         shared_prefix_fraction=0.4 if k >= 1 else 0.0) for k in range(3)]
    plain = make_steps("plain", 25, start_s=T0_S, step_interval_s=2.0, n_tenants=4)
    archive = tmp_path / "archive"
    writer = ArchiveWriter(str(archive), window_s=10.0)
    app = create_app(model_path, db_url, registry_refresh_s=0.0)
    with TestClient(app) as client:
        model = StepLatencyModel().fit(synthetic_trace(1500, seed=0, max_batch_size=16, shared_prefix_fraction=0.4,
                                                       coef_s={**DEFAULT_COEF_S, "effective_context_tokens": 2e-7}))
        model.engine_fingerprint_ = {"id": CLASS_A}  # fitted where prefixes are shared: it prices the shared part
        response = client.post("/v1/models", json={"model": model.to_dict(), "activate": True}, headers=bearer(admin))
        assert response.status_code in (200, 201), response.text
        for k, body in enumerate(bodies):
            sent = body
            if k == 2:  # sent without the sharing columns (as a format-v1 client sends steps), archived with them
                sent = {"columns": {n: v for n, v in body["columns"].items() if n not in SHARING_COLUMNS}}
            assert client.post("/v1/steps", json=sent, headers=bearer(admin)).status_code == 200
            for step in steps_of(body):
                writer.add_step(step)
        response = client.post("/v1/steps", json={"steps": plain}, headers=bearer(admin))
        assert response.status_code == 200, response.text
        for step in plain:
            writer.add_step(step)
    assert writer.close()
    return db_url, str(archive), model_path


def tenants_of(db_url: str) -> list[str]:
    ledger = Ledger(db_url)
    try:
        return [row.tenant for row in ledger.tenant_usage(*PERIOD_US)]
    finally:
        ledger.close()


def test_audit_equals_the_ledger_built_by_real_ingest(billed_and_archived):
    db_url, archive, model_path = billed_and_archived
    tenants = tenants_of(db_url)
    assert len(tenants) >= 3
    ledger = Ledger(db_url)
    try:
        default = StepLatencyModel.from_json(model_path)
        for tenant in tenants:
            result = audit_tenant(ledger, archive, tenant, *PERIOD_US, default)
            assert result.ok, result.to_dict()
            assert result.reattributed_ns == result.usage_ns > 0
            assert result.unbilled_steps == 0 and result.missing_steps == 0
        both = audit_tenant(ledger, archive, "tenant-0", *PERIOD_US, default)
        assert set(both.versions) == {f"{CLASS_A} 1", "(no fingerprint) default"}, both.versions
        # the check can fail: another default model re-attributes the service-model steps differently
        other = StepLatencyModel().fit(synthetic_trace(1500, coef_s={**DEFAULT_COEF_S, "decode_requests": 0.01}, seed=9))
        wrong = audit_tenant(ledger, archive, "tenant-0", *PERIOD_US, other)
        assert not wrong.ok and wrong.num_mismatched_steps > 0
    finally:
        ledger.close()
    out = invoke_cli("audit", "--archive", archive, "--db", db_url, "--tenant", "tenant-0", "--start", str(PERIOD[0]),
                     "--end", str(PERIOD[1]), "--model", str(model_path), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["difference_ns"] == 0 and report["audited_steps"] == both.audited_steps
    table = invoke_cli("audit", "--archive", archive, "--db", db_url, "--tenant", "tenant-0", "--start", str(PERIOD[0]),
                       "--end", str(PERIOD[1]), "--model", str(model_path))
    assert table.returncode == 0 and "OK: the ledger's bill equals" in table.stdout, table.stdout + table.stderr


def test_audit_flags_a_changed_ledger_row(billed_and_archived):
    db_url, archive, model_path = billed_and_archived
    engine = create_engine(db_url)
    with engine.begin() as conn:
        second = conn.execute(text("SELECT MIN(second_us) FROM usage_per_second WHERE tenant = 'tenant-1'")).scalar()
        changed = conn.execute(text("UPDATE usage_per_second SET attributed_ns = attributed_ns + 7 "
                                    "WHERE tenant = 'tenant-1' AND second_us = :s"), {"s": second}).rowcount
    engine.dispose()
    assert changed >= 1
    out = invoke_cli("audit", "--archive", archive, "--db", db_url, "--tenant", "tenant-1", "--start", str(PERIOD[0]),
                     "--end", str(PERIOD[1]), "--model", str(model_path), "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is False and report["difference_ns"] == -7 * changed
    # the other tenants' bills are untouched
    fine = invoke_cli("audit", "--archive", archive, "--db", db_url, "--tenant", "tenant-0", "--start", str(PERIOD[0]),
                      "--end", str(PERIOD[1]), "--model", str(model_path), "--json")
    assert fine.returncode == 0, fine.stdout + fine.stderr


def test_audit_counts_adjustments_beside_the_bill(billed_and_archived):
    db_url, archive, model_path = billed_and_archived
    ledger = Ledger(db_url)
    try:
        ledger.add_model(CLASS_A, json.dumps(class_model(CLASS_A, coef_s={**DEFAULT_COEF_S, "decode_context_tokens": DEFAULT_COEF_S["decode_context_tokens"] / 5,
                                                                   "decode_requests": DEFAULT_COEF_S["decode_requests"] * 3}, seed=3).to_dict()), "v2", activate=True)
        adjustment = adjust_period(ledger, CLASS_A, *PERIOD_US, to_version=2)
        delta = {e.tenant: e.delta_ns for e in adjustment.entries}
        result = audit_tenant(ledger, archive, "tenant-0", *PERIOD_US, StepLatencyModel.from_json(model_path))
    finally:
        ledger.close()
    assert result.ok, result.to_dict()  # the bill is not rewritten: v1 still re-attributes it exactly
    assert result.adjusted_ns == delta.get("tenant-0", 0) != 0 and result.net_billed_ns == result.usage_ns + result.adjusted_ns
    assert result.adjustments_checked == 1 and result.adjustment_mismatches == []  # v2 re-attributes the archive to it
    engine = create_engine(db_url)
    with engine.begin() as conn:  # a changed adjustment row is caught as well
        assert conn.execute(text("UPDATE adjustments SET reattributed_ns = reattributed_ns + 5 WHERE tenant = 'tenant-0'")).rowcount == 1
    engine.dispose()
    out = invoke_cli("audit", "--archive", archive, "--db", db_url, "--tenant", "tenant-0", "--start", str(PERIOD[0]),
                     "--end", str(PERIOD[1]), "--model", str(model_path), "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    (mismatch,) = json.loads(out.stdout)["adjustment_mismatches"]
    assert mismatch["adjusted_to_ns"] == mismatch["reattributed_ns"] + 5 and mismatch["to_version"] == 2


@pytest.mark.parametrize("case", ["missing archive", "bad url", "no steps", "missing ledger", "bad time"])
def test_bad_input_is_one_line_and_exit_2(billed_and_archived, tmp_path, case):
    db_url, archive, model_path = billed_and_archived
    args = {"--archive": archive, "--db": db_url, "--tenant": "tenant-0", "--start": str(PERIOD[0]), "--end": str(PERIOD[1])}
    expected = {"missing archive": "no such directory", "bad url": "not a usable URL", "no steps": "no steps of tenant",
                "missing ledger": "no such ledger file", "bad time": "--start: expected an ISO 8601 time"}[case]
    if case == "missing archive":
        args["--archive"] = str(tmp_path / "nowhere")
    elif case == "bad url":
        args["--archive"] = "nosuchprotocol://bucket/x"
    elif case == "no steps":
        args["--tenant"] = "nobody"
    elif case == "missing ledger":
        args["--db"] = f"sqlite:///{tmp_path}/none.db"
    else:
        args["--start"] = "yesterday"
    out = run_cli("audit", *[x for pair in args.items() for x in pair], "--model", str(model_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert expected in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_refit_reads_the_archive(billed_and_archived, tmp_path):
    """`llmvisor refit --from-archive`: the class's archived steps (all 600, none of the unfingerprinted ones)."""
    db_url, archive, _model_path = billed_and_archived
    out = invoke_cli("refit", "--class", CLASS_A, "--from-archive", archive, "--db", db_url, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["train_steps"] + result["test_steps"] == 600 and result["version"] == 2
    ledger = Ledger(db_url)
    try:
        assert [m.source for m in ledger.list_models(CLASS_A)][-1].startswith(f"refit from the archive {archive}: 480 steps fitted")
    finally:
        ledger.close()
    missing = run_cli("refit", "--class", CLASS_A, "--from-archive", str(tmp_path / "nowhere"), "--db", db_url)
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
