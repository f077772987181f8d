"""A fleet: several `llmvisor serve` processes on one PostgreSQL, as behind a load balancer. A step sent to two
processes at once is stored once (the other answer is a duplicate, or a 409 if it differs, never a 500), the
processes' own counters add up to the ledger's totals, and a real Prometheus summing them sees the same
per-tenant totals as the usage API."""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from _prometheus import PROMETHEUS_BINARY, PrometheusServer
from _service_fixtures import POSTGRES_URL, bearer, empty_postgres, make_steps, measured_ns, model_path  # noqa: F401
from llmvisor.core.model import StepLatencyModel
from llmvisor.ledger import Ledger, StepConflictError
from llmvisor.service.ingest import prepare_batch, validate_trace
from llmvisor.service.process import ServerProcess

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not POSTGRES_URL, reason="LLMVISOR_TEST_POSTGRES_URL not set (scripts/start-postgres.sh)"),
]
N_PROCESSES = 2
SERVICE_START_TIMEOUT_S = 120.0  # both import at once on a small machine: more than a lone start's 30 s


def changed(groups: list[list[dict]]) -> list[list[dict]]:
    """The same step ids with other content (a longer first step)."""
    other = copy.deepcopy(groups)
    for row in other[0]:
        row["step_latency_s"] = round(row["step_latency_s"] + 0.001, 6)
    return other


@pytest.fixture
def fleet(model_path, tmp_path):
    """Two service processes on one empty PostgreSQL ledger, and an admin key."""
    url = empty_postgres(POSTGRES_URL)
    ledger = Ledger(url)
    key = ledger.create_key(is_admin=True)
    servers = [ServerProcess(model_path, url, log_path=tmp_path / f"server-{i}.log") for i in range(N_PROCESSES)]
    try:
        # Started side by side, as a fleet comes up: each start is mostly imports, so one after the other took twice as long.
        with ThreadPoolExecutor(N_PROCESSES) as pool:
            for started in [pool.submit(server.start, SERVICE_START_TIMEOUT_S) for server in servers]:
                started.result()
        yield ledger, key, servers
    finally:
        for server in servers:
            server.stop()
        ledger.close()


def scraped_samples(servers: list[ServerProcess], key: str) -> list[dict[tuple, float]]:
    """Each process's /metrics as {(sample name, labels...): value}."""
    per_process = []
    for server in servers:
        text = httpx.get(f"{server.url}/metrics", headers=bearer(key), timeout=10.0).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, *sorted(sample.labels.items()))] = sample.value
        per_process.append(samples)
    return per_process


def fleet_sum(per_process: list[dict[tuple, float]], name: str, **labels: str) -> float:
    key = (name, *sorted(labels.items()))
    return sum(samples.get(key, 0.0) for samples in per_process)


@pytest.mark.parametrize("resend", ["identical", "conflicting"])
def test_a_step_stored_by_another_process_after_the_lookup_is_answered_from_its_commit(model_path, monkeypatch, resend):
    """The race, made certain: process A looks the steps up (none stored), process B stores them, then A
    inserts. A's insert fails on the primary key and its retry answers from B's commit."""
    url = empty_postgres(POSTGRES_URL)
    model = StepLatencyModel.from_json(model_path)
    groups = make_steps("race", 12)
    a, b = Ledger(url), Ledger(url)
    a_records = prepare_batch(model, validate_trace(groups), received_at_us=0).records
    b_groups = groups if resend == "identical" else changed(groups)
    b_records = prepare_batch(model, validate_trace(b_groups), received_at_us=0).records
    looked_up, go_on = threading.Event(), threading.Event()
    found: list[int] = []
    lookup = a._stored_hashes

    def lookup_then_wait(conn, keys):
        stored = lookup(conn, keys)
        found.append(len(stored))
        if len(found) == 1:
            looked_up.set()
            go_on.wait(30)
        return stored

    monkeypatch.setattr(a, "_stored_hashes", lookup_then_wait)
    result: dict = {}

    def ingest_a():
        try:
            result["outcome"] = a.ingest(a_records)
        except Exception as error:
            result["error"] = error

    thread = threading.Thread(target=ingest_a)
    thread.start()
    try:
        assert looked_up.wait(30)
        assert b.ingest(b_records).n_inserted == 12
    finally:
        go_on.set()
        thread.join(60)
    assert found == [0, 12]
    if resend == "identical":
        assert result["outcome"].n_inserted == 0 and result["outcome"].n_duplicate == 12
    else:
        assert isinstance(result.get("error"), StepConflictError), result
    totals = a.totals()
    assert (totals.num_steps, totals.measured_ns, totals.attributed_ns) == (12, measured_ns(b_groups), measured_ns(b_groups))
    a.close()
    b.close()


