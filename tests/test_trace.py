"""The step-trace contract: round trips of every file type and every rejection it lists."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.core.trace import (
    TraceWriter,
    iter_trace,
    parse_is_warmup,
    read_trace,
    read_traces,
    sharing_columns_from_blocks,
    trace_from_rows,
    write_trace,
)
from llmvisor.errors import LlmvisorError, TraceError

SUFFIXES = (".jsonl", ".csv", ".parquet")


def row(step_id=0, request_id="a", latency=0.02, new=1, context=10, phase="decode", run_id="run", tenant="t", **extra):
    return {
        "run_id": run_id,
        "step_id": step_id,
        "step_latency_s": latency,
        "request_id": request_id,
        "tenant": tenant,
        "num_new_tokens": new,
        "num_context_tokens": context,
        "phase": phase,
        **extra,
    }


def write_rows(path, rows, suffix):
    """Write rows as a file of the given type without going through llmvisor's writer."""
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".csv":
        names = list(rows[0])
        lines = [",".join(names)] + [",".join("" if r.get(n) is None else str(r.get(n)) for n in names) for r in rows]
        path.write_text("\n".join(lines) + "\n")
    else:
        columns = {}
        for name in rows[0]:
            values = [r.get(name) for r in rows]
            try:
                columns[name] = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                columns[name] = pa.array([None if v is None else str(v) for v in values])
        pq.write_table(pa.table(columns), path)
    return path


@st.composite
def traces(draw):
    n_steps = draw(st.integers(1, 6))
    rows = []
    contexts: dict[str, int] = {}
    for step in range(n_steps):
        latency = draw(st.floats(1e-4, 5.0, allow_nan=False))
        requests = draw(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=5, unique=True))
        for request in requests:
            phase = draw(st.sampled_from(["prefill", "decode"]))
            new = draw(st.integers(1, 4096)) if phase == "prefill" else 1
            context = contexts.get(request, draw(st.integers(0, 100)))
            contexts[request] = context + new
            rows.append(
                row(step, request, latency, new, context, phase, run_id=draw(st.sampled_from(["r1", "r 2,\"x\""])) if step == 0 and not rows else rows[0]["run_id"] if rows else "r1", tenant=draw(st.sampled_from(["t1", "tenant,2", "ü"])))
            )
    return rows


@pytest.mark.parametrize("suffix", SUFFIXES)
@settings(max_examples=25, deadline=None)
@given(rows=traces())
def test_every_file_type_round_trips(tmp_path_factory, suffix, rows):
    original = trace_from_rows(rows)
    path = tmp_path_factory.mktemp("rt") / f"trace{suffix}"
    write_trace(original, path)
    again = read_trace(path)
    assert again.n_steps == original.n_steps
    for name in ("run_id", "step_id", "request_id", "tenant", "num_new_tokens", "num_context_tokens", "is_prefill"):
        assert list(getattr(again, name)) == list(getattr(original, name)), name
    np.testing.assert_array_equal(again.step_latency_s, original.step_latency_s)
    np.testing.assert_array_equal(again.step_offsets, original.step_offsets)


def test_steps_are_grouped_and_ordered_whatever_the_row_order(tmp_path):
    rows = [row(2, "a", 0.3), row(1, "a", 0.2), row(2, "b", 0.3), row(1, "b", 0.2, phase="prefill", new=7)]
    trace = read_trace(write_rows(tmp_path / "t.jsonl", rows, ".jsonl"))
    assert trace.n_steps == 2
    assert list(trace.step_id_per_step) == [1, 2]
    assert list(trace.step_latency_s_per_step) == [0.2, 0.3]
    assert list(trace.is_prefill_per_step) == [True, False]
    assert list(trace.batch_size_per_step) == [2, 2]


