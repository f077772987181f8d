"""Relayed steps as columns (`llmvisor.core.relayed.StepColumns`) are the rows of the same steps, column by column,
and the archive files made from either are the same files (issue 22: the archive no longer builds a dict per slice);
also with named columns (trace format 4's LoRA columns) on some steps."""

from __future__ import annotations

import os

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmvisor.archive import ArchiveWriter
from llmvisor.archive.writer import rows_columns
from llmvisor.core.lora_trace import encode_adapters
from llmvisor.core.relayed import StepColumns, step_rows

T0_S = 1_750_000_000.0

base_slice = st.tuples(
    st.text(min_size=1, max_size=5),
    st.one_of(st.sampled_from(["t0", "tenant é/2"]), st.integers(0, 3)),  # a tenant id the rows write as a string
    st.integers(1, 4096),
    st.integers(0, 1 << 20),
    st.booleans(),
    st.integers(0, 64),
    st.one_of(st.none(), st.floats(0, 1e6, allow_nan=False)),
)
slice_strategy = st.one_of(base_slice, st.tuples(base_slice, st.integers(0, 4096)).map(lambda t: (*t[0], t[1])))
"""Seven fields, or eight with prefix-cache hits: a step writes that column only when all its slices have it."""


@st.composite
def lora_element(draw, n_slices: int) -> list:
    """The fifth element (no KV figures: None) and the sixth, trace format 4's LoRA columns by name."""
    adapters = draw(st.lists(st.sampled_from(["", "a8", "b16", "ü/64"]), min_size=n_slices, max_size=n_slices))
    ran = encode_adapters(a for a in adapters if a)
    return [None, {"slice": {"lora_name": adapters, "lora_rank": [0 if not a else int(a[-2:].strip("ab/ü")) for a in adapters]},
                   "step": {"step_loras": ran, "step_lora_loads": draw(st.sampled_from([ran, "[]"])),
                            "step_lora_disk_loads": "[]"}}]


@st.composite
def relayed_steps(draw):
    n = draw(st.integers(1, 30))
    offsets = sorted(draw(st.lists(st.floats(0, 200, allow_nan=False), min_size=n, max_size=n)))
    steps = []
    for step_id, offset_s in enumerate(offsets):
        slices = [list(s) for s in draw(st.lists(slice_strategy, min_size=0, max_size=5))]
        named = draw(lora_element(len(slices))) if draw(st.booleans()) else []  # some steps have the LoRA columns
        steps.append([step_id, T0_S + offset_s, draw(st.floats(1e-4, 2.0, allow_nan=False)), slices, *named])
    return steps


headers = st.fixed_dictionaries({
    "columns": st.sampled_from([
        {"run_id": "run-a"},
        {"run_id": "run b/ü", "engine_fingerprint": "00000000000000f0"},
        {"run_id": "r%3", "engine_fingerprint": "00000000000000f1", "is_warmup": "header's", "num_cached_prompt_tokens": 7},
    ]),
    "warmup_steps": st.integers(0, 5),
})


@settings(max_examples=80, deadline=None)
@given(header=headers, steps=relayed_steps())
def test_columns_are_the_rows_of_the_same_steps(header, steps):
    columns = StepColumns(header)
    for step in steps:
        columns.add(step)
    rows = [row for step in steps for row in step_rows(header, step)]
    got, expected = columns.columns(), rows_columns(rows)
    assert list(got) == list(expected)  # same columns, same order
    assert got == expected
    assert columns.num_rows == len(rows) and columns.num_steps == sum(1 for s in steps if s[3])


@settings(max_examples=40, deadline=None)
@given(header=headers, steps=relayed_steps(), window_s=st.sampled_from([0.5, 7.0, 60.0]))
def test_the_archive_writes_the_same_files_from_relayed_steps_as_from_rows(header, steps, window_s):
    urls = [f"memory://relayed-{os.urandom(6).hex()}" for _ in range(2)]
    by_rows = ArchiveWriter(urls[0], window_s=window_s, metadata={"engine_fingerprint": {"id": "00000000000000f0"}}, clock=lambda: T0_S)
    relayed = ArchiveWriter(urls[1], window_s=window_s, metadata={"engine_fingerprint": {"id": "00000000000000f0"}}, clock=lambda: T0_S)
    for step in steps:
        by_rows.add_step(step_rows(header, step))
        relayed.add_relayed(header, step)
    assert by_rows.close() and relayed.close()
    assert relayed.stats == by_rows.stats
    fs = fsspec.filesystem("memory")
    files = [{path.split("/", 3)[-1]: fs.cat_file(path) for path in fs.find(url.removeprefix("memory://"))} for url in urls]
    assert files[1] == files[0]
    assert bool(files[0]) == any(step[3] for step in steps)


def test_a_window_takes_rows_or_relayed_steps_and_a_short_slice_is_refused():
    header = {"columns": {"run_id": "run-a"}, "warmup_steps": 0}
    step = [0, T0_S, 0.01, [["r", "t0", 1, 10, False, 0, None]]]
    writer = ArchiveWriter(f"memory://relayed-{os.urandom(6).hex()}")
    writer.add_step(step_rows(header, step))
    with pytest.raises(ValueError, match="not both"):
        writer.add_relayed(header, [1, T0_S, 0.01, step[3]])
    writer = ArchiveWriter(f"memory://relayed-{os.urandom(6).hex()}")
    writer.add_relayed(header, step)
    with pytest.raises(ValueError, match="not both"):
        writer.add_step(step_rows(header, [1, T0_S, 0.01, step[3]]))
    columns = StepColumns(header)
    with pytest.raises(ValueError, match="step 3: a slice has fewer than 7 fields"):
        columns.add([3, T0_S, 0.01, [["r", "t0", 1, 10, False, 0, None], ["q", "t0", 1, 10, False, 0]]])
    columns.add([4, T0_S, 0.01, [["p", "t1", 1, 11, False, 0, None]]])  # nothing of the refused step was kept
    assert columns.columns() == rows_columns(step_rows(header, [4, T0_S, 0.01, [["p", "t1", 1, 11, False, 0, None]]]))
