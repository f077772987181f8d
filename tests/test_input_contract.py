"""The one input contract (issue #36 item 1): every write route refuses a body with a misspelled or unknown field with a
422 naming it and the closest known name, and stores nothing; a generated body with one name, type or value
mutated from a valid one is refused the same way. Real service, real SQLite/PostgreSQL ledger."""

from __future__ import annotations

import io
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from _service_fixtures import bearer, class_model, db_url, make_steps, model_path  # noqa: F401
from llmvisor.core.model import StepLatencyModel
from llmvisor.ledger import Ledger
from llmvisor.ledger.schema import metadata
from llmvisor.metering import WindowAggregator
from llmvisor.service.app import create_app

CLASS = "c1c1c1c1c1c1c1c1"
PARQUET = "application/vnd.apache.parquet"


@pytest.fixture
def service(model_path, db_url):
    ledger = Ledger(db_url)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    with TestClient(create_app(model_path, db_url)) as client:
        added = client.post("/v1/models", headers=bearer(admin),
                            json={"model": class_model(CLASS).to_dict(), "engine_class": CLASS, "activate": True})
        assert added.status_code == 201, added.text
        yield client, admin, db_url


def row_counts(url: str) -> dict[str, int]:
    """Rows of every ledger table: 'the ledger is unchanged' checked on all of it, not on one total."""
    ledger = Ledger(url)
    try:
        with ledger._write_engine.connect() as conn:
            return {t.name: conn.execute(select(func.count()).select_from(t)).scalar_one() for t in metadata.sorted_tables}
    finally:
        ledger.close()


def step_groups(run_id: str = "run-c", n_steps: int = 4) -> list[list[dict]]:
    groups = make_steps(run_id, n_steps, step_interval_s=0.3, seed=11)
    for group in groups:
        for r in group:
            r["engine_fingerprint"] = CLASS
    return groups


def as_columns(groups) -> dict:
    rows = [r for g in groups for r in g]
    return {name: [r.get(name) for r in rows] for name in rows[0]}


def as_parquet(columns: dict) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue()


def windows_body(client, admin, run_id: str = "run-w") -> dict:
    active = client.get(f"/v1/models/{CLASS}/active", headers=bearer(admin)).json()
    model, version = StepLatencyModel.from_dict(active["model"]), active["version"]
    agg = WindowAggregator(run_id, CLASS, lambda: (model, version), window_s=1.0)
    out = []
    for g in step_groups(run_id, 8):
        slices = [[r["request_id"], r["tenant"], r["num_new_tokens"], r["num_context_tokens"], r["phase"] == "prefill", 0, None] for r in g]
        out += agg.add(g[0]["step_id"], g[0]["timestamp_s"], g[0]["step_latency_s"], slices)
    return {"windows": [w.to_json() for w in out + agg.close()]}


def renamed(d: dict, old: str, new: str) -> dict:
    return {(new if k == old else k): v for k, v in d.items()}