def test_optional_columns_are_kept_and_written_back(tmp_path):
    rows = [row(0, "a", timestamp_s=1.5, engine="vllm", hardware="h1"), row(0, "b", timestamp_s=1.5, engine="vllm", hardware="h2")]
    for suffix in SUFFIXES:
        trace = read_trace(write_rows(tmp_path / f"t{suffix}", rows, suffix))
        assert "hardware" in trace.extra and "engine" in trace.extra
        write_trace(trace, tmp_path / f"again{suffix}")
        assert sorted(map(str, read_trace(tmp_path / f"again{suffix}").extra["hardware"])) == ["h1", "h2"]


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize(
    "name, suggestion",
    [("engine_fingerprint_id", "engine_fingerprint"), ("num_shared_context_tokenz", "num_shared_context_tokens"),
     ("tenat", "tenant"), ("my_column", None)],
)
def test_an_unknown_column_is_refused_naming_it_and_the_closest_known_one(tmp_path, suffix, name, suggestion):
    """A misspelled optional column read as absent would bill wrongly (class "", sharing not priced): refused in
    every format, in the file's own terms (the header of a CSV or Parquet file, the first row having it in JSONL)."""
    good = row(0, "a", engine_fingerprint="0123456789abcdef")
    rows = [good, {**row(0, "b"), name: 3}] if suffix == ".jsonl" else [{**good, name: 3}, {**row(0, "b"), name: 3}]
    if name == "tenat":
        rows = [{("tenat" if k == "tenant" else k): v for k, v in r.items()} for r in rows]
    path = write_rows(tmp_path / f"t{suffix}", rows, suffix)
    where = ("row 1" if name == "tenat" else "row 2") if suffix == ".jsonl" else "header"
    kind = "field" if suffix == ".jsonl" else "column"
    message = f"{path}: {where}: unknown {kind} {name}" + (f"; did you mean {suggestion}?" if suggestion else "")
    with pytest.raises(TraceError) as refused:
        read_trace(path)
    assert str(refused.value) == message
    if name != "tenat":
        assert read_trace(write_rows(tmp_path / f"fixed{suffix}", [good, row(0, "b")], suffix)).n_steps == 1


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("fingerprint", ["fp0", "0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0", " 0123456789abcdef"])
def test_a_malformed_fingerprint_is_refused_not_blanked(tmp_path, suffix, fingerprint):
    rows = [row(0, "a", engine_fingerprint="0123456789abcdef"), row(0, "b", engine_fingerprint=fingerprint)]
    path = write_rows(tmp_path / f"t{suffix}", rows, suffix)
    with pytest.raises(TraceError, match="row [23]: engine_fingerprint: expected an engine fingerprint id"):
        read_trace(path)
    blank = [row(0, "a", engine_fingerprint="0123456789abcdef"), row(0, "b", engine_fingerprint=None)]
    ids = read_trace(write_rows(tmp_path / f"blank{suffix}", blank, suffix)).extra["engine_fingerprint"]
    assert "0123456789abcdef" in list(ids)


def test_parquet_keeps_trace_metadata(tmp_path):
    trace = trace_from_rows([row()], metadata={"noise_floor": {"p50": 0.03}})
    write_trace(trace, tmp_path / "t.parquet")
    assert read_trace(tmp_path / "t.parquet").metadata == {"noise_floor": {"p50": 0.03}}


BAD = [
    ("missing column", lambda r: {k: v for k, v in r.items() if k != "tenant"}, "missing column(s) tenant"),
    ("non-positive latency", lambda r: {**r, "step_latency_s": 0.0}, "latency must be > 0"),
    ("negative latency", lambda r: {**r, "step_latency_s": -1.0}, "latency must be > 0"),
    ("negative context", lambda r: {**r, "num_context_tokens": -3}, "num_context_tokens: token count must be >= 0"),
    ("negative new tokens", lambda r: {**r, "num_new_tokens": -3, "phase": "prefill"}, "num_new_tokens: token count must be >= 0"),
    ("zero new tokens", lambda r: {**r, "num_new_tokens": 0, "phase": "prefill"}, "at least one new token"),
    ("decode with two tokens", lambda r: {**r, "num_new_tokens": 2}, "decode slice runs exactly 1"),
    ("bad phase", lambda r: {**r, "phase": "sampling"}, 'must be "prefill" or "decode"'),
    ("wrong type", lambda r: {**r, "step_id": "seven"}, "step_id"),
    ("missing value", lambda r: {**r, "request_id": None}, "request_id: missing value"),
]


