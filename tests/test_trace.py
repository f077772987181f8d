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


def test_optional_and_unknown_columns_are_kept(tmp_path):
    rows = [row(0, "a", timestamp_s=1.5, engine="vllm", my_column="x"), row(0, "b", timestamp_s=1.5, engine="vllm", my_column="y")]
    for suffix in SUFFIXES:
        trace = read_trace(write_rows(tmp_path / f"t{suffix}", rows, suffix))
        assert "my_column" in trace.extra and "engine" in trace.extra
        write_trace(trace, tmp_path / f"again{suffix}")
        assert sorted(map(str, read_trace(tmp_path / f"again{suffix}").extra["my_column"])) == ["x", "y"]


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
