"""Ledgers of older schemas (1, 2) copied into the current one: every total, key and step detail carried over,
the source untouched."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, insert, inspect, text

from _service_fixtures import T0_S, db_url, make_steps, model_path  # noqa: F401
from llmvisor.cli.serve import ledger_migrate
from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger, LedgerError, StepConflictError
from llmvisor.ledger import keys as keys_module
from llmvisor.ledger.migrate import SCHEMA_1_TABLES, SCHEMA_3_STEP_COLUMNS, migrate, migrate_schema_1
from llmvisor.ledger.schema import TOKEN_SPLIT_COLUMNS
from llmvisor.service.ingest import prepare_batch, validate_trace

ledger_info_1, steps_1, slices_1, api_keys_1 = SCHEMA_1_TABLES


def _drop_token_split(conn, tables=("usage_per_second",)) -> None:
    """Take schema 6's token split columns away, as every ledger before it was stored."""
    for table in tables:
        for column in TOKEN_SPLIT_COLUMNS:
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))


def _without_split(rows):
    """Usage rows with their token split unknown (None), what a copy of a ledger before schema 6 holds."""
    return [dataclasses.replace(row, **dict.fromkeys(TOKEN_SPLIT_COLUMNS)) for row in rows]


def _schema_1_ledger(path, model, groups) -> tuple[str, str, list[tuple]]:
    """A schema-1 ledger holding ``groups`` as the old service stored them; returns its URL, a tenant key
    and the slice rows."""
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    SCHEMA_1_TABLES[0].metadata.create_all(engine)
    records = prepare_batch(model, validate_trace(groups), received_at_us=0).records
    sizes = np.diff(records.step_offsets)
    step_rows = [
        dict(run_id=r, step_id=s, measured_ns=m, predicted_s=p, batch_size=b, timestamp_us=t, ingested_at_us=t + 500_000,
             content_sha256=d)
        for r, s, m, p, b, t, d in zip(records.run_id.tolist(), records.step_id.tolist(), records.measured_ns.tolist(),
                                      records.predicted_s.tolist(), sizes.tolist(), records.timestamp_us.tolist(),
                                      records.content_sha256)
    ]
    step_of_slice = np.repeat(np.arange(records.n_steps), sizes)
    slice_rows = [
        dict(run_id=records.run_id[k], step_id=int(records.step_id[k]), request_id=q, tenant=t, num_new_tokens=p,
             num_context_tokens=c, phase="prefill" if f else "decode", attributed_ns=a, timestamp_us=int(records.timestamp_us[k]))
        for k, q, t, p, c, f, a in zip(step_of_slice.tolist(), records.request_id.tolist(), records.tenant.tolist(),
                                       records.num_new_tokens.tolist(), records.num_context_tokens.tolist(),
                                       records.is_prefill.tolist(), records.attributed_ns.tolist())
    ]
    key_id, key, digest = keys_module.new_key()
    with engine.begin() as conn:
        conn.execute(insert(ledger_info_1).values(name="schema_version", value="1"))
        conn.execute(insert(steps_1), step_rows)
        conn.execute(insert(slices_1), slice_rows)
        conn.execute(insert(api_keys_1).values(key_id=key_id, secret_sha256=digest, tenant="tenant-1", is_admin=False,
                                               created_at_us=1, revoked_at_us=None))
    engine.dispose()
    return url, key, slice_rows