def test_concurrent_sends_to_two_processes_are_stored_once_and_their_counters_add_up(fleet):
    ledger, key, servers = fleet
    n_rounds, steps_per_round = 10, 80
    expected_ns = 0
    statuses: list[list[int]] = []
    responses: list[list[dict]] = []
    for r in range(n_rounds):
        groups = make_steps(f"round-{r}", steps_per_round, batch_size=8, n_tenants=4, seed=r)
        bodies = [groups, groups if r % 2 == 0 else changed(groups)]
        barrier = threading.Barrier(N_PROCESSES)
        answers: list = [None] * N_PROCESSES

        def send(i, bodies=bodies, barrier=barrier, answers=answers):
            with httpx.Client(base_url=servers[i].url, headers=bearer(key), timeout=30.0) as client:
                content = httpx.Request("POST", "/", json={"steps": bodies[i]}).content
                barrier.wait(10)
                answers[i] = client.post("/v1/steps", content=content, headers={"Content-Type": "application/json"})

        threads = [threading.Thread(target=send, args=(i,)) for i in range(N_PROCESSES)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        statuses.append([a.status_code for a in answers])
        responses.append([a.json() for a in answers])
        winner = next(i for i, a in enumerate(answers) if a.status_code == 200)
        expected_ns += measured_ns(bodies[winner])

    for r, (codes, bodies) in enumerate(zip(statuses, responses)):
        if r % 2 == 0:
            assert codes == [200, 200], bodies
            assert sorted(b["steps_inserted"] for b in bodies) == [0, steps_per_round]
            assert sum(b["steps_duplicate"] for b in bodies) == steps_per_round
        else:
            assert sorted(codes) == [200, 409], bodies
            assert [b["steps_inserted"] for b in bodies if "steps_inserted" in b] == [steps_per_round]

    totals = ledger.totals()
    assert totals.num_steps == n_rounds * steps_per_round
    assert totals.measured_ns == totals.attributed_ns == expected_ns

    per_process = scraped_samples(servers, key)
    assert fleet_sum(per_process, "llmvisor_steps_ingested_total") == totals.num_steps
    assert fleet_sum(per_process, "llmvisor_steps_duplicate_total") == steps_per_round * (n_rounds // 2)
    assert fleet_sum(per_process, "llmvisor_ingest_errors_total", reason="conflict") == n_rounds // 2
    assert fleet_sum(per_process, "llmvisor_measured_seconds_total") == pytest.approx(totals.measured_ns / 1e9, rel=1e-12)
    for row in ledger.tenant_usage():
        assert fleet_sum(per_process, "llmvisor_attributed_seconds_total", tenant=row.tenant) == pytest.approx(
            row.attributed_ns / 1e9, rel=1e-12
        )


@pytest.mark.skipif(PROMETHEUS_BINARY is None, reason="no prometheus binary on PATH (scripts/install-test.sh installs Debian's prometheus)")
def test_prometheus_sums_the_processes_to_the_ledgers_per_tenant_totals(fleet, tmp_path):
    ledger, key, servers = fleet
    targets = [server.url.removeprefix("http://") for server in servers]
    with PrometheusServer(targets, key, tmp_path) as prometheus:
        for i in range(6):
            server = servers[i % N_PROCESSES]
            groups = make_steps(f"fleet-{i}", 150, batch_size=8, n_tenants=5, seed=100 + i)
            with httpx.Client(base_url=server.url, headers=bearer(key), timeout=30.0) as client:
                assert client.post("/v1/steps", json={"steps": groups}).status_code == 200
            # The same steps again through the other process: acknowledged, and counted by neither.
            other = servers[(i + 1) % N_PROCESSES]
            with httpx.Client(base_url=other.url, headers=bearer(key), timeout=30.0) as client:
                assert client.post("/v1/steps", json={"steps": groups[:40]}).json()["steps_duplicate"] == 40
        done_s = time.time()
        prometheus.wait_for_scrapes_after(done_s, N_PROCESSES)

        per_tenant = prometheus.query('sum without (instance) (llmvisor_attributed_seconds_total{job="llmvisor"})')
        seconds = {sample["metric"]["tenant"]: float(sample["value"][1]) for sample in per_tenant}
        ledger_seconds = {row.tenant: row.attributed_ns / 1e9 for row in ledger.tenant_usage()}
        assert len(ledger_seconds) == 5
        assert seconds == pytest.approx(ledger_seconds, rel=1e-9)

        totals = ledger.totals()
        [steps] = prometheus.query('sum(llmvisor_steps_ingested_total{job="llmvisor"})')
        [measured] = prometheus.query('sum(llmvisor_measured_seconds_total{job="llmvisor"})')
        assert float(steps["value"][1]) == totals.num_steps == 900
        assert float(measured["value"][1]) == pytest.approx(totals.measured_ns / 1e9, rel=1e-9)
        by_instance = prometheus.query('sum by (instance) (llmvisor_steps_ingested_total{job="llmvisor"})')
        assert sorted(float(s["value"][1]) for s in by_instance) == [450, 450]
