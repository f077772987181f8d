"""Trace format version 4 (the LoRA adapter columns): every file form and the service's Arrow form read them back,
old files stay readable, files of mixed versions keep only the common columns, the relayed form carries them, and
each way the columns can be wrong is refused naming the file and the row, step or run."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.core.lora_trace import decode_adapters, encode_adapters
from llmvisor.core.relayed import StepColumns, step_rows
from llmvisor.core.trace import (
    TraceWriter,
    build_trace,
    format_version,
    read_trace,
    read_traces,
    trace_columns_from_arrow,
    trace_from_rows,
)
from llmvisor.core.trace_schema import LORA_COLUMNS
from llmvisor.errors import TraceError

RANKS = {"tenant-a/r8": 8, "b16": 16, "c,64 \"q\"": 64, "d8": 8}
"""Adapter names with a slash, a comma and quotes: a set is JSON, so no name needs escaping by hand."""
HEADER = {"columns": {"run_id": "run-a"}, "warmup_steps": 0}


@st.composite
def lora_steps(draw):
    """Relayed steps with the LoRA element: random slices of base-model and adapter requests; a step's loads are some
    of its adapters, its disk loads some of its loads (as vLLM's worker does: an adapter read from disk is loaded)."""
    steps = []
    for step_id in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 6))
        adapters = draw(st.lists(st.sampled_from(["", *RANKS]), min_size=n, max_size=n))
        ran = sorted({a for a in adapters if a})
        loads = draw(st.lists(st.sampled_from(ran), unique=True)) if ran else []
        disk = draw(st.lists(st.sampled_from(loads), unique=True)) if loads else []
        slices = [(f"req-{step_id}-{i}", "t" + str(i % 2), 1, 10, False, 0, 10.0, 0) for i in range(n)]
        named = {"slice": {"lora_name": adapters, "lora_rank": [RANKS.get(a, 0) for a in adapters]},
                 "step": {"step_loras": encode_adapters(ran), "step_lora_loads": encode_adapters(loads),
                          "step_lora_disk_loads": encode_adapters(disk)}}
        steps.append([step_id, 1000.0 + step_id, 0.01, slices, None, named])
    return steps


def rows_of(steps):
    return [row for step in steps for row in step_rows(HEADER, step)]


@settings(max_examples=40, deadline=None)
@given(lora_steps(), st.sampled_from([".jsonl", ".csv", ".parquet"]))
def test_every_file_form_round_trips_the_lora_columns(tmp_path_factory, steps, suffix):
    path = tmp_path_factory.mktemp("lora") / f"trace{suffix}"
    with TraceWriter(path) as writer:
        for step in steps:
            writer.write_step(step_rows(HEADER, step))
    trace = read_trace(path)
    expected = trace_from_rows(rows_of(steps))
    assert format_version(list(trace.extra)) == 4
    for name in LORA_COLUMNS:
        assert trace.extra[name].tolist() == expected.extra[name].tolist(), name
    assert [RANKS.get(n, 0) for n in trace.extra["lora_name"].tolist()] == trace.extra["lora_rank"].tolist()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        assert json.loads(pq.read_schema(path).metadata[b"llmvisor.trace"])["format_version"] == 4
    # the service's Arrow form (and the archive's) reads the same columns
    table = trace.to_arrow()
    columns, rows = trace_columns_from_arrow("body", table)
    again = build_trace(columns, path="body", row_numbers=rows)
    assert again.extra["step_loras"].tolist() == trace.extra["step_loras"].tolist()


@settings(max_examples=30, deadline=None)
@given(lora_steps())
def test_the_relayed_columns_are_the_rows_columns(steps):
    columns = StepColumns(HEADER)
    for step in steps:
        columns.add(step)
    rows = rows_of(steps)
    got = columns.columns()
    for name in LORA_COLUMNS:
        assert got[name] == [row[name] for row in rows]


def test_a_set_is_json_sorted_and_read_in_any_order():
    assert encode_adapters(["b", "a", "b"]) == '["a","b"]'
    assert decode_adapters('["b", "a"]') == frozenset({"a", "b"})
    for bad in ('["a","a"]', '["a",""]', '"a"', "[1]", "a,b", None):
        assert decode_adapters(bad) is None, bad


def base_rows():
    step = {"step_loras": '["x","y"]', "step_lora_loads": '["y"]', "step_lora_disk_loads": "[]"}
    common = {"run_id": "r", "step_latency_s": 0.01, "tenant": "t", "num_new_tokens": 1, "num_context_tokens": 5, "phase": "decode"}
    return [
        {**common, "step_id": 0, "request_id": "a", "lora_name": "x", "lora_rank": 8, **step},
        {**common, "step_id": 0, "request_id": "b", "lora_name": "y", "lora_rank": 16, **step},
        {**common, "step_id": 0, "request_id": "c", "lora_name": "", "lora_rank": 0, **step},
        {**common, "step_id": 1, "request_id": "a", "lora_name": "x", "lora_rank": 8, "step_loras": '["x"]',
         "step_lora_loads": "[]", "step_lora_disk_loads": "[]"},
    ]