def test_a_schema_1_ledger_is_copied_whole_and_left_as_it_was(tmp_path, model_path, db_url):
    model = StepLatencyModel.from_json(model_path)
    groups = make_steps("run-a", 120, batch_size=9, step_interval_s=0.3, seed=1) + make_steps("run-b", 60, n_tenants=4, seed=2)
    source_path = tmp_path / "schema1.db"
    source_url, key, slice_rows = _schema_1_ledger(source_path, model, groups)
    source_digest = hashlib.sha256(source_path.read_bytes()).hexdigest()

    calls = []
    report = migrate_schema_1(source_url, db_url, rows_per_batch=300, progress=lambda done, total: calls.append((done, total)))
    assert report.num_steps == 180 and report.num_slices == len(slice_rows) and report.num_keys == 1
    assert len(calls) >= 3 and calls[-1] == (180, 180)
    assert hashlib.sha256(source_path.read_bytes()).hexdigest() == source_digest

    ledger = Ledger(db_url)
    try:
        totals = ledger.totals()
        assert (totals.num_steps, totals.num_slices) == (180, len(slice_rows))
        assert totals.measured_ns == totals.attributed_ns == sum(r["attributed_ns"] for r in slice_rows)
        per_request: dict[tuple, list] = {}
        for row in slice_rows:
            per_request.setdefault((row["run_id"], row["request_id"]), []).append(row)
        for usage in ledger.request_usage(limit=10_000):
            rows = per_request.pop((usage.run_id, usage.request_id))
            assert usage.attributed_ns == sum(r["attributed_ns"] for r in rows) and usage.num_steps == len(rows)
            assert (usage.first_timestamp_us, usage.last_timestamp_us) == (min(r["timestamp_us"] for r in rows),
                                                                           max(r["timestamp_us"] for r in rows))
        assert not per_request
        step = ledger.step_detail("run-a", 7)
        want = sorted((r["request_id"], r["tenant"], r["attributed_ns"]) for r in slice_rows if (r["run_id"], r["step_id"]) == ("run-a", 7))
        assert [(x.request_id, x.tenant, x.attributed_ns) for x in step.slices] == want
        assert step.ingested_at_us == step.timestamp_us + 500_000
        assert ledger.authenticate(key).tenant == "tenant-1"

        # Digests carried over: the same steps re-sent are duplicates, a changed one a conflict.
        again = ledger.ingest(prepare_batch(model, validate_trace(groups), received_at_us=0).records)
        assert again.n_duplicate == 180 and again.n_inserted == 0
        changed = [[dict(r) for r in g] for g in groups[3:4]]
        changed[0][0]["num_context_tokens"] += 1
        with pytest.raises(StepConflictError):
            ledger.ingest(prepare_batch(model, validate_trace(changed), received_at_us=0).records)
    finally:
        ledger.close()

    with pytest.raises(LedgerError, match="must be an empty ledger"):
        migrate_schema_1(source_url, db_url)
    with pytest.raises(LedgerError, match="only version 1 is migrated"):
        migrate_schema_1(db_url, f"sqlite:///{tmp_path}/other.db")
    with pytest.raises(LedgerError, match="no such SQLite file"):
        migrate_schema_1(f"sqlite:///{tmp_path}/missing.db", f"sqlite:///{tmp_path}/other.db")
    assert not (tmp_path / "missing.db").exists()
    (tmp_path / "notes.db").write_text("not a database")
    with pytest.raises(LedgerError, match="cannot read .*: file is not a database"):
        migrate_schema_1(f"sqlite:///{tmp_path}/notes.db", f"sqlite:///{tmp_path}/other.db")
    engine = create_engine(source_url)
    with engine.connect() as conn:
        assert sorted(inspect(conn).get_table_names()) == ["api_keys", "ledger_info", "slices", "steps"]
    engine.dispose()


def test_the_migrate_command_reports_what_it_copied(tmp_path, model_path, capsys):
    model = StepLatencyModel.from_json(model_path)
    source_url, _, slice_rows = _schema_1_ledger(tmp_path / "schema1.db", model, make_steps(n_steps=30, start_s=T0_S))
    ledger_migrate(source=source_url, target=f"sqlite:///{tmp_path}/schema2.db")
    out = capsys.readouterr().out
    assert f"copied 30 steps, {len(slice_rows)} slices, 1 keys" in out and "The source was not changed." in out
    with pytest.raises(LlmvisorError, match="ledger schema version 10; versions 1 to 6 are migrated"):
        ledger_migrate(source=f"sqlite:///{tmp_path}/schema2.db", target=f"sqlite:///{tmp_path}/third.db")


def test_the_migrate_command_json_holds_the_copied_totals(tmp_path, model_path, capsys):
    model = StepLatencyModel.from_json(model_path)
    source_url, _, slice_rows = _schema_1_ledger(tmp_path / "schema1.db", model, make_steps(n_steps=12, start_s=T0_S))
    ledger_migrate(source=source_url, target=f"sqlite:///{tmp_path}/schema2.db", json_output=True)
    report = json.loads(capsys.readouterr().out)
    assert report["num_steps"] == 12 and report["num_slices"] == len(slice_rows) and report["num_keys"] == 1
    assert sum(report["attributed_ns_per_tenant"].values()) == report["attributed_ns"]


