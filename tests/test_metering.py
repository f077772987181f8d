"""Window aggregates at the edge: exact to the nanosecond, equal to per-step ingest, read back with named errors."""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _service_fixtures import model_path  # noqa: F401
from llmvisor.core.model import StepLatencyModel
from llmvisor.ledger import Ledger
from llmvisor.metering import WindowAggregate, WindowAggregator, WindowError
from llmvisor.service.ingest import prepare_batch, validate_trace

T0_S = 1_750_000_000.0


@pytest.fixture(scope="module")
def model(model_path):
    return StepLatencyModel.from_json(model_path)


slice_strategy = st.tuples(
    st.integers(0, 12),  # request
    st.integers(0, 3),  # tenant
    st.booleans(),  # prefill
    st.integers(1, 400),  # new tokens of a prefill
    st.integers(0, 3000),  # context
)
step_strategy = st.tuples(
    st.floats(0.0, 0.7, allow_nan=False),  # gap to the previous step's start, s
    st.floats(1e-5, 0.3, allow_nan=False),  # latency, s
    st.integers(0, 2),  # step ids skipped before this one (gaps)
    st.lists(slice_strategy, min_size=1, max_size=12, unique_by=lambda s: s[0]),
)


def build(steps):
    """Relayed steps ``[step_id, timestamp_s, latency_s, slices]`` and the same steps as POST /v1/steps groups."""
    relayed, groups = [], []
    t, step_id = T0_S, -1
    for gap_s, latency_s, skipped, slices in steps:
        t += gap_s
        step_id += 1 + skipped
        rows, out = [], []
        for request, tenant, prefill, new, context in slices:
            new = new if prefill else 1
            out.append([f"req-{request}", f"tenant-{tenant}", new, context, prefill, 0, None])
            rows.append({"run_id": "run-a", "step_id": step_id, "step_latency_s": latency_s, "request_id": f"req-{request}",
                         "tenant": f"tenant-{tenant}", "num_new_tokens": new, "num_context_tokens": context,
                         "phase": "prefill" if prefill else "decode", "timestamp_s": t})
        relayed.append([step_id, t, latency_s, out])
        groups.append(rows)
    return relayed, groups


def aggregate(model, relayed, window_s=1.0, version=3):
    agg = WindowAggregator("run-a", "class-x", lambda: None if model is None else (model, version), window_s=window_s)
    windows = []
    for step in relayed:
        windows += agg.add(*step)
    return windows + agg.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(step_strategy, min_size=1, max_size=60), st.sampled_from([0.25, 1.0, 2.0]))