def test_values_python_cannot_store_are_trace_errors():
    with pytest.raises(TraceError, match="row 1: step_id: integer out of range \\(64-bit\\)"):
        trace_from_rows([row(step_id=2**70)])
    with pytest.raises(TraceError, match="row 2: tenant: not valid Unicode text"):
        trace_from_rows([row(0, "a"), row(0, "b", tenant="\ud800")])


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("name,mutate,reason", BAD, ids=[b[0] for b in BAD])
def test_reader_rejects_with_file_row_and_reason(tmp_path, suffix, name, mutate, reason):
    rows = [row(0, "a"), row(0, "b"), mutate(row(1, "c")), row(2, "d")]
    if name == "missing column":
        rows = [mutate(r) for r in rows]
    path = write_rows(tmp_path / f"bad{suffix}", rows, suffix)
    with pytest.raises(TraceError) as error:
        read_trace(path)
    message = str(error.value)
    assert str(path) in message
    assert reason in message
    if name != "missing column" and not (suffix == ".parquet" and name in ("wrong type",)):
        assert "row 3" in message


def test_non_finite_latency_is_rejected(tmp_path):
    for suffix in (".csv", ".parquet"):
        rows = [row(0, "a", latency=float("nan")), row(1, "b", latency=float("inf"))]
        with pytest.raises(TraceError, match="row 1.*finite"):
            read_trace(write_rows(tmp_path / f"nan{suffix}", rows, suffix))
    (tmp_path / "inf.jsonl").write_text(json.dumps(row(0, latency=1.0)) + "\n" + json.dumps(row(1)).replace("0.02", "Infinity") + "\n")
    with pytest.raises(TraceError, match="row 2.*finite"):
        read_trace(tmp_path / "inf.jsonl")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_rows_of_one_step_must_agree_on_latency(tmp_path, suffix):
    rows = [row(0, "a", 0.02), row(1, "a", 0.05), row(1, "b", 0.06)]
    with pytest.raises(TraceError, match=r"step 1 of run 'run' \(rows 2, 3\): rows disagree on step_latency_s \(0.05 vs 0.06\)"):
        read_trace(write_rows(tmp_path / f"t{suffix}", rows, suffix))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_request_may_appear_once_per_step(tmp_path, suffix):
    rows = [row(0, "a"), row(0, "b"), row(0, "a", context=11)]
    with pytest.raises(TraceError, match=r"rows 1 and 3\).*request 'a' appears twice in one step"):
        read_trace(write_rows(tmp_path / f"t{suffix}", rows, suffix))


def test_same_request_in_other_runs_or_steps_is_fine():
    trace = trace_from_rows([row(0, "a"), row(1, "a", context=11), row(0, "a", run_id="other")])
    assert trace.n_steps == 3


def test_speculative_decoding_only_where_declared(tmp_path):
    path = write_rows(tmp_path / "spec.jsonl", [row(0, "a", new=3)], ".jsonl")
    with pytest.raises(TraceError):
        read_trace(path)
    assert read_trace(path, speculative_decoding=True).num_new_tokens[0] == 3


def test_unknown_extension_and_garbage_are_clear_errors(tmp_path):
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(TraceError, match="unknown extension"):
        read_trace(tmp_path / "t.txt")
    (tmp_path / "t.parquet").write_text("not parquet")
    with pytest.raises(TraceError, match="not a readable Parquet file"):
        read_trace(tmp_path / "t.parquet")
    (tmp_path / "t.jsonl").write_text('{"run_id": \n')
    with pytest.raises(TraceError, match="row 1: not valid JSON"):
        read_trace(tmp_path / "t.jsonl")


