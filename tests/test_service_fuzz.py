"""Generated bad inputs against the HTTP API: whatever arrives, the answer is never a 5xx and the ledger
still reconciles. Hypothesis rather than schemathesis: the interesting bodies are near-valid trace rows
(one field of the wrong type, a huge integer, a lone surrogate, NUL), which a generator written against the
trace contract reaches far more often than one derived from the OpenAPI schema, and it needs no new dependency.
"""

from __future__ import annotations

import json
import subprocess
import sys
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _service_fixtures import POSTGRES_URL, bearer, empty_postgres, model_path  # noqa: F401
from llmvisor.ledger import Ledger
from llmvisor.service.app import create_app

FUZZ_BACKENDS = ["sqlite", pytest.param("postgresql", marks=[pytest.mark.postgres, pytest.mark.skipif(not POSTGRES_URL, reason="LLMVISOR_TEST_POSTGRES_URL not set")])]


@pytest.fixture(scope="module", params=FUZZ_BACKENDS)
def service(request, model_path, tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz')}/ledger.db" if request.param == "sqlite" else empty_postgres(POSTGRES_URL)
    ledger = Ledger(url)
    keys = {"admin": ledger.create_key(is_admin=True), "tenant": ledger.create_key("tenant-0")}
    ledger.close()
    with TestClient(create_app(model_path, url, max_body_bytes=200_000, max_steps_per_request=50)) as client:
        yield client, keys


any_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)
json_scalars = st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80) | st.floats() | any_text
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3), max_leaves=8)

GOOD = {
    "run_id": st.sampled_from(["run-a", "run-b"]),
    "step_id": st.integers(0, 5),
    "step_latency_s": st.floats(1e-4, 1.0),
    "request_id": st.sampled_from(["q0", "q1", "q2"]),
    "tenant": st.sampled_from(["tenant-0", "tenant-1"]),
    "num_new_tokens": st.integers(1, 3),
    "num_context_tokens": st.integers(0, 100),
    "phase": st.sampled_from(["prefill", "decode"]),
    "timestamp_s": st.floats(1.7e9, 1.8e9),
}
BAD = {
    "step_id": st.integers(min_value=2**62, max_value=2**70) | st.floats() | any_text,
    "step_latency_s": st.floats() | st.integers(-(2**70), 2**70) | st.sampled_from(["1e999", "-0"]),
    "num_new_tokens": st.integers(-(2**70), 2**70) | st.floats(),
    "num_context_tokens": st.integers(-(2**70), 2**70),
    "timestamp_s": st.floats() | st.integers(-(2**70), 2**70) | any_text,
}


@st.composite
def near_valid_steps(draw):
    """A valid step's rows, one value of one row spoiled in about half the steps."""
    shared = {name: draw(GOOD[name]) for name in ("run_id", "step_id", "step_latency_s", "timestamp_s")}
    rows = []
    for i in range(draw(st.integers(1, 3))):
        phase = draw(GOOD["phase"])
        rows.append({
            **shared,
            "request_id": f"q{i}",
            "tenant": draw(GOOD["tenant"]),
            "num_new_tokens": draw(GOOD["num_new_tokens"]) if phase == "prefill" else 1,
            "num_context_tokens": draw(GOOD["num_context_tokens"]),
            "phase": phase,
        })
    if draw(st.booleans()):
        row = draw(st.sampled_from(rows))
        name = draw(st.sampled_from(sorted(GOOD)))
        how = draw(st.integers(0, 3))
        if how == 0:
            row.pop(name, None)
        elif how == 1:
            row[name] = draw(json_values)
        elif how == 2 and name in BAD:
            row[name] = draw(BAD[name])
        else:
            row[name] = draw(any_text)
    if draw(st.integers(0, 4)) == 0:
        rows[0][draw(any_text)] = draw(json_values)
    return rows


@st.composite
def near_valid_columns(draw):
    """The column form of some near-valid steps, a column sometimes replaced, cut short or of mixed types."""
    rows = [row for step in draw(st.lists(near_valid_steps(), min_size=1, max_size=4)) for row in step]
    names = sorted({name for row in rows for name in row if name in GOOD})
    columns = {name: [row.get(name) for row in rows] for name in names}
    if names and draw(st.booleans()):
        name = draw(st.sampled_from(names))
        how = draw(st.integers(0, 3))
        if how == 0:
            columns[name] = draw(json_values)
        elif how == 1:
            columns[name] = columns[name][:-1]
        elif how == 2:
            columns[name] = draw(st.lists(json_scalars, min_size=len(rows), max_size=len(rows)))
        else:
            columns[name] = [draw(BAD.get(name, any_text)) for _ in rows]
    return {"columns": columns}


bodies = st.one_of(
    near_valid_columns().map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(near_valid_steps(), max_size=6).map(lambda g: json.dumps({"steps": g}).encode()),
    st.lists(st.lists(json_values, max_size=3), max_size=3).map(lambda g: json.dumps({"steps": g}).encode()),
)