def test_windows_reconcile_and_equal_per_step_attribution(model, steps, window_s):
    relayed, groups = build(steps)
    windows = aggregate(model, relayed, window_s)
    records = prepare_batch(model, validate_trace(groups), received_at_us=0).records
    # every window: Σ attributed = Σ measured to the nanosecond, and it survives its JSON form
    for w in windows:
        assert w.attributed_ns == w.measured_ns == sum(q.attributed_ns for q in w.requests)
        assert WindowAggregate.from_json(json.loads(json.dumps(w.to_json()))) == w
    # the step ids covered, gaps included, are the steps sent
    covered = np.concatenate([w.step_ids() for w in windows])
    assert covered.tolist() == [s[0] for s in relayed]
    assert sum(w.num_steps for w in windows) == len(relayed)
    # tenant and request totals equal what per-step ingest stores, exactly
    per_step_tenant, per_step_request = defaultdict(int), defaultdict(int)
    for tenant, request, ns in zip(records.tenant.tolist(), records.request_id.tolist(), records.attributed_ns.tolist()):
        per_step_tenant[tenant] += ns
        per_step_request[request] += ns
    window_tenant, window_request = defaultdict(int), defaultdict(int)
    for w in windows:
        for tenant, totals in w.tenant_totals().items():
            window_tenant[tenant] += totals["attributed_ns"]
        for q in w.requests:
            window_request[q.request_id] += q.attributed_ns
    assert dict(window_tenant) == dict(per_step_tenant)
    assert dict(window_request) == dict(per_step_request)
    assert sum(w.measured_ns for w in windows) == int(records.measured_ns.sum())
    # with 1 s windows, a tenant's window equals its per-second usage
    if window_s == 1.0:
        per_second = defaultdict(int)
        for tenant, ts, ns in zip(records.tenant.tolist(), np.repeat(records.timestamp_us, np.diff(records.step_offsets)).tolist(),
                                  records.attributed_ns.tolist()):
            per_second[tenant, ts // 1_000_000 * 1_000_000] += ns
        by_window = defaultdict(int)
        for w in windows:
            for tenant, totals in w.tenant_totals().items():
                by_window[tenant, w.window_start_us] += totals["attributed_ns"]
        assert {k: v for k, v in by_window.items() if v} == {k: v for k, v in per_second.items() if v}


@settings(max_examples=60, deadline=None)
@given(st.lists(step_strategy, min_size=1, max_size=40), st.sampled_from([0.25, 1.0]), st.booleans())
def test_a_windows_json_and_digest_are_what_asdict_gave(model, steps, window_s, pending):
    """`WindowAggregate.to_json` is built by hand for speed; its canonical bytes (the idempotency digest the
    ledger stores) must stay those of `dataclasses.asdict`, or a window spooled before an upgrade and replayed
    after it would be refused as different content."""
    import dataclasses

    relayed, _ = build(steps)
    windows = aggregate(None if pending else model, relayed, window_s)
    read_back = [WindowAggregate.from_json(json.loads(json.dumps(w.to_json()))) for w in windows]
    for w in [*windows, *read_back]:
        # these steps carry no KV figures and no adapters: format 1, whose fields are the dataclass's before format 2
        # added `kv` and the requests' `kv_block_ns` and format 3 their `lora_name`; asdict less those is what a window
        # of an older edge was
        assert w.format == 1 and w.kv is None
        before = dataclasses.asdict(w)
        del before["kv"]
        for request in before["requests"]:
            del request["kv_block_ns"], request["lora_name"]
        assert json.dumps(w.to_json()) == json.dumps(before)  # same keys, order and values
        assert w.canonical_bytes() == json.dumps(before, sort_keys=True, separators=(",", ":")).encode()
        assert list(w.to_json()) == [f.name for f in dataclasses.fields(w) if f.name != "kv"]


def test_pending_windows_keep_measured_time_and_attribute_nothing(model):
    relayed, _ = build([(0.1, 0.05, 0, [(0, 0, True, 100, 0), (1, 1, False, 1, 50)])] * 30)
    windows = aggregate(None, relayed)
    assert windows and all(w.pending and w.model_version is None and w.attributed_ns == 0 for w in windows)
    assert sum(w.measured_ns for w in windows) == 30 * 50_000_000
    assert WindowAggregate.from_json(windows[0].to_json()) == windows[0]


def test_resent_steps_are_skipped_and_windows_close_when_due(model):
    relayed, _ = build([(0.3, 0.01, 0, [(0, 0, False, 1, 10)])] * 5)
    agg = WindowAggregator("run-a", "class-x", lambda: (model, 1))
    out = []
    for step in relayed + relayed[:3]:
        out += agg.add(*step)
    assert agg.close_due(relayed[-1][1]) == []
    out += agg.close_due(relayed[-1][1] + 2.0)
    assert agg.open_steps == 0
    assert sum(w.num_steps for w in out) == 5


def test_a_step_of_a_window_closed_already_goes_to_the_next_window_never_a_second_one_of_the_same_start(model):
    """close_due closed the window while a step dated in it was still running (a long prefill): that step is counted
    in the next window, so no (run, window start) is sent twice with different content."""
    relayed, _ = build([(0.1, 0.01, 0, [(0, 0, False, 1, 10)])] * 3)
    agg = WindowAggregator("run-a", "class-x", lambda: (model, 1))
    out = []
    for step in relayed[:2]:
        out += agg.add(*step)
    out += agg.close_due(relayed[0][1] + 5.0)
    out += agg.add(*relayed[2])  # dated in the window just closed
    out += agg.close()
    starts = [w.window_start_us for w in out]
    assert len(starts) == 2 and len(set(starts)) == 2 and starts[1] == starts[0] + agg.window_us
    assert [w.num_steps for w in out] == [2, 1]
    assert out[1].requests[0].first_timestamp_us == starts[1]  # dated at the start of the window it is counted in


def test_a_resumed_aggregator_starts_at_the_first_unsent_step_and_no_earlier_window(model):
    relayed, _ = build([(0.3, 0.01, 0, [(0, 0, False, 1, 10)])] * 12)
    whole = aggregate(model, relayed)
    second = whole[1]
    agg = WindowAggregator("run-a", "class-x", lambda: (model, 3), first_step_id=second.step_ranges[0][0], floor_us=second.window_start_us)
    resumed = []
    for step in relayed:  # the relay sends again every step it kept, some in windows already sent
        resumed += agg.add(*step)
    resumed += agg.close()
    assert [w.to_json() for w in resumed] == [w.to_json() for w in whole[1:]]  # identical re-sends: duplicates, not 409s


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.pop("run_id"), "window.run_id: missing"),
        (lambda d: d.update(attributed_ns=d["attributed_ns"] + 1), "window.attributed_ns"),
        (lambda d: d["requests"][0].update(attributed_ns=-1), "window.requests[0].attributed_ns"),
        (lambda d: d.update(step_ranges=[[5, 3]]), "window.step_ranges[0]"),
        (lambda d: d.update(num_steps=999), "window.step_ranges"),
        (lambda d: d.update(window_end_us=d["window_start_us"]), "window.window_end_us"),
        (lambda d: d.update(model_version=None), "window.model_version"),
        (lambda d: d["residual"].update(sum_s="x"), "window.residual.sum_s"),
        (lambda d: d["requests"][0].update(tenant=7), "window.requests[0].tenant"),
    ],
)
def test_bad_windows_name_the_field(model, change, field):
    relayed, _ = build([(0.1, 0.05, 0, [(0, 0, True, 100, 0), (1, 1, False, 1, 50)])] * 4)
    data = aggregate(model, relayed)[0].to_json()
    change(data)
    with pytest.raises(WindowError, match=field.replace("[", r"\[").replace("]", r"\]")):
        WindowAggregate.from_json(data)


