"""The ledger on real databases: idempotent, atomic ingest; exact reconciliation; hashed keys."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, inspect, select, text

from _service_fixtures import T0_S, db_url, keys, ledger, make_steps, measured_ns, model_path  # noqa: F401
from llmvisor.core.attribution import attribute
from llmvisor.core.model import StepLatencyModel
from llmvisor.ledger import Ledger, LedgerError, StepConflictError
from llmvisor.ledger.schema import api_keys, ledger_info
from llmvisor.service.ingest import apportion_ns, prepare_batch, validate_trace


@pytest.fixture
def model(model_path):
    return StepLatencyModel.from_json(model_path)


def prepare(model, groups):
    return prepare_batch(model, validate_trace(groups), received_at_us=0).records


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(0, 10, allow_subnormal=False), min_size=1, max_size=40),
        min_size=1,
        max_size=20,
    ),
    st.data(),
)
def test_apportion_ns_is_exact_nonnegative_and_close(steps_shares, data):
    shares = np.concatenate([np.asarray(s) for s in steps_shares])
    offsets = np.concatenate(([0], np.cumsum([len(s) for s in steps_shares])))
    measured = np.asarray(data.draw(st.lists(st.integers(0, 10**15), min_size=len(steps_shares), max_size=len(steps_shares))))
    out = apportion_ns(shares, offsets, measured)
    assert out.dtype == np.int64 and (out >= 0).all()
    assert (np.add.reduceat(out, offsets[:-1]) == measured).all()
    for k, step_shares in enumerate(steps_shares):
        total = sum(step_shares)
        if total > 0:
            exact = np.asarray(step_shares) / total * measured[k]
            # One ns of rounding, plus float error of the running sum relative to the step's size.
            assert np.abs(out[offsets[k] : offsets[k + 1]] - exact).max() <= 1 + measured[k] * 1e-12


def test_apportion_ns_is_the_same_for_even_and_uneven_batch_sizes():
    """Uneven sizes take the per-step loop instead of the padded matrix; both give the same nanoseconds."""
    rng = np.random.default_rng(0)
    sizes = [3000] + [1] * 500 + [7] * 20
    shares = rng.random(sum(sizes))
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    measured = rng.integers(10**6, 10**9, size=len(sizes))
    uneven = apportion_ns(shares, offsets, measured)
    even = [apportion_ns(shares[a:b], np.array([0, b - a]), measured[k : k + 1]) for k, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))]
    np.testing.assert_array_equal(uneven, np.concatenate(even))
    assert (np.add.reduceat(uneven, offsets[:-1]) == measured).all()


def _reference_digest(rows: list[dict]) -> bytes:
    """The documented canonical encoding v1, written out plainly (`content_digests` is the vectorised one)."""
    first = rows[0]
    timestamp_s = first.get("timestamp_s")
    header = (
        f"v1\x1e{len(first['run_id'])}\x1f{first['run_id']}\x1f{first['step_id']}\x1f{float(first['step_latency_s'])!r}"
        f"\x1f{None if timestamp_s is None else float(timestamp_s)!r}\x1e"
    )
    slices = "".join(
        f"{len(r['request_id'])}\x1f{r['request_id']}\x1f{len(r['tenant'])}\x1f{r['tenant']}\x1f"
        f"{r['num_new_tokens']}\x1f{r['num_context_tokens']}\x1f{int(r['phase'] == 'prefill')}\x1f"
        for r in sorted(rows, key=lambda r: r["request_id"])
    )
    return hashlib.sha256((header + slices).encode()).digest()


_names = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=6)


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.dictionaries(_names, st.tuples(_names, st.integers(1, 10**6), st.integers(0, 10**9), st.booleans()), min_size=1, max_size=5),
            st.floats(1e-6, 10.0),
            st.one_of(st.none(), st.floats(0, 2e9)),
        ),
        min_size=1,
        max_size=5,
    ),
    run_id=_names,
)
def test_step_digests_follow_the_documented_encoding(model_path, steps, run_id):
    model = StepLatencyModel.from_json(model_path)
    groups = []
    for step_id, (requests, latency_s, timestamp_s) in enumerate(steps):
        rows = []
        for request_id, (tenant, tokens, context, prefill) in requests.items():
            row = {"run_id": run_id, "step_id": step_id, "step_latency_s": latency_s, "request_id": request_id,
                   "tenant": tenant, "num_new_tokens": tokens if prefill else 1, "num_context_tokens": context,
                   "phase": "prefill" if prefill else "decode"}
            if timestamp_s is not None:
                row["timestamp_s"] = timestamp_s
            rows.append(row)
        groups.append(rows)
    assert prepare(model, groups).content_sha256 == [_reference_digest(rows) for rows in groups]


def test_content_hash_ignores_row_order_and_unstored_columns_but_sees_every_stored_value(model):
    groups = make_steps(n_steps=3, batch_size=6, seed=1)
    base = prepare(model, groups).content_sha256
    shuffled = [list(reversed(g)) for g in groups]
    assert prepare(model, shuffled).content_sha256 == base
    with_extra = [[dict(r, engine="vllm") for r in g] for g in groups]
    assert prepare(model, with_extra).content_sha256 == base
    for field, value in [("tenant", "other"), ("num_context_tokens", 12345), ("request_id", "req-x"), ("timestamp_s", 1.0)]:
        changed = [[dict(r) for r in g] for g in groups]
        for row in changed[1]:
            row[field] = value if field != "request_id" else f"{value}-{row['request_id']}"
        digests = prepare(model, changed).content_sha256
        assert digests[0] == base[0] and digests[2] == base[2]
        assert digests[1] != base[1], field
    slower = [[dict(r, step_latency_s=r["step_latency_s"] * 1.5) for r in g] for g in groups]
    assert prepare(model, slower).content_sha256[1] != base[1]


def test_identical_resend_is_acknowledged_and_not_counted_twice(ledger, model):
    groups = make_steps(n_steps=30)
    first = ledger.ingest(prepare(model, groups))
    assert first.n_inserted == 30 and first.n_duplicate == 0
    again = ledger.ingest(prepare(model, groups))
    assert again.n_inserted == 0 and again.n_duplicate == 30
    overlapping = groups[20:] + make_steps(n_steps=10, first_step=30)
    mixed = ledger.ingest(prepare(model, overlapping))
    assert mixed.inserted == [False] * 10 + [True] * 10
    totals = ledger.totals()
    everything = groups + make_steps(n_steps=10, first_step=30)
    assert totals.num_steps == 40
    assert totals.measured_ns == measured_ns(everything)
    assert totals.attributed_ns == totals.measured_ns
    assert totals.num_slices == sum(len(g) for g in everything)


def test_conflicting_resend_rejects_the_whole_batch_naming_the_step(ledger, model):
    groups = make_steps(n_steps=10)
    ledger.ingest(prepare(model, groups))
    before = ledger.totals()
    changed = [[dict(r) for r in g] for g in groups[5:7]]
    changed[1][0]["num_context_tokens"] += 1
    batch = make_steps(n_steps=5, first_step=100) + changed
    with pytest.raises(StepConflictError) as raised:
        ledger.ingest(prepare(model, batch))
    assert raised.value.conflicts == [("run-a", 6)]
    assert "step 6 of run 'run-a'" in str(raised.value)
    assert ledger.totals() == before, "a rejected batch must store nothing, not even its new steps"


def test_totals_reconcile_with_every_query_and_independent_sums(ledger, model):
    runs = {f"run-{r}": make_steps(f"run-{r}", 120, batch_size=16, n_tenants=5, step_interval_s=97.0, seed=r) for r in range(3)}
    for groups in runs.values():
        for i in range(0, len(groups), 25):
            ledger.ingest(prepare(model, groups[i : i + 25]))
    everything = [g for groups in runs.values() for g in groups]
    totals = ledger.totals()
    assert totals.measured_ns == measured_ns(everything) == totals.attributed_ns
    assert totals.num_steps == len(everything)

    per_tenant = {row.tenant: row.attributed_ns for row in ledger.tenant_usage()}
    assert sum(per_tenant.values()) == totals.measured_ns
    trace = validate_trace(everything)
    expected_s = {}
    for tenant, share in zip(trace.tenant, attribute(model, trace).share_s):
        expected_s[tenant] = expected_s.get(tenant, 0.0) + share
    for tenant, total_ns in per_tenant.items():
        assert abs(total_ns - expected_s[tenant] * 1e9) <= trace.n_slices  # at most 1 ns of rounding per slice

    for bucket in ("minute", "hour", "day"):
        rows = ledger.tenant_usage(bucket=bucket)
        assert sum(r.attributed_ns for r in rows) == totals.measured_ns
        for tenant, total_ns in per_tenant.items():
            assert sum(r.attributed_ns for r in rows if r.tenant == tenant) == total_ns
        size_us = {"minute": 60, "hour": 3600, "day": 86400}[bucket] * 10**6
        assert all(r.bucket_start_us % size_us == 0 for r in rows)
    assert len({r.bucket_start_us for r in ledger.tenant_usage(bucket="hour")}) >= 3

    middle_us = int((T0_S + 60 * 97.0) * 1e6)
    left, right = ledger.totals(end_us=middle_us), ledger.totals(start_us=middle_us)
    assert left.measured_ns + right.measured_ns == totals.measured_ns
    assert left.attributed_ns == left.measured_ns and right.attributed_ns == right.measured_ns
    assert sum(r.attributed_ns for r in ledger.tenant_usage(start_us=middle_us)) == right.measured_ns

    top = ledger.top_tenants(3)
    assert [r.tenant for r in top] == sorted(per_tenant, key=lambda t: (-per_tenant[t], t))[:3]
    requests = ledger.request_usage(limit=10_000)
    assert sum(r.attributed_ns for r in requests) == totals.measured_ns
    assert [r.attributed_ns for r in requests] == sorted((r.attributed_ns for r in requests), reverse=True)
    one = ledger.request_usage(run_id="run-1", request_id="req-0")
    assert len(one) == 1 and one[0].num_steps == sum(1 for g in runs["run-1"] if any(r["request_id"] == "req-0" for r in g))


def test_usage_of_a_request_adds_up_across_batches_within_one_second(ledger, model):
    """Steps 10 ms apart, stored 7 at a time: most (request, second) rows are written by several batches."""
    groups = make_steps(n_steps=300, batch_size=6, step_interval_s=0.01, seed=3)
    for i in range(0, len(groups), 7):
        ledger.ingest(prepare(model, groups[i : i + 7]))
    expected: dict[str, dict] = {}
    for group, records in ((g, prepare(model, [g])) for g in groups):
        timestamp_us = int(round(group[0]["timestamp_s"] * 1e6))
        for request_id, tokens, share_ns in zip(records.request_id, records.num_new_tokens, records.attributed_ns):
            row = expected.setdefault(request_id, {"ns": 0, "steps": 0, "tokens": 0, "first": timestamp_us, "last": timestamp_us})
            row["ns"] += int(share_ns)
            row["steps"] += 1
            row["tokens"] += int(tokens)
            row["first"], row["last"] = min(row["first"], timestamp_us), max(row["last"], timestamp_us)
    stored = {r.request_id: r for r in ledger.request_usage(limit=10_000)}
    assert set(stored) == set(expected)
    for request_id, want in expected.items():
        got = stored[request_id]
        assert (got.attributed_ns, got.num_steps, got.num_new_tokens) == (want["ns"], want["steps"], want["tokens"])
        assert (got.first_timestamp_us, got.last_timestamp_us) == (want["first"], want["last"])
    totals = ledger.totals()
    assert totals.attributed_ns == totals.measured_ns == measured_ns(groups)
    assert totals.num_slices == sum(len(g) for g in groups)
    whole_second_us = int(T0_S + 1) * 10**6
    first_second = ledger.totals(end_us=whole_second_us)
    assert first_second.measured_ns == measured_ns([g for g in groups if g[0]["timestamp_s"] < T0_S + 1])
    assert first_second.attributed_ns == first_second.measured_ns
    with pytest.raises(LedgerError, match="whole second"):
        ledger.tenant_usage(start_us=whole_second_us + 500)


def test_a_stored_step_reads_back_with_every_slice_and_share(ledger, model):
    groups = make_steps(n_steps=40, batch_size=12, seed=5)
    ledger.ingest(prepare(model, groups[:25]))
    ledger.ingest(prepare(model, groups[20:]))  # five duplicates: the blob holds only the new steps
    for group in (groups[0], groups[22], groups[39]):
        records = prepare(model, [group])
        detail = ledger.step_detail("run-a", group[0]["step_id"])
        assert detail.measured_ns == int(records.measured_ns[0])
        assert detail.content_sha256 == records.content_sha256[0]
        assert detail.timestamp_us == int(round(group[0]["timestamp_s"] * 1e6))
        want = sorted(
            zip(records.request_id, records.tenant, records.num_new_tokens.tolist(), records.num_context_tokens.tolist(),
                np.where(records.is_prefill, "prefill", "decode"), records.attributed_ns.tolist())
        )
        got = [(x.request_id, x.tenant, x.num_new_tokens, x.num_context_tokens, x.phase, x.attributed_ns) for x in detail.slices]
        assert got == [tuple(w) for w in want]
        assert sum(x.attributed_ns for x in detail.slices) == detail.measured_ns
    assert ledger.step_detail("run-a", 40) is None
    assert ledger.step_detail("run-b", 0) is None


def test_concurrent_ingest_of_overlapping_batches_stores_each_step_once(ledger, model):
    groups = make_steps(n_steps=200, batch_size=8)
    batches = [prepare(model, groups[i : i + 60]) for i in range(0, 200, 20)]
    outcomes, errors = [], []

    def worker(order):
        try:
            for index in order:
                outcomes.append(ledger.ingest(batches[index]))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    rng = np.random.default_rng(0)
    threads = [threading.Thread(target=worker, args=(rng.permutation(len(batches)),)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert sum(o.n_inserted for o in outcomes) == 200
    totals = ledger.totals()
    assert totals.num_steps == 200 and totals.measured_ns == measured_ns(groups) == totals.attributed_ns


def test_keys_are_stored_hashed_and_checked(ledger, keys):
    admin = ledger.authenticate(keys["admin"])
    tenant = ledger.authenticate(keys["tenant-0"])
    assert admin.is_admin and admin.tenant is None
    assert not tenant.is_admin and tenant.tenant == "tenant-0"
    prefix, key_id, secret = keys["tenant-0"].split("_", 2)
    assert ledger.authenticate(f"{prefix}_{key_id}_{secret[:-1]}x") is None
    assert ledger.authenticate(f"{prefix}_{'0' * 16}_{secret}") is None
    for malformed in ("", "lvk", "lvk__", "Bearer x", keys["tenant-0"] + "_"):
        assert ledger.authenticate(malformed) is None
    with ledger._read_engine.connect() as conn:
        stored = conn.execute(select(api_keys)).all()
    assert all(secret.encode() not in bytes(row.secret_sha256) and len(row.secret_sha256) == 32 for row in stored)
    assert ledger.revoke_key(key_id) and not ledger.revoke_key(key_id)
    assert ledger.authenticate(keys["tenant-0"]) is None
    assert [k.key_id for k in ledger.list_keys() if k.revoked_at_us is not None] == [key_id]
    with pytest.raises(LedgerError):
        ledger.create_key("tenant-0", is_admin=True)
    with pytest.raises(LedgerError):
        ledger.create_key(None)


def test_sqlite_runs_in_wal_mode(tmp_path):
    store = Ledger(f"sqlite:///{tmp_path}/wal.db")
    with store._write_engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() > 0
    store.close()


def test_other_schema_versions_and_bad_urls_are_clear_errors(tmp_path):
    url = f"sqlite:///{tmp_path}/old.db"
    store = Ledger(url)
    with store._write_engine.begin() as conn:
        conn.execute(ledger_info.update().values(value="99"))
    store.close()
    with pytest.raises(LedgerError, match="schema version 99"):
        Ledger(url)

    # A schema-1 ledger (a row per slice) is refused before anything is written to it.
    old_url = f"sqlite:///{tmp_path}/schema1.db"
    engine = create_engine(old_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE ledger_info (name VARCHAR(64) PRIMARY KEY, value TEXT NOT NULL)"))
        conn.execute(text("INSERT INTO ledger_info VALUES ('schema_version', '1')"))
        conn.execute(text("CREATE TABLE slices (run_id TEXT, attributed_ns BIGINT)"))
        conn.execute(text("INSERT INTO slices VALUES ('r', 5)"))
    with pytest.raises(LedgerError, match="schema version 1, this llmvisor reads 10; the database was left as it is"):
        Ledger(old_url)
    with engine.connect() as conn:
        assert sorted(inspect(conn).get_table_names()) == ["ledger_info", "slices"]
        assert conn.execute(text("SELECT * FROM slices")).all() == [("r", 5)]
    engine.dispose()
    with pytest.raises(LedgerError, match="unsupported database"):
        Ledger("mysql://localhost/x")
    with pytest.raises(LedgerError, match="not a database URL"):
        Ledger("no url")
    with pytest.raises(LedgerError, match="cannot open database"):
        Ledger(f"sqlite:///{tmp_path}/missing-dir/x.db")
    (tmp_path / "notes.db").write_text("not a database")
    with pytest.raises(LedgerError, match="cannot open database .*: file is not a database"):
        Ledger(f"sqlite:///{tmp_path}/notes.db")
    assert (tmp_path / "notes.db").read_text() == "not a database"
