"""Trace format version 3 (the KV memory columns): every file form round-trips them, old files stay readable, a file
mixing versions is billed for time only, and each way the columns can be wrong is refused naming the row or step.
The valid traces are made by the meter (`KvMeter`) over hypothesis-drawn pools, not written out by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.core.kv_memory import KvMeter, snapshot
from llmvisor.core.relayed import StepColumns, step_rows
from llmvisor.core.trace import TraceWriter, format_version, read_trace, read_traces, trace_from_rows
from llmvisor.core.trace_schema import KV_COLUMNS, KV_STEP_COLUMNS
from llmvisor.errors import TraceError

POOL = 16
HEADER = {"columns": {"run_id": "run-a", "kv_pool_blocks": POOL, "kv_block_bytes": 65536}, "warmup_steps": 0}


@st.composite
def metered_steps(draw):
    """Relayed steps (`llmvisor.core.relayed`) of a run whose pool the meter watched: requests hold random blocks
    (some shared), some are skipped by a step and carry their block-ns to a later one."""
    meter = KvMeter(POOL, 0)
    now = 0
    steps = []
    names = [f"req-{i}" for i in range(6)]
    for step_id in range(draw(st.integers(1, 8))):
        holders = {n: draw(st.lists(st.integers(0, POOL - 1), unique=True, min_size=1, max_size=5))
                   for n in draw(st.lists(st.sampled_from(names), unique=True, min_size=1, max_size=5))}
        held = {b for ids in holders.values() for b in ids}
        pool = snapshot(holders, pool_blocks=POOL, idle_cached_blocks=draw(st.integers(0, POOL - len(held))))
        now += draw(st.integers(1, 50_000_000))
        meter.observe(now, {h: float(e) for h, e in zip(pool.holders, pool.effective_blocks)}, pool.held_blocks,
                      pool.idle_cached_blocks)
        now += draw(st.integers(1, 50_000_000))
        meter.observe(now, {h: float(e) for h, e in zip(pool.holders, pool.effective_blocks)}, pool.held_blocks,
                      pool.idle_cached_blocks)
        ran = draw(st.lists(st.sampled_from(sorted(holders)), unique=True, min_size=1))
        block_ns, kv = meter.drain(ran)
        slices = [(r, "t" + r[-1], 1, 10, False, 0, 10.0, 0, ns) for r, ns in zip(ran, block_ns)]
        steps.append([step_id, 1000.0 + step_id, 0.01, slices,
                      [kv.interval_ns, kv.idle_cached_block_ns, kv.free_block_ns, kv.carried_in_block_ns,
                       kv.carried_out_block_ns]])
    return steps


def rows_of(steps):
    return [row for step in steps for row in step_rows(HEADER, step)]


@settings(max_examples=40, deadline=None)
@given(metered_steps(), st.sampled_from([".jsonl", ".csv", ".parquet"]))
def test_every_file_form_round_trips_a_metered_run(tmp_path_factory, steps, suffix):
    path = tmp_path_factory.mktemp("kv") / f"trace{suffix}"
    with TraceWriter(path) as writer:
        for step in steps:
            writer.write_step(step_rows(HEADER, step))
    trace = read_trace(path)
    assert format_version(list(trace.extra)) == 3
    rows = rows_of(steps)
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["step_id"], rows[i]["request_id"]))
    got = sorted(zip(trace.step_id.tolist(), trace.request_id.tolist(), trace.extra["kv_block_ns"].tolist()))
    assert got == sorted((rows[i]["step_id"], rows[i]["request_id"], rows[i]["kv_block_ns"]) for i in order)
    for name in KV_COLUMNS:
        assert trace.extra[name].dtype.kind == "i", name


@settings(max_examples=40, deadline=None)
@given(metered_steps())
def test_the_archives_columns_are_the_rows_columns(steps):
    columns = StepColumns(HEADER)
    for step in steps:
        columns.add(step)
    rows = rows_of(steps)
    assert list(columns.columns()) == list(rows[0])
    for name, values in columns.columns().items():
        assert values == [row[name] for row in rows], name


def test_a_version_1_file_read_with_a_version_3_file_is_billed_for_time_only(tmp_path):
    meter = KvMeter(POOL, 0)
    meter.observe(0, {"a": 2.0}, 2, 0)
    meter.observe(10, {"a": 2.0}, 2, 0)
    block_ns, kv = meter.drain(["a"])
    new = tmp_path / "new.jsonl"
    with TraceWriter(new) as writer:
        writer.write_step(step_rows(HEADER, [0, 1.0, 0.01, [("a", "t", 1, 3, False, 0, 3.0, 0, block_ns[0])],
                                            [kv.interval_ns, kv.idle_cached_block_ns, kv.free_block_ns, 0, 0]]))
    old = tmp_path / "old.jsonl"
    with TraceWriter(old) as writer:
        writer.write_step(step_rows({"columns": {"run_id": "run-b"}, "warmup_steps": 0},
                                    [0, 1.0, 0.01, [("b", "t", 1, 3, False, 0, 3.0, 0)]]))
    assert "kv_block_ns" in read_trace(new).extra and "kv_block_ns" not in read_trace(old).extra
    both = read_traces([new, old])
    assert both.n_steps == 2 and not set(KV_COLUMNS) & set(both.extra)


def valid_rows():
    """Two steps: a (2 blocks) and b (1 block, skipped by step 1, carried into step 2) in a pool of 4."""
    meter = KvMeter(4, 0)
    meter.observe(0, {"a": 2.0, "b": 1.0}, 3, 1)
    meter.observe(100, {"a": 2.0, "b": 1.0}, 3, 1)
    ns1, kv1 = meter.drain(["a"])
    meter.observe(150, {"a": 2.0, "b": 1.0}, 3, 1)
    ns2, kv2 = meter.drain(["a", "b"])
    header = {"columns": {"run_id": "r", "kv_pool_blocks": 4, "kv_block_bytes": 4096}, "warmup_steps": 0}

    def step(k, ids, ns, kv):
        return step_rows(header, [k, 1.0 + k, 0.01, [(i, "t", 1, 5, False, 0, 5.0, 0, n) for i, n in zip(ids, ns)],
                                  [getattr(kv, f) for f in ("interval_ns", "idle_cached_block_ns", "free_block_ns",
                                                            "carried_in_block_ns", "carried_out_block_ns")]])
    return step(1, ["a"], ns1, kv1) + step(2, ["a", "b"], ns2, kv2)


def test_the_valid_rows_read_and_carry_the_skipped_requests_blocks():
    trace = trace_from_rows(valid_rows())
    assert trace.extra["kv_block_ns"].tolist() == [200, 100, 150]
    assert trace.extra["kv_carried_in_block_ns"].tolist() == [0, 100, 100]


def edit(row_index, **changes):
    rows = valid_rows()
    rows[row_index].update(changes)
    return rows


@pytest.mark.parametrize(("rows", "message"), [
    ([{k: v for k, v in r.items() if k != "kv_free_block_ns"} for r in valid_rows()],
     "header: column kv_block_ns without kv_free_block_ns: the KV memory columns come together (format version 3)"),
    (edit(0, kv_block_ns=-1), "row 1: kv_block_ns: must be >= 0 (got -1)"),
    (edit(0, kv_block_bytes=0), "row 1: kv_block_bytes: must be >= 1 (got 0)"),
    (edit(0, kv_block_ns=1.5), "row 1: kv_block_ns: expected an integer, got 1.5"),
    (edit(2, kv_interval_ns=51), "step 2 of run 'r' (rows 2, 3): rows disagree on kv_interval_ns (50 vs 51)"),
    (edit(2, kv_pool_blocks=5), "run 'r': rows disagree on kv_pool_blocks (4 vs 5)"),
    (edit(0, kv_block_ns=201), "step 1 of run 'r' (rows 1): KV memory does not add up: Σ kv_block_ns 201"),
    ([dict(r, kv_pool_blocks=2) for r in valid_rows()], "step 1 of run 'r' (rows 1): KV memory does not add up"),
    ([dict(r, kv_carried_in_block_ns=999) if r["step_id"] == 2 else r for r in valid_rows()],
     "step 2 of run 'r' (rows 2, 3): kv_carried_in_block_ns (999) is more than the step's slices hold"),
])
def test_a_wrong_kv_column_is_refused_naming_where_and_why(rows, message):
    with pytest.raises(TraceError) as error:
        trace_from_rows(rows)
    assert str(error.value).startswith(f"<memory>: {message}"), str(error.value)


def test_the_step_columns_are_the_meters_fields_in_order():
    assert KV_STEP_COLUMNS == ("kv_interval_ns", "kv_idle_block_ns", "kv_free_block_ns", "kv_carried_in_block_ns",
                               "kv_carried_out_block_ns")
