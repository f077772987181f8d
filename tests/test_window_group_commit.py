"""Schema 7's window storage: concurrent callers' windows committed together (`Ledger.ingest_windows`' group commit),
window usage kept per tenant, class, version and second, request totals only where asked for."""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from _service_fixtures import db_url, model_path  # noqa: F401
from llmvisor.core.model import StepLatencyModel
from llmvisor.ledger import Ledger, WindowConflictError
from llmvisor.ledger.windows import _WindowBatch
from llmvisor.metering import WindowAggregator
from test_metering import build, step_strategy

T0_S = 1_750_000_000.0


@pytest.fixture(scope="module")
def model(model_path):  # noqa: F811
    return StepLatencyModel.from_json(model_path)


def windows_of(model, run_id: str, relayed, window_s: float = 0.5, version: int = 1) -> list:
    """The run's windows of ``relayed``, its request ids prefixed with the run id: each run's content its own (the
    same content under another run id is a re-send, refused)."""
    agg = WindowAggregator(run_id, "class-x", lambda: (model, version), window_s=window_s)
    out = []
    for step_id, timestamp_s, latency_s, slices in relayed:
        out += agg.add(step_id, timestamp_s, latency_s, [[f"{run_id}/{s[0]}", *s[1:]] for s in slices])
    return out + agg.close()


def batch_of(windows) -> _WindowBatch:
    digests = {(w.run_id, w.window_start_us): w.content_sha256() for w in windows}
    return _WindowBatch(list(windows), digests, len(windows))


