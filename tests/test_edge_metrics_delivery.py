"""Engine-side window metrics on both delivery paths, with a real `StepRelay` (`tests/_relay_engine.py`), real
delivery processes and a real `llmvisor serve`: windows counted first in the delivery process and then, once
delivery processes keep dying, in the engine process itself land in one PROMETHEUS_MULTIPROC_DIR, and a collector
over it (as vLLM's API server runs one) holds the ledger's per-tenant totals."""

from __future__ import annotations

import math
import os
import signal
import time
from collections import defaultdict

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import case, create_engine, func, select

from _service_fixtures import model_path  # noqa: F401
from llmvisor.client import MAX_DELIVERY_RESTARTS, process_running
from llmvisor.ledger.schema import tenant_seconds, windows
from test_delivery_loss import RelayEngine, service  # noqa: F401

RUN = "edge-fallback"


def ledger_windows(db_url: str) -> tuple[int, int, dict[str, dict[str, int]]]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            # window usage is kept per tenant and second (schema 7), not per run: every window here is the run's
            # (one statement: the delivery process may commit windows between two)
            mine = windows.c.run_id.like(f"{RUN}%")
            n, steps, every = conn.execute(select(func.coalesce(func.sum(case((mine, 1), else_=0)), 0),
                                                  func.coalesce(func.sum(case((mine, windows.c.num_steps), else_=0)), 0),
                                                  func.count()).select_from(windows)).one()
            assert every == n
            t = tenant_seconds.c
            rows = conn.execute(select(t.tenant, func.sum(t.measured_ns), func.sum(t.num_slices), func.sum(t.num_new_tokens))
                                .group_by(t.tenant)).all()
    finally:
        engine.dispose()
    return int(n), int(steps), {r[0]: {"measured_ns": int(r[1]), "num_slices": int(r[2]), "num_new_tokens": int(r[3])} for r in rows}


def taken_over(engine: RelayEngine) -> bool:
    return "from the engine process from now on" in engine.log_path.read_text(errors="replace")


def wait_for_window_steps(db_url: str, expected: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ledger_windows(db_url)[1] < expected:
        assert time.monotonic() < deadline, f"the ledger's windows cover {ledger_windows(db_url)[1]} of {expected} steps"
        time.sleep(0.1)


@pytest.mark.parametrize("service", ["windows"], indirect=True)  # the service with the relay's class model active
def test_windows_counted_by_the_delivery_process_and_then_the_engine_process_add_up_to_the_ledger(service, tmp_path, monkeypatch):  # noqa: F811
    server, ledger, key = service
    folder = tmp_path / "metrics"
    folder.mkdir()
    monkeypatch.setenv("LLMVISOR_STORE_STEPS", "0")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    # 10 steps of 16 requests each a window: a 1 s window of this stand-in (100 steps, 1,600 requests) is a body
    # larger than the service takes (413)
    monkeypatch.setenv("LLMVISOR_WINDOW_S", "0.1")
    engine = RelayEngine(tmp_path, server.url, key, RUN, mode="windows")
    try:
        assert engine.ask("send 300", "sent") == ["sent", "300"]
        wait_for_window_steps(ledger.url, 300)  # counted and delivered by the first delivery process
        time.sleep(1.0)  # its report that they are safe reaches the engine: nothing is re-sent to the next ones
        for _ in range(MAX_DELIVERY_RESTARTS + 1):  # the last death makes the engine process deliver by itself
            pid = int(engine.ask("pid", "pid")[1])
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while process_running(pid) or (int(engine.ask("pid", "pid")[1]) == pid and not taken_over(engine)):
                assert time.monotonic() < deadline, engine.log_path.read_text(errors="replace")[-3000:]
                time.sleep(0.1)
        assert taken_over(engine)
        assert engine.ask("send 200", "sent") == ["sent", "500"]  # counted in the engine process
        engine.ask("close", "closed")
        engine.command("exit")
        assert engine.process.wait(60) == 0
    finally:
        engine.stop()
    n_windows, n_steps, tenants = ledger_windows(ledger.url)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    found: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found[sample.name][sample.labels.get("tenant", "")] += sample.value
    assert n_steps == 500 and len(tenants) == 3
    assert found["llmvisor_engine_steps_total"][""] == 500 and found["llmvisor_engine_windows_total"][""] == n_windows
    for tenant, totals in tenants.items():
        assert math.isclose(found["llmvisor_engine_tenant_measured_seconds_total"][tenant], totals["measured_ns"] / 1e9, rel_tol=1e-12)
        assert found["llmvisor_engine_slices_total"][tenant] == totals["num_slices"]
        assert found["llmvisor_engine_new_tokens_total"][tenant] == totals["num_new_tokens"]
