"""The raw-step archive (`llmvisor.archive`, issue 22): what goes in comes back, windows rotate where they should,
a reader never sees half a file, a failed write keeps its steps, and the files are ordinary trace files."""

from __future__ import annotations

import os
import threading

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmvisor.archive import ArchiveReadError, ArchiveWriter, archive_files, file_name, parse_file_name, read_archive
from llmvisor.core.trace import read_trace, trace_from_rows

T0_S = 1_750_000_000.0
W0_S = 1_750_000_020.0
"""A multiple of 60 s: a window boundary."""


def make_step(run_id: str, step_id: int, timestamp_s: float, slices: list[tuple], *, fingerprint: str = "00000000000000f0",
              sharing: bool = True) -> list[dict]:
    latency_s = 0.001 + (step_id % 97) * 1.37e-4
    rows = []
    for request, tenant, new, context, prefill, _shared in slices:
        row = {"run_id": run_id, "step_id": step_id, "step_latency_s": latency_s, "request_id": request, "tenant": tenant,
               "num_new_tokens": new if prefill else 1, "num_context_tokens": context, "phase": "prefill" if prefill else "decode",
               "timestamp_s": timestamp_s, "engine_fingerprint": fingerprint, "is_warmup": step_id < 2}
        if sharing:
            row["num_shared_context_tokens"] = 0
            row["effective_context_tokens"] = float(context)
        rows.append(row)
    if sharing and len(rows) >= 2:  # two slices share their whole context: each counts half of it
        shared = min(rows[0]["num_context_tokens"], rows[1]["num_context_tokens"])
        for row in rows[:2]:
            row["num_shared_context_tokens"] = shared
            row["effective_context_tokens"] = row["num_context_tokens"] - shared / 2
    return rows


def canonical(trace):
    """Steps ordered by (run, step id): the archive's files are read in name order, rows in step order."""
    return trace.take_steps(np.lexsort((trace.step_id_per_step, trace.run_id_per_step.astype(str))))


slice_strategy = st.tuples(st.text(min_size=1, max_size=6), st.sampled_from(["t0", "t1", "tenant é/2"]),
                           st.integers(1, 4096), st.integers(0, 1 << 20), st.booleans(), st.just(0))
step_strategy = st.tuples(
    st.sampled_from(["run-a", "run b/ü", "r%3"]),
    st.floats(0.0, 300.0, allow_nan=False),
    st.lists(slice_strategy, min_size=1, max_size=6, unique_by=lambda s: s[0]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step_strategy, min_size=1, max_size=40), window_s=st.sampled_from([0.5, 7.0, 60.0]),
       sharing=st.booleans())
def test_steps_read_back_from_the_archive_equal_what_was_written(steps, window_s, sharing):
    url = f"memory://archive-{os.urandom(6).hex()}"
    writer = ArchiveWriter(url, window_s=window_s, metadata={"engine_fingerprint": {"id": "00000000000000f0"}})
    rows_in = []
    for step_id, (run_id, offset_s, slices) in enumerate(steps):
        rows = make_step(run_id, step_id, T0_S + offset_s, slices, sharing=sharing)
        writer.add_step(rows)
        rows_in.extend(rows)
    assert writer.close() and writer.stats.steps_written == len(steps) and writer.stats.errors == 0
    expected = canonical(trace_from_rows(rows_in))
    got = canonical(read_archive(url))
    assert got.n_steps == expected.n_steps and got.n_slices == expected.n_slices
    for name in ("run_id", "step_id", "step_latency_s", "request_id", "tenant", "num_new_tokens", "num_context_tokens",
                 "is_prefill", "step_offsets"):
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name
    assert set(got.extra) == set(expected.extra)
    for name, values in expected.extra.items():
        assert np.asarray(got.extra[name]).tolist() == np.asarray(values).tolist(), name
    assert got.metadata["engine_fingerprint"] == {"id": "00000000000000f0"}
    # a period and a tenant: exactly the steps starting in it that ran a slice of the tenant, each whole
    start_us, end_us = int((T0_S + 50) * 1e6), int((T0_S + 200) * 1e6)
    part = read_archive(url, start_us, end_us, tenant="t1")
    when_us = np.rint(expected.extra["timestamp_s"].astype(float) * 1e6)[expected.step_starts]
    has_t1 = np.add.reduceat((expected.tenant == "t1").astype(int), expected.step_starts) > 0 if expected.n_steps else []
    wanted = (when_us >= start_us) & (when_us < end_us) & has_t1
    assert sorted(zip(part.run_id_per_step.tolist(), part.step_id_per_step.tolist())) == sorted(
        zip(expected.run_id_per_step[wanted].tolist(), expected.step_id_per_step[wanted].tolist()))
    assert part.n_slices == int(expected.batch_size_per_step[wanted].sum())