def _reconciles(client, admin) -> bool:
    totals = client.get("/v1/usage/totals", headers=admin).json()
    return totals["attributed_ns"] == totals["measured_ns"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies)
def test_post_steps_never_answers_5xx(service, body):
    client, keys = service
    admin = bearer(keys["admin"])
    response = client.post("/v1/steps", content=body, headers={**admin, "Content-Type": "application/json"})
    assert response.status_code < 500, response.text
    assert isinstance(response.json()["detail"] if response.status_code != 200 else response.json(), (str, dict))
    if response.status_code == 200:
        assert _reconciles(client, admin)


# A URL is bytes: a lone surrogate cannot be put in a query string by any client, so it is left to the body tests.
query_values = st.one_of(
    st.text(alphabet=st.characters(codec=None, exclude_categories=("Cs",)), max_size=12),
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(str),
    st.sampled_from(
        ["minute", "hour", "day", "2025-01-01T00:00:00Z", "2025-01-01 00:00:00 00:00", "1e400", "-1", "\x00", "1.5",
         "2025-01-01T00:00:00.5"]
    ),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    path=st.sampled_from(["/v1/usage/tenants", "/v1/usage/requests", "/v1/usage/top", "/v1/usage/totals"]),
    params=st.dictionaries(
        st.sampled_from(["start", "end", "bucket", "tenant", "run_id", "request_id", "n", "limit", "offset"]), query_values, max_size=4
    ),
    who=st.sampled_from(["admin", "tenant"]),
)
def test_usage_queries_never_answer_5xx(service, path, params, who):
    client, keys = service
    response = client.get(path, params=params, headers=bearer(keys[who]))
    assert response.status_code < 500, response.text
    if who == "tenant" and response.status_code == 200 and path != "/v1/usage/totals":
        rows = response.json().get("tenants") or response.json().get("requests") or []
        assert all(row["tenant"] == "tenant-0" for row in rows)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(run_id=query_values, step_id=query_values, who=st.sampled_from(["admin", "tenant"]))
def test_step_reads_never_answer_5xx(service, run_id, step_id, who):
    client, keys = service
    response = client.get(f"/v1/steps/{quote(run_id, safe='')}/{quote(step_id, safe='')}", headers=bearer(keys[who]))
    assert response.status_code < 500, response.text
    if who == "tenant":
        assert response.status_code != 200, response.text


@st.composite
def near_valid_parquet(draw):
    """A Parquet file of near-valid steps (Arrow infers each column's type), some bytes then overwritten."""
    rows = [row for step in draw(st.lists(near_valid_steps(), min_size=1, max_size=4)) for row in step]
    sink = pa.BufferOutputStream()
    try:
        pq.write_table(pa.Table.from_pylist(rows), sink)
    except (pa.ArrowException, OverflowError, UnicodeEncodeError):  # a lone surrogate cannot be written to Parquet
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"run_id": ["r"]}), sink)
    data = bytearray(sink.getvalue().to_pybytes())
    for _ in range(draw(st.integers(0, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=near_valid_parquet() | st.binary(max_size=200))
def test_parquet_bodies_never_answer_5xx(service, body):
    client, keys = service
    admin = bearer(keys["admin"])
    response = client.post("/v1/steps", content=body, headers={**admin, "Content-Type": "application/vnd.apache.parquet"})
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        assert _reconciles(client, admin)


def test_damaged_parquet_footers_never_abort_the_server_process(tmp_path):
    """pyarrow aborts the whole process (an untranslated C++ exception) when asked for some damaged files'
    column-chunk metadata; the ingest path must never ask. Byte-flipped files go through it in a child process,
    which would die instead of printing "ok"."""
    script = tmp_path / "flip.py"
    script.write_text(
        "import io, random\n"
        "import pyarrow as pa, pyarrow.parquet as pq\n"
        "from llmvisor.service.ingest import PayloadError, _trace_from_parquet\n"
        "rows = [{'run_id': 'r', 'step_id': i, 'step_latency_s': 0.01, 'request_id': f'q{i}', 'tenant': 't',\n"
        "         'num_new_tokens': 1, 'num_context_tokens': 5, 'phase': 'decode'} for i in range(4)]\n"
        "sink = pa.BufferOutputStream(); pq.write_table(pa.Table.from_pylist(rows), sink)\n"
        "base = bytearray(sink.getvalue().to_pybytes())\n"
        "rng = random.Random(7)\n"
        "for _ in range(3000):\n"
        "    data = bytearray(base)\n"
        "    for _ in range(rng.randint(1, 4)):\n"
        "        data[rng.randrange(len(data) - 8, len(data)) if rng.random() < 0.3 else rng.randrange(len(data))] = rng.randrange(256)\n"
        "    try:\n"
        "        _trace_from_parquet(bytes(data), max_rows=100_000, max_decoded_bytes=10**7)\n"
        "    except Exception:\n"
        "        pass\n"
        "print('ok')\n"
    )
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stderr[-2000:]
