"""The service's ingest takes the generated valid traces of `_trace_strategies` (the ones the core commands are
checked on): each batch is accepted or refused with a 4xx naming the reason, never a 5xx, and what the ledger
holds per tenant adds up to the measured time of the accepted steps, to the nanosecond."""

from __future__ import annotations

import itertools

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from _service_fixtures import bearer, measured_ns, model_path  # noqa: F401
from _trace_strategies import stranger_traces
from llmvisor.ledger import Ledger
from llmvisor.service.app import create_app

STEPS_PER_POST = 200
EXAMPLES = itertools.count()


@pytest.fixture(scope="module")
def service(model_path, tmp_path_factory):  # noqa: F811
    url = f"sqlite:///{tmp_path_factory.mktemp('stranger')}/ledger.db"
    ledger = Ledger(url)
    admin = bearer(ledger.create_key(is_admin=True))
    ledger.close()
    with TestClient(create_app(model_path, url, max_body_bytes=20_000_000, max_steps_per_request=STEPS_PER_POST)) as client:
        yield client, admin


def tenant_totals_ns(client, admin) -> dict[str, int]:
    response = client.get("/v1/usage/tenants", headers=admin)
    assert response.status_code == 200, response.text
    return {row["tenant"]: row["attributed_ns"] for row in response.json()["tenants"]}


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(generated=stranger_traces(max_long_run=1000))
def test_generated_traces_are_ingested_or_refused_with_a_4xx_and_the_ledger_adds_up(service, generated):
    client, admin = service
    example = next(EXAMPLES)
    steps = generated.step_rows()
    for step in steps:  # each example's runs are new to the ledger
        for row in step:
            row["run_id"] = f"{row['run_id']}#{example}"
    before = tenant_totals_ns(client, admin)
    accepted = []
    for start in range(0, len(steps), STEPS_PER_POST):
        batch = steps[start : start + STEPS_PER_POST]
        response = client.post("/v1/steps", json={"steps": batch}, headers=admin)
        assert response.status_code < 500, response.text
        if response.status_code == 200:
            body = response.json()
            assert body["steps_inserted"] == len(batch) and body["steps_pending"] == 0
            assert body["attributed_ns"] == measured_ns(batch)
            accepted += batch
        else:
            assert 400 <= response.status_code < 500
            detail = response.json().get("detail")
            assert isinstance(detail, str) and detail.strip() and "\n" not in detail.strip(), response.text
    after = tenant_totals_ns(client, admin)
    assert all(after.get(tenant, 0) >= ns for tenant, ns in before.items())
    assert sum(after.values()) - sum(before.values()) == measured_ns(accepted)
    assert accepted == steps, "a valid trace was refused"