def test_damaged_parquet_files_are_clear_errors_in_both_readers(tmp_path):
    path = tmp_path / "t.parquet"
    write_trace(trace_from_rows([row(0, "a"), row(0, "b"), row(1, "a")]), path)
    data = path.read_bytes()
    (tmp_path / "bad-name.parquet").write_bytes(data.replace(b"request_id", b"\x80equest_id"))
    (tmp_path / "truncated.parquet").write_bytes(data[: len(data) // 2] + data[-8:])
    for damaged in ("bad-name.parquet", "truncated.parquet"):
        with pytest.raises(TraceError, match="not a readable Parquet file"):
            read_trace(tmp_path / damaged)
        with pytest.raises(TraceError, match="not a readable Parquet file"):
            list(iter_trace(tmp_path / damaged))
    pq.write_table(pa.Table.from_pylist([row(0, "a")]).drop_columns(["run_id"]), tmp_path / "no-run.parquet")
    with pytest.raises(TraceError, match=r"missing column\(s\) run_id"):
        list(iter_trace(tmp_path / "no-run.parquet"))


def test_parquet_wrong_column_type_names_the_column(tmp_path):
    table = pa.Table.from_pylist([row(0, "a")]).set_column(2, "step_latency_s", pa.array(["0.1"]))
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(TraceError, match="column step_latency_s: expected number"):
        read_trace(tmp_path / "t.parquet")


def test_run_ids_must_not_collide_across_files(tmp_path):
    write_trace(trace_from_rows([row(0, "a")]), tmp_path / "a.parquet")
    write_trace(trace_from_rows([row(0, "b")]), tmp_path / "b.parquet")
    with pytest.raises(TraceError, match="run id also used"):
        read_traces([tmp_path / "a.parquet", tmp_path / "b.parquet"])


def test_streaming_parquet_yields_whole_steps_matching_a_full_read(tmp_path):
    from llmvisor.core.synthetic import synthetic_trace

    trace = synthetic_trace(500, max_batch_size=9, seed=4)
    write_trace(trace, tmp_path / "big.parquet")
    pieces = list(iter_trace(tmp_path / "big.parquet", batch_rows=97))
    assert len(pieces) > 5
    assert sum(p.n_steps for p in pieces) == trace.n_steps
    np.testing.assert_array_equal(np.concatenate([p.num_context_tokens for p in pieces]), trace.num_context_tokens)
    np.testing.assert_array_equal(np.concatenate([p.step_latency_s_per_step for p in pieces]), trace.step_latency_s_per_step)


def test_streaming_rejects_split_steps(tmp_path):
    rows = [row(0, "a"), row(1, "a"), row(0, "b")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "split.parquet", row_group_size=1)
    with pytest.raises(TraceError, match="not contiguous"):
        list(iter_trace(tmp_path / "split.parquet", batch_rows=1))


@pytest.mark.parametrize("suffix", (".jsonl", ".csv"))
def test_writer_appends_whole_steps_and_survives_a_crash(tmp_path, suffix):
    path = tmp_path / f"live{suffix}"
    writer = TraceWriter(path, flush_every_steps=1)
    for step in range(3):
        writer.write_step([row(step, "a", context=10 + step), row(step, "b", context=5 + step, is_warmup=step == 0)])
    # no close(): the process "died" here; every flushed step must be readable
    trace = read_trace(path)
    assert trace.n_steps == 3
    assert list(trace.is_warmup_per_step) == [True, False, False]
    again = TraceWriter(path)
    again.write_step([row(3, "a", context=13)])
    again.close()
    assert read_trace(path).n_steps == 4


def test_writer_parquet_appears_only_when_closed(tmp_path):
    path = tmp_path / "live.parquet"
    with TraceWriter(path, metadata={"plan": "x"}) as writer:
        writer.write_step([row(0, "a")])
        writer.write_step([row(1, "a", context=11)])
        assert not path.exists()
    trace = read_trace(path)
    assert trace.n_steps == 2 and trace.metadata == {"plan": "x"}


def test_cli_reports_bad_trace_in_one_line_with_exit_code_2(tmp_path):
    path = write_rows(tmp_path / "bad.csv", [row(0, "a"), row(0, "b", latency=0.5)], ".csv")
    result = subprocess.run(
        [sys.executable, "-m", "llmvisor.cli", "fit", str(path), "-o", str(tmp_path / "m.json")],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "rows disagree on step_latency_s" in result.stderr and str(path) in result.stderr
    assert not (tmp_path / "m.json").exists()


_ANY_VALUE = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats()
    | st.text(alphabet=st.characters(codec=None), max_size=4)
    | st.lists(st.integers(), max_size=2)
)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["run_id", "step_id", "step_latency_s", "num_new_tokens", "phase"]), values=st.lists(_ANY_VALUE, max_size=6))
def test_the_column_at_a_time_type_check_agrees_with_the_per_value_check(name, values):
    from llmvisor.core.trace import _python_value_type_error, _values_are_valid

    assert _values_are_valid(name, values) == all(_python_value_type_error(name, v) is None for v in values)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (np.array([True, False]), [True, False]),
        (np.array([1, 0]), [True, False]),
        (np.array(["yes", "no"], dtype=object), [True, False]),
        (np.array(["True", "false"], dtype=object), [True, False]),
        (np.array([" 1 ", "0"], dtype=object), [True, False]),
        (np.array(["Y", ""], dtype=object), [True, False]),
        (np.array([None, True], dtype=object), [False, True]),
    ],
)
def test_is_warmup_has_one_reading_shared_by_the_fit_and_the_profiler(values, expected):
    from llmvisor.profile.stats import warmup_mask_per_step

    trace = trace_from_rows([row(0, "a"), row(1, "a")])
    trace.extra["is_warmup"] = values
    assert parse_is_warmup(values).tolist() == expected
    assert trace.is_warmup_per_step.tolist() == expected
    assert warmup_mask_per_step(trace).tolist() == expected