def with_cached_prompt_tokens(relayed, groups, fractions):
    """The same steps with the ``num_cached_prompt_tokens`` fact: on each request's first slice a drawn fraction of
    its context (prefix-cache hits; 0 ≤ cached ≤ context), 0 on its other slices; in both forms of the steps."""
    seen, k = set(), 0
    for step, rows in zip(relayed, groups):
        for i, (slice_, row) in enumerate(zip(step[3], rows)):
            cached = 0
            if slice_[0] not in seen:
                seen.add(slice_[0])
                cached = int(slice_[3] * fractions[k % len(fractions)])
                k += 1
            step[3][i] = [*slice_, cached]
            row["num_cached_prompt_tokens"] = cached
    return relayed, groups


@settings(max_examples=30, deadline=None)
@given(st.lists(step_strategy, min_size=1, max_size=40), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
       st.sampled_from([0.25, 1.0]))
def test_token_split_through_windows_and_per_step_ledgers_equals_an_independent_count(model, steps, fractions, window_s):
    """Stranger traces with prefix-cache facts: the ledger's (uncached prompt, cached prompt, output) split per tenant is
    the same whether steps are stored one by one or as window aggregates, and equals counting the slices directly."""
    relayed, groups = with_cached_prompt_tokens(*build(steps), fractions)
    expected = defaultdict(lambda: [0, 0, 0])
    for step in relayed:
        for _request, tenant, new, _context, prefill, _shared, _effective, cached in step[3]:
            expected[tenant][0 if prefill else 2] += new
            expected[tenant][1] += cached
    windows = aggregate(model, relayed, window_s)
    from_windows = defaultdict(lambda: [0, 0, 0])
    for w in windows:
        for q in w.requests:
            for k, value in enumerate((q.num_uncached_prompt_tokens, q.num_cached_prompt_tokens, q.num_output_tokens)):
                from_windows[q.tenant][k] += value
    assert dict(from_windows) == dict(expected)
    with tempfile.TemporaryDirectory() as folder:
        per_step, windowed = Ledger(f"sqlite:///{folder}/steps.db"), Ledger(f"sqlite:///{folder}/windows.db")
        try:
            per_step.ingest(prepare_batch(model, validate_trace(groups), received_at_us=0).records)
            windowed.ingest_windows(windows)
            for ledger in (per_step, windowed):
                split = {r.tenant: [r.num_uncached_prompt_tokens, r.num_cached_prompt_tokens, r.num_output_tokens]
                         for r in ledger.tenant_usage()}
                assert split == dict(expected)
        finally:
            per_step.close()
            windowed.close()