def misspelled_bodies(client, admin):
    """(route, body kwargs, expected detail fragment) for each write route and body form."""
    groups = step_groups()
    fp_typo = [[renamed(r, "engine_fingerprint", "engine_fingerprint_id") for r in g] for g in groups]
    sharing = [[dict(r, num_shared_context_tokenz=0) for r in g] for g in groups]
    columns = as_columns(groups)
    windows = windows_body(client, admin)
    w0 = windows["windows"][0]
    nested = dict(w0, requests=[renamed(w0["requests"][0], "tenant", "tenat"), *w0["requests"][1:]])
    price = {"engine_class": CLASS, "currency": "USD", "engine_hour_price": "2.5", "valid_from": "2026-11-01T00:00:00Z"}
    return [
        ("/v1/steps", {"json": {"steps": fp_typo}}, "unknown field engine_fingerprint_id; did you mean engine_fingerprint?"),
        ("/v1/steps", {"json": {"steps": sharing}}, "unknown field num_shared_context_tokenz; did you mean num_shared_context_tokens?"),
        ("/v1/steps", {"json": {"steps": groups, "stepz": 1}}, "unknown field stepz; did you mean steps?"),
        ("/v1/steps", {"json": {"columns": renamed(columns, "engine_fingerprint", "engine_fingerprint_id")}},
         "unknown column engine_fingerprint_id; did you mean engine_fingerprint?"),
        ("/v1/steps", {"content": as_parquet(renamed(columns, "engine_fingerprint", "engine_fingerprint_id")), "headers": {"Content-Type": PARQUET}},
         "unknown column engine_fingerprint_id; did you mean engine_fingerprint?"),
        ("/v1/steps", {"json": {"steps": [[dict(r, engine_fingerprint="garbage") for r in g] for g in groups]}},
         "engine_fingerprint: expected an engine fingerprint id"),
        ("/v1/windows", {"json": {"windows": [renamed(w0, "model_version", "model_verison")]}},
         "windows[0]: unknown field model_verison; did you mean model_version?"),
        ("/v1/windows", {"json": {"windows": [nested]}}, "windows[0].requests[0]: unknown field tenat; did you mean tenant?"),
        ("/v1/windows", {"json": {**windows, "windowz": []}}, "unknown field windowz; did you mean windows?"),
        ("/v1/models", {"json": {"model": class_model(CLASS).to_dict(), "engine_class": CLASS, "activte": True}},
         "unknown field activte; did you mean activate?"),
        ("/v1/models", {"json": {"model": {**class_model(CLASS).to_dict(), "boundary_new_token": None}}},
         "unknown key boundary_new_token; did you mean boundary_new_tokens?"),
        ("/v1/keys", {"json": {"tenat": "acme"}}, "unknown field tenat; did you mean tenant?"),
        ("/v1/prices", {"json": {"prices": [renamed(price, "engine_hour_price", "engine_hour_prise")]}},
         "unknown field engine_hour_prise; did you mean engine_hour_price?"),
        ("/v1/prices", {"json": {"prices": [price], "pricez": []}}, "unknown field pricez; did you mean prices?"),
    ]


def test_each_write_route_refuses_a_misspelled_field_naming_it_and_stores_nothing(service):
    client, admin, url = service
    cases = misspelled_bodies(client, admin)
    before = row_counts(url)
    for path, kwargs, expected in cases:
        headers = {**bearer(admin), **kwargs.pop("headers", {})}
        answer = client.post(path, headers=headers, **kwargs)
        assert answer.status_code == 422, (path, expected, answer.text)
        assert expected in answer.json()["detail"], (path, answer.json()["detail"])
        assert row_counts(url) == before, (path, expected)
    # the same bodies spelled right are taken: the refusals were for the names, not for the rest
    groups = step_groups()
    assert client.post("/v1/steps", headers=bearer(admin), json={"steps": groups}).status_code == 200
    assert client.post("/v1/windows", headers=bearer(admin), json=windows_body(client, admin)).status_code == 200
    assert client.post("/v1/keys", headers=bearer(admin), json={"tenant": "acme"}).status_code == 201
    assert row_counts(url) != before


# ------------------------------------------------------------------------------------------------------
# Property: one mutated name, type or value of a valid body is refused with a 4xx, and nothing is stored.

ROW_VALUE_MUTATIONS = {
    "step_id": [-1.5, "7", True, 2**70],
    "step_latency_s": [0.0, -0.1, "0.1", None],
    "num_new_tokens": [0, -1, 1.5],
    "num_context_tokens": [-1, "3"],
    "phase": ["sampling", "", 1],
    "tenant": [None, 3, ["t"]],
    "request_id": [None, {"a": 1}],
    "run_id": [None, 5],
    "engine_fingerprint": ["fp0", "0123456789ABCDEF", 7],
    "timestamp_s": ["noon", -5.0, [1]],
}