def test_an_unreadable_is_warmup_value_is_a_one_line_error():
    trace = trace_from_rows([row(0, "a"), row(1, "a")])
    trace.extra["is_warmup"] = np.array(["no", "maybe"], dtype=object)
    with pytest.raises(TraceError, match="slice 2: is_warmup: .*'maybe'"):
        _ = trace.is_warmup_per_step


def test_a_trace_indexes_by_steps_as_scikit_learn_does():
    trace = trace_from_rows([row(0, "a"), row(0, "b"), row(1, "a"), row(2, "a"), row(2, "c")])
    assert len(trace) == 3 and trace.shape == (3,)
    picked = trace[np.array([2, 0])]
    assert picked.step_id_per_step.tolist() == [2, 0]
    assert picked.request_id.tolist() == ["a", "c", "a", "b"]
    assert trace[np.array([2, 0]), ...].request_id.tolist() == picked.request_id.tolist()
    assert trace[np.array([False, True, False])].step_id_per_step.tolist() == [1]
    assert trace[1:].n_steps == 2
    with pytest.raises(TypeError):
        trace[np.array([0.5])]


# ---------------------------------------------------------------------------------------------------------
# Version 2: the shared-KV columns


def shared_row(step_id, request_id, context, shared, effective, **kwargs):
    return row(step_id, request_id, context=context, num_shared_context_tokens=shared, effective_context_tokens=effective, **kwargs)


