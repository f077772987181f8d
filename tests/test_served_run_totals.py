"""A recorded served run (the shipped multi-tenant trace, recorded from vLLM) billed through the ledger: per tenant,
per request and in total, the ledger holds exactly the nanoseconds the core's attribution gives, on SQLite and
PostgreSQL. The ledger's storage and queries can be reorganised freely; these totals must not move by one
nanosecond (issue #40: the ledger split was checked with this test before and after)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

pytest.importorskip("sqlalchemy")

from _service_fixtures import db_url  # noqa: E402,F401
from llmvisor.core.attribution import attribute  # noqa: E402
from llmvisor.core.model import StepLatencyModel  # noqa: E402
from llmvisor.core.rounding import apportion_ns  # noqa: E402
from llmvisor.core.trace import read_trace  # noqa: E402
from llmvisor.ledger import Ledger  # noqa: E402
from llmvisor.service.ingest import prepare_batch  # noqa: E402
from llmvisor.shipped import MULTI_TENANT_TRACE, latency_model_path, trace_path  # noqa: E402

BATCH_STEPS = 500
"""Steps per ingest call, as a pusher sends them (several transactions, so the sums cross batches)."""


def test_a_recorded_served_run_is_billed_to_the_nanosecond(db_url):  # noqa: F811
    trace = read_trace(trace_path(MULTI_TENANT_TRACE))
    model = StepLatencyModel.from_json(latency_model_path())
    measured_ns = np.rint(trace.step_latency_s_per_step * 1e9).astype(np.int64)
    share_ns = apportion_ns(attribute(model, trace).share_s, trace.step_offsets, measured_ns)
    per_tenant: Counter[str] = Counter()
    per_request: Counter[tuple[str, str]] = Counter()
    run_of_slice = np.repeat(trace.run_id_per_step, trace.batch_size_per_step)
    for tenant, run_id, request_id, ns in zip(trace.tenant.tolist(), run_of_slice.tolist(), trace.request_id.tolist(),
                                              share_ns.tolist()):
        per_tenant[tenant] += ns
        per_request[(run_id, request_id)] += ns
    assert len(per_tenant) >= 3 and sum(per_tenant.values()) == int(measured_ns.sum())

    ledger = Ledger(db_url)
    try:
        step_index = np.arange(trace.n_steps)
        for start in range(0, trace.n_steps, BATCH_STEPS):
            part = trace.select_steps((step_index >= start) & (step_index < start + BATCH_STEPS))
            outcome = ledger.ingest(prepare_batch(model, part, received_at_us=0).records)
            assert outcome.n_duplicate == 0
        assert {r.tenant: r.attributed_ns for r in ledger.tenant_usage()} == dict(per_tenant)
        stored = {(r.run_id, r.request_id): r.attributed_ns for r in ledger.request_usage(limit=len(per_request) + 1)}
        assert stored == dict(per_request)
        totals = ledger.totals()
        assert totals.num_steps == trace.n_steps and totals.num_slices == trace.n_slices
        assert totals.measured_ns == totals.attributed_ns == int(measured_ns.sum())
    finally:
        ledger.close()
