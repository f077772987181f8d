"""The service prices shared KV blocks (trace format v2) the same whichever form a body takes."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("fastapi")

from llmvisor.core.model import StepLatencyModel  # noqa: E402
from llmvisor.core.synthetic import DEFAULT_COEF_S, synthetic_trace  # noqa: E402
from llmvisor.service.ingest import PARQUET_MEDIA_TYPE, PayloadError, prepare_batch, read_batch  # noqa: E402

LIMITS = {"max_steps": 1000, "max_rows": 100_000, "max_decoded_bytes": 10_000_000}
MODEL = StepLatencyModel.from_coefficients([dict(DEFAULT_COEF_S, effective_context_tokens=1e-7)])


def bodies():
    trace = synthetic_trace(30, max_batch_size=8, shared_prefix_fraction=0.7, seed=3)
    table = trace.to_arrow()
    rows = table.to_pylist()
    groups = [rows[start:stop] for start, stop in zip(trace.step_offsets[:-1], trace.step_offsets[1:])]
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return trace, {
        "rows": (json.dumps({"steps": groups}).encode(), None),
        "columns": (json.dumps({"columns": table.to_pydict()}).encode(), None),
        "parquet": (buffer.getvalue(), PARQUET_MEDIA_TYPE),
    }


def test_every_body_form_bills_shared_kv_alike():
    trace, forms = bodies()
    assert trace.has_shared_context_per_step.any()
    billed = {}
    for name, (body, content_type) in forms.items():
        batch = read_batch(body, content_type=content_type, **LIMITS)
        assert batch.has_sharing_columns, name
        billed[name] = prepare_batch(MODEL, batch, received_at_us=0).records.attributed_ns
    np.testing.assert_array_equal(billed["rows"], billed["columns"])
    np.testing.assert_array_equal(billed["rows"], billed["parquet"])
    v1 = trace.select_steps(np.ones(trace.n_steps, dtype=bool))
    v1.extra = {}
    unshared = prepare_batch(MODEL, v1, received_at_us=0).records.attributed_ns
    assert not np.array_equal(unshared, billed["rows"])


def test_a_bad_sharing_column_is_a_422_naming_the_row():
    _, forms = bodies()
    data = json.loads(forms["columns"][0])
    data["columns"]["effective_context_tokens"][0] = -1.0
    with pytest.raises(PayloadError, match="effective_context_tokens: must be >= 0") as error:
        read_batch(json.dumps(data).encode(), **LIMITS)
    assert error.value.status == 422


def test_every_body_form_meters_cached_prompt_tokens_alike():
    """The prefix-cache fact (``num_cached_prompt_tokens``) reaches the stored records from rows, columns and
    Parquet alike; the Parquet form once read past it and metered every cached prompt token as uncached."""
    trace = synthetic_trace(30, max_batch_size=8, shared_prefix_fraction=0.7, seed=5)
    table = trace.to_arrow()
    cached = [min(int(c), 7) if phase == "prefill" else 0
              for c, phase in zip(table.column("num_context_tokens").to_pylist(), table.column("phase").to_pylist())]
    assert sum(cached) > 0
    table = table.append_column("num_cached_prompt_tokens", pa.array(cached, type=pa.int64()))
    rows = table.to_pylist()
    groups = [rows[start:stop] for start, stop in zip(trace.step_offsets[:-1], trace.step_offsets[1:])]
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    forms = {
        "rows": (json.dumps({"steps": groups}).encode(), None),
        "columns": (json.dumps({"columns": table.to_pydict()}).encode(), None),
        "parquet": (buffer.getvalue(), PARQUET_MEDIA_TYPE),
    }
    for name, (body, content_type) in forms.items():
        records = prepare_batch(MODEL, read_batch(body, content_type=content_type, **LIMITS), received_at_us=0).records
        assert records.num_cached_prompt_tokens is not None, name
        assert records.num_cached_prompt_tokens.tolist() == cached, name