def test_windows_rotate_at_their_boundaries_and_a_late_step_gets_a_new_part(tmp_path):
    writer = ArchiveWriter(str(tmp_path), window_s=60.0)
    slices = [("q0", "t0", 5, 10, True, 0)]
    writer.add_step(make_step("run-a", 0, W0_S - 0.001, slices))    # window [W0 - 60, W0)
    writer.add_step(make_step("run-a", 1, W0_S, slices))            # the boundary itself opens the next window
    assert writer.stats.files_written == 1                          # ... and closes the one before
    writer.add_step(make_step("run-a", 2, W0_S + 59.999, slices))
    writer.add_step(make_step("run-b", 0, W0_S + 1, slices))        # another run: its own files
    writer.add_step(make_step("run-a", 3, W0_S + 60, slices))
    assert writer.stats.files_written == 2
    writer.add_step(make_step("run-a", 4, W0_S + 1, slices))        # late: its window was written already
    writer.rotate(now_s=W0_S + 130)                                 # both T0 windows ended (+ grace)
    assert writer.close()
    names = sorted(os.path.relpath(os.path.join(root, f), tmp_path) for root, _, files in os.walk(tmp_path) for f in files)
    t0_ms = int(W0_S * 1000)
    assert names == sorted([
        file_name("run-a", t0_ms - 60_000, 0), file_name("run-a", t0_ms, 0), file_name("run-a", t0_ms, 1),
        file_name("run-a", t0_ms + 60_000, 0), file_name("run-b", t0_ms, 0)])
    assert parse_file_name(file_name("run b/ü", t0_ms, 7)) == ("run b/ü", t0_ms, 7)
    by_file = {name: read_trace(tmp_path / name) for name in names}   # every file is a trace file of its own
    assert by_file[file_name("run-a", t0_ms, 0)].step_id_per_step.tolist() == [1, 2]
    assert by_file[file_name("run-a", t0_ms, 1)].step_id_per_step.tolist() == [4]
    meta = pq.read_schema(tmp_path / file_name("run-a", t0_ms, 1)).metadata[b"llmvisor.trace"]
    assert b'"format_version": 2' in meta and b'"part": 1' in meta and b'"window_s": 60.0' in meta
    # a new writer (a replacement delivery process) finds the parts taken and never overwrites one
    again = ArchiveWriter(str(tmp_path), window_s=60.0)
    again.add_step(make_step("run-a", 5, W0_S + 2, slices))
    assert again.close()
    assert (tmp_path / file_name("run-a", t0_ms, 2)).is_file()
    assert read_archive(str(tmp_path)).n_steps == 7


