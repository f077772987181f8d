"""`llmvisor load --engines N --mode aggregate` on SQLite: every offered step covered by an acknowledged window,
the keys docs/results/scale.json is made of, and `llmvisor audit` of the run equal to the archive's re-attribution
(and not equal once a window's stored share is changed). scripts/measure-fleet.sh runs the large fleets."""

from __future__ import annotations

import json
import math
import sqlite3
import sys

import pytest

from _cli import invoke_cli
from _processes import run_process
from _service_fixtures import model_path  # noqa: F401
from llmvisor.metering import WindowAggregate
from llmvisor.service.fleet_edge import EdgeSpec, build_engines

ISSUE_KEYS = ("settings.mode", "settings.engines", "settings.window_s", "offered_steps_per_s", "steps_covered_per_s",
              "staleness_s.p99", "archive_bytes_per_step")


def value_at(run: dict, dotted: str):
    value = run
    for part in dotted.split("."):
        value = value[part]
    return value


def audit(db_url: str, archive: str, tenant: str, start_s: int, end_s: int, model_path, *more: str) -> tuple[int, dict]:
    """``llmvisor audit --json`` in this process (`invoke_cli`): its report is what is checked."""
    completed = invoke_cli("audit", "--archive", archive, "--tenant", tenant, "--start", str(start_s), "--end", str(end_s),
                           "--db", db_url, "--model", str(model_path), "--json", *more)
    return completed.returncode, json.loads(completed.stdout)


def test_a_built_engines_windows_cover_its_steps_once_and_reconcile(model_path):
    from llmvisor.core.model import StepLatencyModel

    model = StepLatencyModel.from_json(model_path)
    spec = EdgeSpec(index=4, tag="t", steps_per_s=50.0, batch_size=8, n_tenants=3, window_s=1.0, duration_s=3.0,
                    base_s=1_750_000_000.0, archive_url=None, offset_s=0.01)
    [engine] = build_engines([spec], model, 7, workers=1)
    windows = [WindowAggregate.from_json(json.loads(w.body)) for w in engine.windows]
    assert engine.num_steps == int((3.0 - 0.01) * 50) == sum(w.num_steps for w in windows)
    assert [int(i) for w in windows for i in w.step_ids()] == list(range(engine.num_steps))
    assert all(w.attributed_ns == w.measured_ns and w.model_version == 7 for w in windows)
    # each window is sent when the step after it ends; the last at the run's end
    assert [w.close_s for w in engine.windows] == pytest.approx([1.0 + 1 / 50, 2.0 + 1 / 50, 3.0], abs=0.021)
    long = [q for w in windows for q in w.requests if q.request_id == "long"]
    assert sum(q.num_steps for q in long) == engine.num_steps  # the probe's request runs in every step
    assert {q.tenant for w in windows for q in w.requests} <= {"tenant-0", "tenant-1", "tenant-2"}
    assert engine.finished_requests > 0  # request lengths from the workload mix: requests end and new ones start


def test_an_aggregate_fleet_on_sqlite_is_covered_and_audits_exactly(model_path, tmp_path):
    db_url = f"sqlite:///{tmp_path}/ledger.db"
    archive = str(tmp_path / "archive")
    completed = run_process(
        [sys.executable, "-m", "llmvisor.cli", "load", "--engines", "3", "--processes", "2", "--mode", "aggregate",
         "--batch-size", "8", "--max-seconds", "5", "--db", db_url, "--archive", archive, "--model", str(model_path), "--json"],
        timeout_s=300,
    )
    assert completed.returncode == 0, completed.stderr
    [run] = json.loads(completed.stdout)["runs"]
    for key in ISSUE_KEYS:
        value_at(run, key)  # every key the scale result is read by
    assert run["postgres_per_step"] is None  # SQLite: no WAL position to read
    assert run["settings"]["mode"] == "aggregate" and run["settings"]["engines"] == 3 and run["settings"]["window_s"] == 1.0
    aggregate = run["aggregate"]
    assert aggregate["steps_offered"] == run["steps_acknowledged"] > 0
    assert aggregate["steps_uncovered_at_end"] == 0 and run["failed_posts"] == 0 and run["reconciled"]
    assert aggregate["windows_acknowledged"] == aggregate["windows_built"]
    assert run["steps_covered_per_s"] > 0 and aggregate["accepted_windows_per_s"] > 0
    assert run["staleness_s"]["n"] > 0 and run["staleness_s"]["p99"] > 0
    assert run["archive_bytes_per_step"] > 0 and aggregate["engine_cpu_s_per_step"]["total"] > 0
    start_s, end_s = math.floor(aggregate["period_s"][0]), math.ceil(aggregate["period_s"][1])

    code, result = audit(db_url, archive, "tenant-1", start_s, end_s, model_path)
    assert code == 0 and result["ok"], result
    assert result["window_steps"] == result["audited_steps"] > 0 and result["windows_checked"] > 0
    assert result["reattributed_ns"] == result["usage_ns"] == result["billed_windows_ns"] > 0
    # the tenant's requests re-attributed from the archive are the ledger's request rows (kept by default), exactly
    code, listed = audit(db_url, archive, "tenant-1", start_s, end_s, model_path, "--requests", "100000")
    assert code == 0 and sum(r["attributed_ns"] for r in listed["requests"]) == result["reattributed_ns"]
    from llmvisor.ledger import Ledger

    ledger = Ledger(db_url)
    try:
        runs = {r["run_id"] for r in listed["requests"]}
        stored = {(r.run_id, r.request_id): (r.attributed_ns, r.num_steps)
                  for r in ledger.request_usage(tenant="tenant-1", limit=100_000) if r.run_id in runs}
    finally:
        ledger.close()
    assert {(r["run_id"], r["request_id"]): (r["attributed_ns"], r["num_steps"]) for r in listed["requests"]} == stored

    with sqlite3.connect(tmp_path / "ledger.db") as conn:  # one second's stored window usage of the tenant, off by 1 ns
        changed = conn.execute("UPDATE tenant_seconds SET attributed_ns = attributed_ns + 1 WHERE rowid = (SELECT min(rowid) "
                               "FROM tenant_seconds WHERE tenant = 'tenant-1' AND second_us >= ?)", (start_s * 1_000_000,)).rowcount
    assert changed == 1
    code, result = audit(db_url, archive, "tenant-1", start_s, end_s, model_path)
    assert code == 1 and not result["ok"] and result["num_mismatched_windows"] == 1
    assert result["usage_ns"] - result["reattributed_ns"] == 1