def _schema_2_ledger(path, model, groups) -> str:
    """A schema-2 ledger holding ``groups``: a current one with what schema 3 added taken away."""
    url = f"sqlite:///{path}"
    ledger = Ledger(url)
    ledger.ingest(prepare_batch(model, validate_trace(groups), received_at_us=0).records)
    ledger.create_key("tenant-1")
    ledger.close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_steps_class_pending"))
        for column in SCHEMA_3_STEP_COLUMNS:
            conn.execute(text(f"ALTER TABLE steps DROP COLUMN {column}"))
        conn.execute(text("DROP TABLE engine_models"))
        conn.execute(text("DROP TABLE active_models"))
        conn.execute(text("DROP TABLE step_ranges"))
        _drop_token_split(conn)
        conn.execute(text("UPDATE ledger_info SET value = '2' WHERE name = 'schema_version'"))
    engine.dispose()
    return url


def test_a_schema_2_ledger_is_copied_table_by_table(tmp_path, model_path, db_url):
    model = StepLatencyModel.from_json(model_path)
    groups = make_steps("run-a", 80, batch_size=9, step_interval_s=0.3, seed=1) + make_steps("run-b", 40, n_tenants=4, seed=2)
    source_path = tmp_path / "schema2.db"
    source_url = _schema_2_ledger(source_path, model, groups)
    with pytest.raises(LedgerError, match="schema version 2, this llmvisor reads 10"):
        Ledger(source_url)
    source_digest = hashlib.sha256(source_path.read_bytes()).hexdigest()
    reference = Ledger(f"sqlite:///{tmp_path}/reference.db")
    reference.ingest(prepare_batch(model, validate_trace(groups), received_at_us=0).records)

    report = migrate(source_url, db_url)
    assert report.num_steps == 120 and report.num_keys == 1
    assert hashlib.sha256(source_path.read_bytes()).hexdigest() == source_digest
    ledger = Ledger(db_url)
    try:
        assert ledger.totals() == reference.totals()
        # the usage as it was, its token split unknown (NULL), never guessed
        assert ledger.request_usage(limit=10_000) == _without_split(reference.request_usage(limit=10_000))
        assert all(row.num_output_tokens is None for row in ledger.tenant_usage())
        step = ledger.step_detail("run-b", 9)
        assert step.slices == reference.step_detail("run-b", 9).slices
        assert (step.engine_class, step.model_version, step.pending) == ("", None, False)
        again = ledger.ingest(prepare_batch(model, validate_trace(groups), received_at_us=0).records)
        assert again.n_duplicate == 120
    finally:
        ledger.close()
        reference.close()
    with pytest.raises(LedgerError, match="must be an empty ledger"):
        migrate(source_url, db_url)