def test_the_valid_rows_read():
    trace = trace_from_rows(base_rows())
    assert trace.n_steps == 2 and trace.extra["lora_rank"].tolist() == [8, 16, 0, 8]


def edited(row: int, **fields):
    rows = base_rows()
    rows[row] = {**rows[row], **fields}
    return rows


WRONG = [
    (edited(2, lora_rank=8), "<memory>: row 3: lora_rank: the base model (empty lora_name) has rank 0 (got 8)"),
    (edited(0, lora_rank=0), "<memory>: row 1: lora_rank: an adapter's rank must be >= 1 (got 0)"),
    (edited(0, lora_rank=-8), "<memory>: row 1: lora_rank: an adapter's rank must be >= 1 (got -8)"),
    (edited(3, lora_rank=16), "<memory>: run 'r': adapter 'x' has two ranks (8 and 16)"),
    (edited(3, lora_name="z", lora_rank=4), "<memory>: step 1 of run 'r' (rows 4): adapter 'z' of request 'a' is not in step_loras [\"x\"]"),
    (edited(3, step_loras='["x","w"]'), "<memory>: step 1 of run 'r' (rows 4): step_loras names adapter 'w', which no slice of the step runs"),
    (edited(1, step_lora_loads="[]"), "<memory>: step 0 of run 'r' (rows 1, 2, 3): rows disagree on step_lora_loads"),
    (edited(1, step_loras='["y", "x"]'), None),  # the same set in another order: the same set
    (edited(3, step_lora_loads='["y"]'), "<memory>: step 1 of run 'r' (rows 4): step_lora_loads names adapter 'y', which is not in step_loras"),
    (edited(3, step_lora_disk_loads='["q"]'), "<memory>: step 1 of run 'r' (rows 4): step_lora_disk_loads names adapter 'q', which is not in step_loras"),
    (edited(3, step_loras="x"), "<memory>: row 4: step_loras: expected a JSON array of distinct adapter names (got 'x')"),
    (edited(0, lora_rank="8"), "<memory>: row 1: lora_rank: expected an integer, got '8'"),
    (edited(0, lora_name=None), "<memory>: row 1: lora_name: missing value"),
    ([{k: v for k, v in row.items() if k != "step_lora_disk_loads"} for row in base_rows()],
     "<memory>: header: column lora_name without step_lora_disk_loads: the LoRA columns come together (format version 4)"),
]


@pytest.mark.parametrize(("rows", "message"), WRONG, ids=[str(i) for i in range(len(WRONG))])
def test_a_wrong_lora_column_is_refused_naming_where_and_why(rows, message):
    if message is None:
        trace_from_rows(rows)
        return
    with pytest.raises(TraceError) as error:
        trace_from_rows(rows)
    assert str(error.value).startswith(message), str(error.value)


def test_a_wrong_arrow_type_or_null_is_refused(tmp_path):
    table = trace_from_rows(base_rows()).to_arrow()
    bad = table.set_column(table.column_names.index("lora_rank"), "lora_rank", pa.array(["8", "16", "0", "8"]))
    with pytest.raises(TraceError, match="body: column lora_rank: expected integer values, got Arrow type string"):
        trace_columns_from_arrow("body", bad)
    null = table.set_column(table.column_names.index("lora_name"), "lora_name", pa.array(["x", None, "", "x"]))
    with pytest.raises(TraceError, match="body: row 2: lora_name: missing value"):
        trace_columns_from_arrow("body", null)
    csv = tmp_path / "t.csv"
    csv.write_text("run_id,step_id,step_latency_s,request_id,tenant,num_new_tokens,num_context_tokens,phase,lora_name,"
                   "lora_rank,step_loras,step_lora_loads,step_lora_disk_loads\n"
                   'r,0,0.01,a,t,1,5,decode,x,eight,"[""x""]",[],[]\n')
    with pytest.raises(TraceError, match=r"t.csv: row 1: lora_rank: expected an integer, got 'eight'"):
        read_trace(csv)


def test_old_files_stay_readable_and_mixed_versions_keep_the_common_columns(tmp_path):
    old = [{k: v for k, v in row.items() if k not in LORA_COLUMNS} for row in base_rows()]
    v1, v4 = tmp_path / "v1.jsonl", tmp_path / "v4.parquet"
    v1.write_text("".join(json.dumps({**row, "run_id": "old"}) + "\n" for row in old))
    with TraceWriter(v4) as writer:
        writer.write_step(base_rows()[:3])
        writer.write_step(base_rows()[3:])
    assert format_version(list(read_trace(v1).extra)) == 1
    both = read_traces([v1, v4])
    assert both.n_steps == 4 and not set(LORA_COLUMNS) & set(both.extra)
    assert set(LORA_COLUMNS) <= set(read_traces([v4]).extra)