def test_model_versions_and_fingerprint_travel_in_the_file_metadata():
    import json

    url = f"memory://archive-{os.urandom(6).hex()}"
    writer = ArchiveWriter(url, metadata={"engine_fingerprint": {"id": "00000000000000f0", "dtype": "bf16"}})
    for step_id, version in enumerate([3, 3, 4]):
        rows = make_step("run-a", step_id, T0_S + step_id, [("q0", "t0", 5, 10, True, 0)])
        for row in rows:
            row["model_version"] = version
        writer.add_step(rows)
    writer.close()
    (path,) = archive_files(url)
    with fsspec.open(path, "rb") as handle:
        meta = json.loads(pq.read_schema(handle).metadata[b"llmvisor.trace"])
    assert meta["engine_fingerprint"] == {"id": "00000000000000f0", "dtype": "bf16"}
    assert meta["archive"]["model_versions"] == [3, 4] and meta["archive"]["num_steps"] == 3
    assert meta["archive"]["run_id"] == "run-a" and meta["format_version"] == 2


def test_a_reader_never_sees_a_partial_file(tmp_path):
    """While a writer rotates many windows, a reader listing and reading the directory only ever finds whole,
    readable trace files (written under a hidden temporary name, renamed when complete)."""
    slices = [(f"q{k}", f"t{k % 3}", 100, 1000 * k, k % 2 == 0, 0) for k in range(32)]
    stop = threading.Event()
    errors: list[str] = []
    seen: set[str] = set()

    def read_loop():
        while not stop.is_set():
            for path in archive_files(str(tmp_path)):
                if path in seen:  # a new file is read as soon as it is listed: while being written, if it could be
                    continue
                try:
                    with fsspec.open(path, "rb") as handle:
                        table = pq.read_table(handle)
                    assert table.num_rows % 32 == 0 and table.num_rows > 0
                    seen.add(path)
                except Exception as error:  # noqa: BLE001 - any failure is what this test looks for
                    errors.append(f"{path}: {error!r}")
            for _root, _, files in os.walk(tmp_path):
                for name in files:
                    if name.startswith("."):
                        assert parse_file_name(f"x/{name}") is None  # a temporary file is never taken for one

    reader = threading.Thread(target=read_loop)
    reader.start()
    try:
        writer = ArchiveWriter(str(tmp_path), window_s=1.0)
        for step_id in range(3000):
            writer.add_step(make_step("run-a", step_id, T0_S + step_id / 20, slices))
        writer.close()
    finally:
        stop.set()
        reader.join()
    assert errors == []
    assert len(seen) > 10
    assert read_archive(str(tmp_path)).n_steps == 3000


def test_a_failed_write_is_counted_kept_and_retried(tmp_path, caplog):
    slices = [("q0", "t0", 5, 10, True, 0)]
    (tmp_path / "run-a").write_text("not a directory")  # the run's directory cannot be made
    writer = ArchiveWriter(str(tmp_path), window_s=10.0)
    writer.add_step(make_step("run-a", 0, T0_S, slices))
    writer.add_step(make_step("run-a", 1, T0_S + 10, slices))  # closes the first window: its write fails
    assert writer.stats.errors == 1 and writer.stats.steps_held == 1 and writer.stats.steps_written == 0
    assert "cannot write 1 steps of run run-a" in caplog.text
    writer.add_step(make_step("run-a", 2, T0_S + 20, slices))  # the next rotation retries, and fails again
    assert writer.stats.errors == 3 and writer.stats.steps_held == 2
    (tmp_path / "run-a").unlink()
    writer.rotate(now_s=T0_S + 100)
    assert writer.stats.steps_held == 0 and writer.stats.steps_written == 3
    assert writer.close()
    assert read_archive(str(tmp_path)).step_id_per_step.tolist() == [0, 1, 2]


def test_a_long_outage_drops_the_oldest_windows_loudly_past_the_cap(tmp_path, caplog):
    (tmp_path / "run-a").write_text("not a directory")
    writer = ArchiveWriter(str(tmp_path), window_s=1.0, max_held_steps=3)
    for step_id in range(6):
        writer.add_step(make_step("run-a", step_id, T0_S + step_id, [("q0", "t0", 5, 10, True, 0)]))
    assert writer.stats.steps_held == 3 and writer.stats.steps_dropped == 2  # the sixth is still open
    assert "dropped 1 steps of run run-a" in caplog.text
    (tmp_path / "run-a").unlink()
    assert writer.close() and writer.stats.steps_written == 4
    assert read_archive(str(tmp_path)).step_id_per_step.tolist() == [2, 3, 4, 5]