def test_the_documented_migrate_command_runs_as_written(tmp_path, model_path):
    """docs/service.md's `llmvisor ledger migrate` line, run verbatim in a folder holding a schema-2 llmvisor.db."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "service.md").read_text(encoding="utf-8")
    command = next(line for line in doc.splitlines() if line.startswith("llmvisor ledger migrate"))
    model = StepLatencyModel.from_json(model_path)
    groups = make_steps("run-doc", 30, batch_size=5, seed=4)
    _schema_2_ledger(tmp_path / "llmvisor.db", model, groups)
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "llmvisor").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m llmvisor.cli "$@"\n')
    (shims / "llmvisor").chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    reference = Ledger(f"sqlite:///{tmp_path}/reference.db")
    reference.ingest(prepare_batch(model, validate_trace(groups), received_at_us=0).records)
    migrated = Ledger(f"sqlite:///{tmp_path}/llmvisor-v4.db")
    try:
        assert migrated.totals() == reference.totals() and migrated.totals().num_steps == 30
    finally:
        migrated.close()
        reference.close()


def _current_ledger(path, model, groups) -> tuple[str, Ledger]:
    """A current SQLite ledger at ``path`` holding ``groups`` as engine class ``class-x``, ``model`` stored and active;
    left open for the caller to add to and close."""
    url = f"sqlite:///{path}"
    ledger = Ledger(url)
    records = prepare_batch(model, validate_trace(groups), received_at_us=0).records
    records.engine_class = np.full(records.n_steps, "class-x", dtype=object)
    ledger.ingest(records)
    ledger.add_model("class-x", json.dumps(model.to_dict()), "test", activate=True)
    return url, ledger


def _schema_3_ledger(path, model, groups) -> str:
    """A schema-3 ledger holding ``groups`` (of an engine class, one model version stored and active): a current
    one without the step ranges of schema 4."""
    url, ledger = _current_ledger(path, model, groups)
    ledger.create_key("tenant-1")
    ledger.close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE step_ranges"))
        _drop_token_split(conn)
        conn.execute(text("UPDATE ledger_info SET value = '3' WHERE name = 'schema_version'"))
    engine.dispose()
    return url


def test_a_schema_3_ledger_is_copied_with_its_models_and_its_gaps_show(tmp_path, model_path, db_url):
    model = StepLatencyModel.from_json(model_path)
    run_a = make_steps("run-a", 50, batch_size=5, seed=1)
    groups = run_a[:10] + run_a[14:40] + run_a[45:] + make_steps("run-b", 20, n_tenants=4, seed=2)
    source_path = tmp_path / "schema3.db"
    source_url = _schema_3_ledger(source_path, model, groups)
    with pytest.raises(LedgerError, match="schema version 3, this llmvisor reads 10"):
        Ledger(source_url)
    source_digest = hashlib.sha256(source_path.read_bytes()).hexdigest()
    report = migrate(source_url, db_url)
    assert report.num_steps == len(groups) and report.num_keys == 1
    assert hashlib.sha256(source_path.read_bytes()).hexdigest() == source_digest
    ledger = Ledger(db_url)
    try:
        assert ledger.totals().num_steps == len(groups)
        assert ledger.active_versions() == {"class-x": 1}
        assert ledger.step_detail("run-a", 3).engine_class == "class-x"
        gaps = ledger.run_gaps("run-a")
        assert [(g.first_step_id, g.last_step_id) for g in gaps.gaps] == [(10, 13), (40, 44)]
        assert gaps.num_missing == 9 and gaps.num_received == 41 and gaps.engine_class == "class-x"
        assert ledger.run_gaps("run-b").num_missing == 0
        assert [run.run_id for run in ledger.runs_with_gaps()] == ["run-a"]
        ledger.ingest(prepare_batch(model, validate_trace(run_a[10:14]), received_at_us=0).records)
        assert [(g.first_step_id, g.last_step_id) for g in ledger.run_gaps("run-a").gaps] == [(40, 44)]
    finally:
        ledger.close()


def _schema_4_ledger(path, model, groups) -> str:
    """A schema-4 ledger holding ``groups`` of class-x, its model active, one adjustment: a current one without
    schema 5's window tables."""
    from llmvisor.ledger import AdjustmentRow

    url, ledger = _current_ledger(path, model, groups)
    ledger.add_adjustments([AdjustmentRow("class-x", 0, 10**15, 1, "tenant-0", "default", 10, 7, -3, 2, 5)])
    ledger.create_key("tenant-1")
    ledger.close()
    engine = create_engine(url)
    with engine.begin() as conn:
        for table in ("windows", "tenant_seconds", "request_totals"):
            conn.execute(text(f"DROP TABLE {table}"))
        _drop_token_split(conn)
        conn.execute(text("UPDATE ledger_info SET value = '4' WHERE name = 'schema_version'"))
    engine.dispose()
    return url


def test_a_schema_4_ledger_is_copied_whole_and_takes_windows_after(tmp_path, model_path, db_url):
    from llmvisor.metering import WindowAggregator

    model = StepLatencyModel.from_json(model_path)
    run_a = make_steps("run-a", 50, batch_size=5, seed=1)
    groups = run_a[:10] + run_a[14:] + make_steps("run-b", 20, n_tenants=4, seed=2)
    source_path = tmp_path / "schema4.db"
    source_url = _schema_4_ledger(source_path, model, groups)
    with pytest.raises(LedgerError, match="schema version 4, this llmvisor reads 10"):
        Ledger(source_url)
    source_digest = hashlib.sha256(source_path.read_bytes()).hexdigest()
    report = migrate(source_url, db_url)
    assert report.num_steps == len(groups) and report.num_keys == 1
    assert hashlib.sha256(source_path.read_bytes()).hexdigest() == source_digest
    ledger = Ledger(db_url)
    try:
        totals = ledger.totals()
        assert totals.num_steps == len(groups) and totals.measured_ns == totals.attributed_ns == report.measured_ns
        assert {row.tenant: row.attributed_ns for row in ledger.tenant_usage()} == report.attributed_ns_per_tenant
        assert [(g.first_step_id, g.last_step_id) for g in ledger.run_gaps("run-a").gaps] == [(10, 13)]
        assert [(a.tenant, a.delta_ns) for a in ledger.adjustment_rows()] == [("tenant-0", -3)]
        assert ledger.active_versions() == {"class-x": 1}
        # schema 5's tables work on the copy: a window of run-a's missing steps closes its gap
        agg = WindowAggregator("run-a", "class-x", lambda: (model, 1))
        closed = []
        for g in run_a[10:14]:
            closed += agg.add(g[0]["step_id"], g[0]["timestamp_s"], g[0]["step_latency_s"],
                    [[r["request_id"], r["tenant"], r["num_new_tokens"], r["num_context_tokens"], r["phase"] == "prefill", 0, None] for r in g])
        assert ledger.ingest_windows(closed + agg.close()).inserted == 4  # make_steps: one step per second
        assert ledger.run_gaps("run-a").num_missing == 0
        assert ledger.totals().num_steps == len(groups) + 4
    finally:
        ledger.close()