def mutate_name(name: str, rnd: random.Random) -> str:
    """A near miss of ``name``: a letter dropped, doubled, swapped or replaced, a suffix, or a case change."""
    i = rnd.randrange(len(name))
    choices = [name[:i] + name[i + 1:], name[:i] + name[i] + name[i:], name + "_id", name + "z", name.upper(),
               name[:i] + "x" + name[i + 1:]]
    if i + 1 < len(name):
        choices.append(name[:i] + name[i + 1] + name[i] + name[i + 2:])
    return rnd.choice([c for c in choices if c and c != name])


@st.composite
def mutated_steps(draw):
    groups = step_groups("run-h", draw(st.integers(1, 3)))
    rnd = random.Random(draw(st.integers(0, 2**32)))
    g, r = rnd.randrange(len(groups)), None
    r = rnd.randrange(len(groups[g]))
    row = groups[g][r]
    kind = draw(st.sampled_from(["name", "type", "value"]))
    field = draw(st.sampled_from(sorted(ROW_VALUE_MUTATIONS)))
    if kind == "name":
        groups[g][r] = renamed(row, field, mutate_name(field, rnd))
    elif kind == "type":
        groups[g][r] = dict(row, **{field: draw(st.sampled_from([{"x": 1}, [1, 2]]))})
    else:
        groups[g][r] = dict(row, **{field: draw(st.sampled_from(ROW_VALUE_MUTATIONS[field]))})
    form = draw(st.sampled_from(["rows", "columns"]))
    if form == "columns":
        rows = [x for grp in groups for x in grp]
        names = list(dict.fromkeys(k for x in rows for k in x))
        return json.dumps({"columns": {n: [x.get(n) for x in rows] for n in names}}).encode()
    return json.dumps({"steps": groups}).encode()


@pytest.fixture(scope="module")
def shared_service(model_path, tmp_path_factory):  # noqa: F811
    url = f"sqlite:///{tmp_path_factory.mktemp('contract')}/ledger.db"
    ledger = Ledger(url)
    admin = ledger.create_key(is_admin=True)
    ledger.close()
    with TestClient(create_app(model_path, url)) as client:
        added = client.post("/v1/models", headers=bearer(admin),
                            json={"model": class_model(CLASS).to_dict(), "engine_class": CLASS, "activate": True})
        assert added.status_code == 201, added.text
        yield client, admin, url, windows_body(client, admin, "run-hw")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=mutated_steps())
def test_a_step_body_with_one_mutated_name_type_or_value_is_refused_and_stores_nothing(shared_service, body):
    client, admin, url, _ = shared_service
    before = row_counts(url)
    answer = client.post("/v1/steps", headers={**bearer(admin), "Content-Type": "application/json"}, content=body)
    assert 400 <= answer.status_code < 500, answer.text
    assert row_counts(url) == before


def window_paths(window: dict, prefix=()) -> list[tuple]:
    """Paths to every field of a window, nested request and residual objects included."""
    out = []
    for key, value in window.items():
        out.append((*prefix, key))
        if isinstance(value, dict):
            out += window_paths(value, (*prefix, key))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            out += window_paths(value[0], (*prefix, key, 0))
    return out


def at(obj, path):
    for p in path:
        obj = obj[p]
    return obj


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_window_body_with_one_mutated_name_or_type_is_refused_and_stores_nothing(shared_service, data):
    client, admin, url, windows = shared_service
    body = json.loads(json.dumps(windows))
    k = data.draw(st.integers(0, len(body["windows"]) - 1))
    window = body["windows"][k]
    path = data.draw(st.sampled_from(window_paths(window)))
    parent, key = at(window, path[:-1]), path[-1]
    kind = data.draw(st.sampled_from(["name", "type"]))
    if kind == "name":
        new = mutate_name(key, random.Random(data.draw(st.integers(0, 2**32))))
        parent[new] = parent.pop(key)
    else:
        value = parent[key]
        parent[key] = "not-a-value" if isinstance(value, (list, dict)) else {"x": [value]}
    before = row_counts(url)
    answer = client.post("/v1/windows", headers=bearer(admin), json=body)
    assert 400 <= answer.status_code < 500, (path, kind, answer.text)
    assert row_counts(url) == before