def test_steps_never_written_are_reported_at_close(tmp_path, caplog):
    (tmp_path / "run-a").write_text("not a directory")
    writer = ArchiveWriter(str(tmp_path))
    writer.add_step(make_step("run-a", 0, T0_S, [("q0", "t0", 5, 10, True, 0)]))
    assert writer.close() is False
    assert "1 steps could not be archived" in caplog.text


@pytest.mark.parametrize("url, reason", [
    ("{tmp}/nowhere", "no such directory"),
    ("nosuchprotocol://x", "not a usable URL"),
])
def test_bad_archive_urls_are_one_error(tmp_path, url, reason):
    with pytest.raises(ArchiveReadError, match=reason):
        read_archive(url.format(tmp=tmp_path))


def test_recorder_doc_quotes_the_archive_figures():
    """docs/recorder.md quotes docs/results/archive.json (written by scripts/measure-archive.py) as it is."""
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    result = json.loads((repo / "docs" / "results" / "archive.json").read_text(encoding="utf-8"))
    doc = " ".join((repo / "docs" / "recorder.md").read_text(encoding="utf-8").split())
    b8, b32 = result["runs"]
    for figure in (f"{b8['archive_bytes_per_step']} bytes per step at B = {b8['batch_size']}",
                   f"{b32['archive_bytes_per_step']} bytes per step at B = {b32['batch_size']}",
                   f"{b32['archive_bytes_per_slice']} bytes per slice",
                   f"{b8['writer_cpu_us_per_step']} / {b32['writer_cpu_us_per_step']} µs",
                   f"{b8['rows_path_cpu_us_per_step']} / {b32['rows_path_cpu_us_per_step']} µs per step in the same run"):
        assert figure in doc, figure
    assert ("wrote the same files byte for byte" in doc) == (b8["same_files"] and b32["same_files"])


def test_an_archive_spanning_the_upgrade_to_kv_memory_reads_as_time_only():
    """Steps archived before the recorder metered KV memory (format 2) and after (format 3), in one period: read
    together as the readers join files of different versions, keeping only the columns all have; each part alone
    keeps its own."""
    from llmvisor.core.kv_memory import KvMeter
    from llmvisor.core.relayed import step_rows

    url = f"memory://archive-{os.urandom(6).hex()}"
    writer = ArchiveWriter(url, window_s=60.0)
    writer.add_step(make_step("run-old", 0, W0_S, [("a", "t0", 5, 0, True, 0)]))
    meter = KvMeter(8, 0)
    meter.observe(0, {"b": 2.0}, 2, 1)
    meter.observe(1000, {"b": 2.0}, 2, 1)
    block_ns, kv = meter.drain(["b"])
    header = {"columns": {"run_id": "run-new", "kv_pool_blocks": 8, "kv_block_bytes": 4096}, "warmup_steps": 0}
    writer.add_step(step_rows(header, [0, W0_S + 120.0, 0.01, [("b", "t1", 1, 40, False, 0, 40.0, 0, block_ns[0])],
                                       [kv.interval_ns, kv.idle_cached_block_ns, kv.free_block_ns,
                                        kv.carried_in_block_ns, kv.carried_out_block_ns]]))
    assert writer.close()
    both = read_archive(url)
    assert both.n_steps == 2 and not any(name.startswith("kv_") for name in both.extra)
    later = read_archive(url, int((W0_S + 60) * 1e6), None)
    assert later.n_steps == 1 and later.extra["kv_block_ns"].tolist() == [block_ns[0]]