def _schema_5_ledger(path, model, per_step, windowed, version: int = 5, runs=("run-w",)) -> str:
    """A schema-5 ledger: ``per_step`` groups stored step by step, ``windowed`` groups as window aggregates, a price
    stored; a current one with schema 6's window usage (a row per window and tenant), without schema 6's token split
    columns (with them: ``version`` 6)."""
    from decimal import Decimal

    from llmvisor.billing import add_prices
    from llmvisor.billing.prices import Price
    from llmvisor.metering import WindowAggregator

    url, ledger = _current_ledger(path, model, per_step)
    closed = []
    for k, run in enumerate(runs):
        agg = WindowAggregator(run, "class-x", lambda: (model, 1))
        suffix = f"-{run}" if k else ""  # requests of their own: a run of the same content would be a re-send, refused
        for g in windowed:
            closed += agg.add(g[0]["step_id"], g[0]["timestamp_s"], g[0]["step_latency_s"],
                              [[r["request_id"] + suffix, r["tenant"], r["num_new_tokens"], r["num_context_tokens"], r["phase"] == "prefill", 0, None]
                               for r in g])
        closed += agg.close()
    assert ledger.ingest_windows(closed).inserted
    add_prices(ledger, [Price("class-x", 0, int(T0_S) // 3600 * 3600 * 1_000_000, "USD", Decimal("2"))])
    ledger.create_key("tenant-1")
    ledger.close()
    engine = create_engine(url)
    with engine.begin() as conn:
        _as_schema_6(conn, closed)
        if version == 5:
            _drop_token_split(conn, ("usage_per_second", "window_tenant_usage", "request_totals"))
        conn.execute(text(f"UPDATE ledger_info SET value = '{version}' WHERE name = 'schema_version'"))
    engine.dispose()
    return url


def _as_schema_6(conn, closed) -> None:
    """Schema 7's per-second window usage (``tenant_seconds``) back to schemas 5 and 6's row per window and tenant."""
    from llmvisor.ledger.migrate import _window_tenant_usage_6

    _window_tenant_usage_6.create(conn)
    rows = [{"run_id": w.run_id, "window_start_us": w.window_start_us, "tenant": tenant,
             "second_us": w.window_start_us // 1_000_000 * 1_000_000, **t}
            for w in closed for tenant, t in w.tenant_totals().items()]
    conn.execute(_window_tenant_usage_6.insert(), rows)
    conn.execute(text("DROP TABLE tenant_seconds"))


def test_a_schema_5_ledger_is_copied_whole_its_token_split_unknown(tmp_path, model_path, db_url):
    """Schema 5 → 6: every table copied (windows and prices too), the totals equal; the usage rows' token split is
    NULL (unknown), and stays NULL where later steps add to a copied row, while new rows get their split; a token
    price in force over the copied usage is refused in one line instead of charging it 0 tokens."""
    from decimal import Decimal

    from llmvisor.billing import add_prices, charges, list_prices
    from llmvisor.billing.prices import Price, PriceError

    model = StepLatencyModel.from_json(model_path)
    run_a = make_steps("run-a", 30, batch_size=5, seed=1)
    windowed = make_steps("run-w", 20, n_tenants=2, seed=3)
    source_path = tmp_path / "schema5.db"
    source_url = _schema_5_ledger(source_path, model, run_a[:20], windowed)
    with pytest.raises(LedgerError, match="schema version 5, this llmvisor reads 10"):
        Ledger(source_url)
    source_digest = hashlib.sha256(source_path.read_bytes()).hexdigest()
    report = migrate(source_url, db_url)
    assert hashlib.sha256(source_path.read_bytes()).hexdigest() == source_digest
    assert report.num_steps == 40 and report.num_keys == 1
    ledger = Ledger(db_url)
    try:
        totals = ledger.totals()
        assert totals.num_steps == 40 and totals.measured_ns == totals.attributed_ns == report.measured_ns
        assert {r.tenant: r.attributed_ns for r in ledger.tenant_usage()} == report.attributed_ns_per_tenant
        assert all(r.num_uncached_prompt_tokens is None and r.num_output_tokens is None for r in ledger.tenant_usage())
        assert all(r.num_cached_prompt_tokens is None for r in ledger.request_usage(limit=10_000))
        assert [p.engine_hour_price for p in list_prices(ledger)] == [Decimal("2")]
        assert ledger.run_gaps("run-w").num_received == 20
        # later steps: a request-second copied before stays unknown, a new run's rows are split
        records = prepare_batch(model, validate_trace(run_a[20:] + make_steps("run-new", 10, seed=5)), received_at_us=0).records
        records.engine_class = np.full(records.n_steps, "class-x", dtype=object)
        ledger.ingest(records)
        new = ledger.request_usage(run_id="run-new", limit=10_000)
        assert new and all(r.num_uncached_prompt_tokens + r.num_output_tokens == r.num_new_tokens for r in new)
        assert all(r.num_cached_prompt_tokens == 0 for r in new)
        hour = int(T0_S) // 3600 * 3600 * 1_000_000
        assert charges(ledger, hour, hour + 2 * 3_600_000_000)  # engine-hour prices charge the copied usage
        add_prices(ledger, [Price("class-x", 0, hour, "USD", Decimal("2"), output_token_price=Decimal("0.001"))])
        with pytest.raises(PriceError, match=r"has no token split \(it was stored before ledger schema 6\)"):
            charges(ledger, hour, hour + 2 * 3_600_000_000)
    finally:
        ledger.close()


def test_a_schema_6_ledger_sums_its_window_rows_per_second_keeping_the_split(tmp_path, model_path, db_url):
    """Schema 6 → 7: the rows per window and tenant are summed per tenant, class, version and second; every tenant's
    total, the token split and the charges are those of the source, and a window re-sent after the copy is a
    duplicate (its key and digest came along)."""
    from llmvisor.billing import charges
    from llmvisor.metering import WindowAggregator

    model = StepLatencyModel.from_json(model_path)
    run_a = make_steps("run-a", 20, batch_size=5, seed=1)
    windowed = make_steps("run-w", 40, n_tenants=3, seed=4)
    source_path = tmp_path / "schema6.db"
    source_url = _schema_5_ledger(source_path, model, run_a, windowed, version=6, runs=("run-w", "run-v"))
    engine = create_engine(source_url)
    with engine.connect() as conn:
        source_rows = conn.execute(text("SELECT tenant, second_us, attributed_ns, num_output_tokens FROM window_tenant_usage")).all()
    engine.dispose()
    assert len({(t, s) for t, s, _, _ in source_rows}) < len(source_rows)  # two runs' windows share a tenant and second
    report = migrate(source_url, db_url)
    ledger = Ledger(db_url)
    try:
        assert {r.tenant: r.attributed_ns for r in ledger.tenant_usage()} == report.attributed_ns_per_tenant
        by_second: dict = {}
        for t, s, ns, out in source_rows:
            have = by_second.setdefault((t, s), [0, 0])
            have[0] += ns
            have[1] += out
        with ledger.read_transaction() as conn:
            copied = {(t, s): [ns, out] for t, s, ns, out in conn.execute(
                text("SELECT tenant, second_us, attributed_ns, num_output_tokens FROM tenant_seconds")).all()}
        assert copied == by_second  # one row per tenant and second here (one class and version), the split kept
        for (t, s), (ns, _out) in by_second.items():
            assert ledger.tenant_window_seconds(t, s, s + 1_000_000) == {(s, "class-x", 1): ns}
        hour = int(T0_S) // 3600 * 3600 * 1_000_000
        assert charges(ledger, hour, hour + 2 * 3_600_000_000)
        agg = WindowAggregator("run-w", "class-x", lambda: (model, 1))
        again = []
        for g in windowed:
            again += agg.add(g[0]["step_id"], g[0]["timestamp_s"], g[0]["step_latency_s"],
                             [[r["request_id"], r["tenant"], r["num_new_tokens"], r["num_context_tokens"], r["phase"] == "prefill", 0, None]
                              for r in g])
        outcome = ledger.ingest_windows(again + agg.close())
        assert outcome.inserted == 0 and outcome.duplicate == len(again) + 1
    finally:
        ledger.close()