def v2_rows():
    """Step 0: a and b share a 64-token prefix (each reads half of it), c reads its own context; step 1: nothing shared."""
    return [
        shared_row(0, "a", 70, 64, 6 + 32.0),
        shared_row(0, "b", 100, 64, 36 + 32.0),
        shared_row(0, "c", 10, 0, 10.0),
        shared_row(1, "a", 71, 0, 71.0),
    ]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_v2_columns_round_trip_in_every_file_type(tmp_path, suffix):
    trace = read_trace(write_rows(tmp_path / f"v2{suffix}", v2_rows(), suffix))
    assert trace.has_sharing_columns
    assert trace.num_shared_context_tokens.tolist() == [64, 64, 0, 0]
    assert trace.effective_context_tokens.tolist() == [38.0, 68.0, 10.0, 71.0]
    assert trace.has_shared_context_per_step.tolist() == [True, False]
    write_trace(trace, tmp_path / f"again{suffix}")
    again = read_trace(tmp_path / f"again{suffix}")
    np.testing.assert_array_equal(again.num_shared_context_tokens, trace.num_shared_context_tokens)
    np.testing.assert_array_equal(again.effective_context_tokens, trace.effective_context_tokens)
    assert again.extra["num_shared_context_tokens"].dtype == np.int64
    assert again.extra["effective_context_tokens"].dtype == np.float64


def test_parquet_format_version_is_2_with_the_sharing_columns_and_1_without(tmp_path):
    def version(path):
        return json.loads(pq.read_schema(path).metadata[b"llmvisor.trace"])["format_version"]

    write_trace(trace_from_rows(v2_rows()), tmp_path / "v2.parquet")
    write_trace(trace_from_rows([row()]), tmp_path / "v1.parquet")
    assert (version(tmp_path / "v2.parquet"), version(tmp_path / "v1.parquet")) == (2, 1)
    assert pq.read_schema(tmp_path / "v2.parquet").field("effective_context_tokens").type == pa.float64()
    with TraceWriter(tmp_path / "w2.parquet") as writer:
        writer.write_step([{**r, "effective_context_tokens": int(r["effective_context_tokens"])} for r in v2_rows()[:3]])
    assert version(tmp_path / "w2.parquet") == 2
    assert pq.read_schema(tmp_path / "w2.parquet").field("effective_context_tokens").type == pa.float64()
    with TraceWriter(tmp_path / "w1.parquet") as writer:
        writer.write_step([row()])
    assert version(tmp_path / "w1.parquet") == 1


def test_a_v1_trace_means_nothing_shared():
    trace = trace_from_rows([row(0, "a", context=5), row(0, "b", context=7)])
    assert not trace.has_sharing_columns
    assert trace.num_shared_context_tokens.tolist() == [0, 0]
    assert trace.effective_context_tokens.tolist() == [5.0, 7.0]
    assert trace.has_shared_context_per_step.tolist() == [False]


def test_v1_and_v2_traces_read_together_fill_in_nothing_shared(tmp_path):
    write_trace(trace_from_rows([row(0, "x", context=9, run_id="old")]), tmp_path / "old.parquet")
    write_trace(trace_from_rows(v2_rows()), tmp_path / "new.jsonl")
    both = read_traces([tmp_path / "old.parquet", tmp_path / "new.jsonl"])
    assert both.has_sharing_columns
    assert both.effective_context_tokens.tolist() == [9.0, 38.0, 68.0, 10.0, 71.0]
    assert both.num_shared_context_tokens.tolist() == [0, 64, 64, 0, 0]


def test_streaming_and_arrow_readers_keep_the_sharing_columns(tmp_path):
    from llmvisor.core.synthetic import synthetic_trace
    from llmvisor.core.trace import build_trace, trace_columns_from_arrow

    trace = synthetic_trace(300, max_batch_size=9, shared_prefix_fraction=0.5, seed=5)
    write_trace(trace, tmp_path / "shared.parquet")
    pieces = list(iter_trace(tmp_path / "shared.parquet", batch_rows=50))
    assert len(pieces) > 5 and all(p.has_sharing_columns for p in pieces)
    np.testing.assert_array_equal(np.concatenate([p.effective_context_tokens for p in pieces]), trace.effective_context_tokens)
    columns, rows = trace_columns_from_arrow("body", pq.read_table(tmp_path / "shared.parquet"))
    np.testing.assert_array_equal(build_trace(columns, row_numbers=rows).num_shared_context_tokens, trace.num_shared_context_tokens)