def state(ledger: Ledger) -> tuple:
    """What a reader sees: totals, per tenant and second, per request (window requests), the runs' held ids."""
    totals = ledger.totals()
    usage = [(r.tenant, r.bucket_start_us, r.attributed_ns, r.num_slices, r.num_new_tokens, r.num_output_tokens)
             for r in ledger.tenant_usage(bucket="minute")]
    requests = sorted((r.run_id, r.request_id, r.attributed_ns, r.num_steps) for r in ledger.request_usage(limit=100_000))
    return totals, usage, requests


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(step_strategy, min_size=1, max_size=20), min_size=1, max_size=3), st.integers(1, 4))
def test_one_commit_of_many_callers_stores_what_one_by_one_stores_with_a_row_per_tenant_and_second(model, tmp_path, runs, n_callers):
    """Generated runs' windows, dealt to callers: stored in one commit, or window by window, a reader sees the same
    totals, tenant usage and request usage; the commit writes one row per tenant, class, version and second."""
    windows = [w for k, steps in enumerate(runs) for w in windows_of(model, f"run-{k}", build(steps)[0])]
    callers = [windows[k::n_callers] for k in range(n_callers)]
    together, apart = Ledger(f"sqlite:///{tmp_path}/together-{id(runs)}.db"), Ledger(f"sqlite:///{tmp_path}/apart-{id(runs)}.db")
    try:
        batches = [batch_of(c) for c in callers if c]
        together._commit_window_batches(batches)
        assert all(b.error is None for b in batches)
        assert sum(b.outcome.inserted for b in batches) == len(windows)
        for w in windows:
            assert apart.ingest_windows([w]).inserted == 1
        assert state(together) == state(apart)
        keys = {(t, w.engine_class, w.model_version, w.window_start_us // 1_000_000) for w in windows for t in w.tenant_totals()}
        with together.read_transaction() as conn:
            assert conn.execute(text("SELECT count(*) FROM tenant_seconds")).scalar() == len(keys)
        # a second commit of the same windows: all duplicates, nothing added
        again = [batch_of(c) for c in callers if c]
        together._commit_window_batches(again)
        assert sum(b.outcome.duplicate for b in again) == len(windows) and state(together) == state(apart)
    finally:
        together.close()
        apart.close()


def test_a_conflicting_caller_is_refused_alone_in_a_shared_commit(model, db_url):  # noqa: F811
    """Three callers in one commit: one re-sends a key another stores, with other content (409 for it alone); one
    covers steps another holds under other keys (refused alone, after the commit goes caller by caller)."""
    relayed = build([(0.3, 0.02, 0, [(1, 0, True, 50, 0), (2, 1, False, 1, 40)])] * 12)[0]
    windows = windows_of(model, "run-a", relayed)
    other = windows_of(model, "run-b", relayed)
    changed = windows_of(model, "run-a", relayed, version=2)[0]  # same key as windows[0], other content
    shifted = [dataclasses.replace(other[0], window_start_us=other[0].window_start_us + 1)]  # run-b's steps, another key
    ledger = Ledger(db_url)
    try:
        a, b, c = batch_of(windows), batch_of([changed]), batch_of(shifted)
        d = batch_of(other)
        ledger._commit_window_batches([a, d, b])
        assert a.outcome.inserted == len(windows) and d.outcome.inserted == len(other)
        assert isinstance(b.error, WindowConflictError) and b.error.conflicts == [("run-a", changed.window_start_us)]
        ledger._commit_window_batches([c, batch_of(windows[:1])])
        assert isinstance(c.error, WindowConflictError) and "another key" in str(c.error)
        assert ledger.totals().num_steps == len(relayed) * 2
    finally:
        ledger.close()


def test_concurrent_callers_are_each_answered_for_their_own_windows(model, db_url):  # noqa: F811
    """Eight threads store their runs' windows at once (group commit under contention), one of them re-sending
    a window with other content: it alone gets the conflict, everything else is stored once."""
    relayed = build([(0.2, 0.02, 0, [(k, k % 3, k == 0, 30, 10 * k) for k in range(5)])] * 30)[0]
    per_run = {f"run-{k}": windows_of(model, f"run-{k}", relayed) for k in range(8)}
    bad = windows_of(model, "run-0", relayed, version=2)[0]
    ledger = Ledger(db_url)
    start = threading.Barrier(9)

    def send(run: str) -> tuple[int, list]:
        start.wait()
        inserted, refused = 0, []
        for i in range(0, len(per_run[run]), 3):
            try:
                inserted += ledger.ingest_windows(per_run[run][i : i + 3]).inserted
            except WindowConflictError as conflict:
                refused += conflict.conflicts
        return inserted, refused

    def send_bad():
        start.wait()
        try:
            ledger.ingest_windows([bad])
        except WindowConflictError as conflict:
            return conflict.conflicts
        return None

    try:
        with ThreadPoolExecutor(9) as pool:
            stored = [pool.submit(send, run) for run in per_run]
            refused = pool.submit(send_bad)
            answers = [f.result() for f in stored]
            conflicts = refused.result()
        first = per_run["run-0"][0]
        key = [("run-0", first.window_start_us)]
        if conflicts is None:  # the bad window went first: run-0's first POST (3 windows) is refused whole
            assert answers[0] == (len(per_run["run-0"]) - 3, key)
        else:
            assert conflicts == key and answers[0] == (len(per_run["run-0"]), [])
        assert answers[1:] == [(len(per_run[f"run-{k}"]), []) for k in range(1, 8)]
        totals = ledger.totals()
        assert totals.num_steps == len(relayed) * 8 - (3 * 0 if conflicts is not None else sum(w.num_steps for w in per_run["run-0"][:3]) - bad.num_steps)
        assert totals.attributed_ns == totals.measured_ns
    finally:
        ledger.close()


def test_without_request_totals_tenant_usage_is_the_same_and_no_request_row_is_written(model, tmp_path):
    relayed = build([(0.3, 0.02, 0, [(1, 0, True, 50, 0), (2, 1, False, 1, 40), (3, 1, False, 1, 90)])] * 20)[0]
    windows = windows_of(model, "run-a", relayed)
    kept, left = Ledger(f"sqlite:///{tmp_path}/kept.db"), Ledger(f"sqlite:///{tmp_path}/left.db", request_totals=False)
    try:
        for ledger in (kept, left):
            assert ledger.ingest_windows(windows).inserted == len(windows)
        assert state(kept)[:2] == state(left)[:2]
        by_request = defaultdict(int)
        for w in windows:
            for q in w.requests:
                by_request[q.request_id] += q.attributed_ns
        assert {r.request_id: r.attributed_ns for r in kept.request_usage()} == dict(by_request)
        assert left.request_usage() == []
    finally:
        kept.close()
        left.close()


def test_a_caller_behind_a_full_commit_is_still_answered(model, db_url):  # noqa: F811
    """With commits capped at 2 callers and 12 threads sending at once, every call comes back with its own outcome
    (a caller that leads a commit takes its own batch first, whatever its place in the queue)."""
    relayed = build([(0.2, 0.02, 0, [(k, k % 3, k == 0, 30, 10 * k) for k in range(3)])] * 12)[0]
    per_run = {f"run-{k}": windows_of(model, f"run-{k}", relayed) for k in range(12)}
    ledger = Ledger(db_url)
    ledger._commit.MAX_BATCHES = 2
    start = threading.Barrier(12)

    def send(run: str) -> list[int]:
        start.wait()
        return [ledger.ingest_windows([w]).inserted for w in per_run[run]]

    try:
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(send, per_run))
        assert answers == [[1] * len(per_run[run]) for run in per_run]
        assert ledger.totals().num_steps == 12 * len(relayed)
    finally:
        ledger.close()
