"""`llmvisor adjust` in window mode: a ledger and an archive made by the real window path (`llmvisor load --mode
aggregate --archive`: engines attribute at the edge, POST window aggregates to real service processes, archive
their raw steps), then a period re-attributed from the archive with a second model version.

Expected values are computed apart from `llmvisor.service.adjust`: billed is the ledger's usage of the period
(what bills are made of), re-attributed is the archive's Parquet files read with pyarrow and attributed with the
edge's own window code (`llmvisor.metering.aggregate_window`) under the new version.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _cli import invoke_cli
from _processes import cli_process, run_process
from _service_fixtures import class_model, model_path  # noqa: F401
from llmvisor.core.synthetic import DEFAULT_COEF_S
from llmvisor.ledger import Ledger
from llmvisor.metering.windows import aggregate_window
from llmvisor.service.fleet_edge import ENGINE_CLASS

WINDOW_S = 2
"""Windows of 2 s (on a grid of 2 s since 1970), so a bound on an odd second cuts them."""


def cli(*args: str, timeout_s: float = 300):
    """``llmvisor ARGS`` as its own process, for the refusals (`cli_process`); the commands checked by their output
    run in this process (`invoke_cli`)."""
    return cli_process(*args, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def fleet(model_path, tmp_path_factory):  # noqa: F811
    """(ledger file, archive directory, period in whole seconds on window edges) of one aggregate load run, billed
    by version 1 (load's --model), with a version 2 of the class stored and active."""
    root = tmp_path_factory.mktemp("fleet")
    db_url, archive = f"sqlite:///{root}/ledger.db", root / "archive"
    done = run_process([sys.executable, "-m", "llmvisor.cli", "load", "--engines", "2", "--processes", "1", "--mode", "aggregate",
                        "--window-s", str(WINDOW_S), "--batch-size", "6", "--max-seconds", "4", "--db", db_url, "--archive", str(archive),
                        "--model", str(model_path), "--json"], timeout_s=300)  # it starts processes of its own: stopped with its group
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(done.stdout)["runs"][0] if "runs" in json.loads(done.stdout) else json.loads(done.stdout)
    first_s, last_s = run["aggregate"]["period_s"]
    period = (math.floor(first_s / WINDOW_S) * WINDOW_S, math.ceil(last_s / WINDOW_S) * WINDOW_S + WINDOW_S)
    coef = {**DEFAULT_COEF_S, "decode_context_tokens": DEFAULT_COEF_S["decode_context_tokens"] * 5}  # another split
    ledger = Ledger(db_url)
    try:
        assert ledger.active_versions() == {ENGINE_CLASS: 1}
        assert ledger.billed_steps(ENGINE_CLASS, period[0] * 1_000_000, period[1] * 1_000_000).keys == []  # no step rows
        ledger.add_model(ENGINE_CLASS, json.dumps(class_model(ENGINE_CLASS, coef_s=coef, seed=3).to_dict()), "v2.json", activate=True)
    finally:
        ledger.close()
    return root / "ledger.db", archive, period


@pytest.fixture
def copy(fleet, tmp_path):
    """A copy of the fleet's ledger (each test writes its own) and the archive."""
    db_file, archive, period = fleet
    shutil.copy(db_file, tmp_path / "ledger.db")
    return f"sqlite:///{tmp_path}/ledger.db", archive, period


def archived_steps(archive: Path, start_s: int, end_s: int) -> dict[str, list]:
    """Per run, its archived steps starting in [start_s, end_s) as the edge aggregates them, read with pyarrow alone."""
    table = pa.concat_tables([pq.read_table(path) for path in sorted(archive.rglob("*.parquet"))], promote_options="permissive")
    rows = table.select(["run_id", "step_id", "timestamp_s", "step_latency_s", "request_id", "tenant", "num_new_tokens",
                         "num_context_tokens", "phase"]).to_pylist()
    steps: dict[tuple[str, int], tuple[int, float, list]] = {}
    for r in rows:
        when_us = int(round(r["timestamp_s"] * 1e6))
        if not start_s * 1_000_000 <= when_us < end_s * 1_000_000:
            continue
        _w, _l, slices = steps.setdefault((r["run_id"], r["step_id"]), (when_us, r["step_latency_s"], []))
        slices.append([r["request_id"], r["tenant"], r["num_new_tokens"], r["num_context_tokens"], r["phase"] == "prefill"])
    runs: dict[str, list] = {}
    for (run, step), (when_us, latency_s, slices) in sorted(steps.items()):
        runs.setdefault(run, []).append((step, when_us, latency_s, slices))
    return runs


def reattributed(archive: Path, start_s: int, end_s: int, model, version: int) -> dict[str, int]:
    """Per tenant, the archived steps of the period attributed by the edge's window code with ``model``."""
    out: dict[str, int] = {}
    for run, steps in archived_steps(archive, start_s, end_s).items():
        window = aggregate_window(run, ENGINE_CLASS, start_s * 1_000_000, end_s * 1_000_000, steps, (model, version))
        for request in window.requests:
            out[request.tenant] = out.get(request.tenant, 0) + request.attributed_ns
    return out


def test_adjust_in_window_mode_equals_reattributed_minus_billed_and_is_exported(copy, tmp_path):
    db_url, archive, (start_s, end_s) = copy
    ledger = Ledger(db_url)
    billed = {row.tenant: row.attributed_ns for row in ledger.tenant_usage(start_s * 1_000_000, end_s * 1_000_000)}
    from llmvisor.service.registry import load_version

    expected = reattributed(archive, start_s, end_s, load_version(ledger, ENGINE_CLASS, 2), 2)
    ledger.close()
    assert len(billed) >= 2 and sum(billed.values()) == sum(expected.values()) > 0

    span = ("--start", str(start_s), "--end", str(end_s))
    refused = cli("adjust", "--class", ENGINE_CLASS, *span, "--db", db_url)
    assert refused.returncode == 2 and "give --archive URL" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1

    done = invoke_cli("adjust", "--class", ENGINE_CLASS, *span, "--db", db_url, "--archive", str(archive), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["to_version"] == 2 and result["from_versions"] == "1" and result["written"] is True
    assert result["window_steps"] == result["num_steps"] > 0 and result["num_windows"] > 0
    entries = {e["tenant"]: e for e in result["tenants"]}
    assert set(entries) == set(billed) == set(expected)
    for tenant, entry in entries.items():
        assert entry["billed_ns"] == billed[tenant]
        assert entry["reattributed_ns"] == expected[tenant]
        assert entry["delta_ns"] == expected[tenant] - billed[tenant]
    assert sum(e["delta_ns"] for e in entries.values()) == 0 == result["total_delta_ns"]
    assert max(abs(e["delta_ns"]) for e in entries.values()) > 1e5, "the second version should move time between tenants"

    # The audit checks the adjusted period against the archive as it checks a step-mode one.
    tenant = sorted(entries)[0]
    audit = invoke_cli("audit", "--archive", str(archive), "--tenant", tenant, *span, "--db", db_url, "--json")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    audited = json.loads(audit.stdout)
    assert audited["ok"] and audited["adjustments_checked"] == 1 and audited["adjustment_mismatches"] == []
    assert audited["net_billed_ns"] == expected[tenant]

    # The export shows each entry as an adjustment row of its own, beside the unchanged usage.
    prices = tmp_path / "prices.toml"
    hour_s = start_s // 3600 * 3600
    prices.write_text(f'[[price]]\nengine_class = "{ENGINE_CLASS}"\ncurrency = "USD"\nengine_hour_price = "3.5"\nvalid_from = {hour_s}\n')
    assert invoke_cli("prices", "add", str(prices), "--db", db_url).returncode == 0
    out = tmp_path / "focus.csv"
    export = invoke_cli("export", "--format", "focus", "--start", str(hour_s), "--end", str(math.ceil(end_s / 3600) * 3600),
                        "--db", db_url, "-o", str(out))
    assert export.returncode == 0, export.stderr
    with out.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    adjusted = {r["SubAccountId"]: int(r["x_AttributedNs"]) for r in rows if r["ChargeCategory"] == "Adjustment"}
    assert adjusted == {t: e["delta_ns"] for t, e in entries.items()}
    usage: dict[str, int] = {}
    for r in rows:
        if r["ChargeCategory"] == "Usage":
            usage[r["SubAccountId"]] = usage.get(r["SubAccountId"], 0) + int(r["x_AttributedNs"])
    assert usage == billed

    again = cli("adjust", "--class", ENGINE_CLASS, *span, "--db", db_url, "--archive", str(archive))
    assert again.returncode == 2 and "already adjusted to model version 2" in again.stderr


def test_adjust_in_window_mode_refuses_an_archive_missing_part_of_the_period(copy, tmp_path):
    db_url, archive, (start_s, end_s) = copy
    partial = tmp_path / "archive"
    shutil.copytree(archive, partial)
    files = sorted(partial.rglob("*.parquet"))
    assert len(files) >= 2
    files[0].unlink()  # one run's window of steps, billed but no longer archived
    span = ("--start", str(start_s), "--end", str(end_s))
    for where in (partial, tmp_path / "empty"):
        where.mkdir(exist_ok=True)
        done = cli("adjust", "--class", ENGINE_CLASS, *span, "--db", db_url, "--archive", str(where))
        assert done.returncode == 2, done.stdout + done.stderr
        assert "does not hold the whole period" in done.stderr and "nothing was written" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    ledger = Ledger(db_url)
    try:
        assert ledger.adjustment_rows() == []
    finally:
        ledger.close()


def test_adjust_in_window_mode_refuses_a_bound_that_cuts_windows(copy):
    db_url, archive, (start_s, end_s) = copy
    for span in ((start_s + 1, end_s), (start_s, end_s - WINDOW_S - 1)):  # an odd second is inside a 2 s window
        done = cli("adjust", "--class", ENGINE_CLASS, "--start", str(span[0]), "--end", str(span[1]), "--db", db_url,
                   "--archive", str(archive))
        assert done.returncode == 2 and "cuts" in done.stderr and "choose bounds on window edges" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    # a sub-period on window edges is adjusted
    inner = (start_s + WINDOW_S, end_s)
    done = invoke_cli("adjust", "--class", ENGINE_CLASS, "--start", str(inner[0]), "--end", str(inner[1]), "--db", db_url,
                      "--archive", str(archive), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total_delta_ns"] == 0