def test_sharing_columns_from_blocks_follow_the_definition():
    # slices 0, 1, 2 read block A (16 tokens); 0 and 1 read block B (16); 2 reads block C (16) alone.
    shared, effective = sharing_columns_from_blocks([40, 32, 40], [(16, [0, 1, 2]), (16, [0, 1]), (16, [2])])
    assert shared.tolist() == [32, 32, 16]
    np.testing.assert_allclose(effective, [8 + 16 / 3 + 8, 16 / 3 + 8, 8 + 16 / 3 + 16])
    assert effective.sum() == pytest.approx(8 + 16 + 16 + 16 + 8)
    with pytest.raises(ValueError, match="slice 1"):
        sharing_columns_from_blocks([40, 10], [(16, [0, 1])])


def with_change(index, **change):
    rows = v2_rows()
    rows[index] = {**rows[index], **change}
    return rows


BAD_V2 = [
    ("negative shared", with_change(2, num_shared_context_tokens=-1), "row 3", "num_shared_context_tokens: token count must be >= 0"),
    ("shared over context", with_change(2, num_shared_context_tokens=11), "row 3", "shared tokens must be <= num_context_tokens"),
    ("effective over context", with_change(2, effective_context_tokens=10.5), "row 3", "effective_context_tokens: must be <= num_context_tokens"),
    ("negative effective", with_change(2, effective_context_tokens=-1.0), "row 3", "effective_context_tokens: must be >= 0"),
    ("effective under exclusive", with_change(1, effective_context_tokens=35.0), "row 2", "must be >= num_context_tokens - num_shared_context_tokens"),
    ("shared counted once", with_change(1, effective_context_tokens=99.0), "row 2", "a shared block has at least two readers"),
    ("lone sharer", with_change(1, num_shared_context_tokens=0, effective_context_tokens=100.0), "step 0", "only one slice of the step has shared context"),
    ("wrong type", with_change(0, num_shared_context_tokens=1.5), "row 1", "num_shared_context_tokens: expected an integer"),
    ("missing value", with_change(3, effective_context_tokens=None), "row 4", "effective_context_tokens: missing value"),
]


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("name,rows,where,reason", BAD_V2, ids=[b[0] for b in BAD_V2])
def test_reader_rejects_bad_sharing_columns(tmp_path, suffix, name, rows, where, reason):
    path = write_rows(tmp_path / f"bad{suffix}", rows, suffix)
    with pytest.raises(TraceError) as error:
        read_trace(path)
    message = str(error.value)
    if suffix == ".parquet" and name == "wrong type":
        where, reason = "column num_shared_context_tokens", "expected integer values"
    assert str(path) in message and reason in message and where in message, message


def test_non_finite_effective_context_and_a_lone_column_are_rejected():
    with pytest.raises(TraceError, match="row 3: effective_context_tokens: must be finite"):
        trace_from_rows(with_change(2, effective_context_tokens=float("nan")))
    lone = [{k: v for k, v in r.items() if k != "effective_context_tokens"} for r in v2_rows()]
    with pytest.raises(TraceError, match="header: column num_shared_context_tokens without effective_context_tokens"):
        trace_from_rows(lone)


def test_effective_context_within_float_rounding_of_a_bound_is_accepted():
    rows = [shared_row(0, r, 30, 30, 10.000000000001 if r == "a" else 10.0) for r in "abc"]
    assert trace_from_rows(rows).effective_context_tokens.sum() == pytest.approx(30)


def test_errors_show_plain_numbers_and_an_empty_trace_names_its_file(tmp_path):
    from llmvisor.core.model import StepLatencyModel

    bad = tmp_path / "bad.jsonl"
    row = {"run_id": "r", "step_id": 0, "step_latency_s": -0.01, "request_id": "a", "tenant": "t",
           "num_new_tokens": 1, "num_context_tokens": 0, "phase": "decode"}  # fmt: skip
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(TraceError, match=r"\(got -0\.01\)$"):
        read_trace(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(LlmvisorError, match=f"^{re.escape(str(empty))}: cannot fit on a trace with no steps"):
        StepLatencyModel().fit(read_trace(empty))
