"""Fixtures shared by the ledger and service tests: a fitted model file, real databases, keys, step rows, and
steps and models of an engine class (the registry and dashboard tests).

PostgreSQL runs where LLMVISOR_TEST_POSTGRES_URL is set (`scripts/start-postgres.sh` prints one);
each test then starts from empty tables, so the database must be a throwaway one (its name must contain "test").
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
from sqlalchemy.engine import make_url

from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.ledger import Ledger
from llmvisor.ledger.schema import metadata

POSTGRES_URL = os.environ.get("LLMVISOR_TEST_POSTGRES_URL")
BACKENDS = [
    "sqlite",
    pytest.param(
        "postgresql",
        marks=[
            pytest.mark.postgres,
            pytest.mark.skipif(not POSTGRES_URL, reason="LLMVISOR_TEST_POSTGRES_URL not set (scripts/start-postgres.sh)"),
        ],
    ),
]
T0_S = 1_750_000_000.0


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "model.json"
    StepLatencyModel().fit(synthetic_trace(2000)).to_json(path)
    return path


_WORKER_DATABASES: set[str] = set()
"""This worker's databases already created."""


def worker_database(url: str) -> str:
    """The database of this pytest-xdist worker on the server ``url`` names (created on first use), so that workers
    running at once never wipe each other's tables; ``url`` itself outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return url
    parsed = make_url(url)
    name = f"{parsed.database}_{worker}"
    if name not in _WORKER_DATABASES:
        import psycopg

        with psycopg.connect(parsed.set(drivername="postgresql").render_as_string(hide_password=False), autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{name}"')
        _WORKER_DATABASES.add(name)
    return parsed.set(database=name).render_as_string(hide_password=False)


def empty_postgres(url: str) -> str:
    """Drop the ledger's tables (in this xdist worker's own database): only in a database whose name says it is for
    tests. Returns the URL the test is to use."""
    database = make_url(url).database or ""
    if "test" not in database:
        pytest.fail(f"LLMVISOR_TEST_POSTGRES_URL names database {database!r}; the tests wipe it, so its name must contain 'test'")
    url = worker_database(url)
    ledger = Ledger(url)
    metadata.drop_all(ledger._write_engine)
    ledger.close()
    return url


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.db"
    return empty_postgres(POSTGRES_URL)


@pytest.fixture
def ledger(db_url):
    store = Ledger(db_url)
    yield store
    store.close()


@pytest.fixture
def admin(db_url):
    """An admin key of the test's ledger, made before the service under test opens it."""
    ledger = Ledger(db_url)
    key = ledger.create_key(is_admin=True)
    ledger.close()
    return key


@pytest.fixture
def keys(ledger):
    return {
        "admin": ledger.create_key(is_admin=True),
        "tenant-0": ledger.create_key("tenant-0"),
        "tenant-1": ledger.create_key("tenant-1"),
    }


def make_steps(
    run_id: str = "run-a",
    n_steps: int = 20,
    *,
    first_step: int = 0,
    batch_size: int = 8,
    n_tenants: int = 3,
    start_s: float = T0_S,
    step_interval_s: float = 1.0,
    seed: int = 0,
) -> list[list[dict]]:
    """Steps of random composition as the body groups of POST /v1/steps."""
    rng = np.random.default_rng(seed)
    groups = []
    for step in range(first_step, first_step + n_steps):
        size = int(rng.integers(1, batch_size + 1))
        prefill = rng.random(size) < 0.2
        rows = []
        for slot in range(size):
            rows.append(
                {
                    "run_id": run_id,
                    "step_id": step,
                    "step_latency_s": round(float(rng.uniform(0.005, 0.2)), 6),
                    "request_id": f"req-{slot}",
                    "tenant": f"tenant-{slot % n_tenants}",
                    "num_new_tokens": int(rng.integers(1, 300)) if prefill[slot] else 1,
                    "num_context_tokens": int(rng.integers(0, 2000)),
                    "phase": "prefill" if prefill[slot] else "decode",
                    "timestamp_s": start_s + step * step_interval_s,
                }
            )
        latency = rows[0]["step_latency_s"]
        for row in rows:
            row["step_latency_s"] = latency
        groups.append(rows)
    return groups


def measured_ns(groups: list[list[dict]]) -> int:
    return sum(int(round(group[0]["step_latency_s"] * 1e9)) for group in groups)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


_CLASS_FITS: dict[tuple, StepLatencyModel] = {}
"""`class_model`'s fits in this test process, by (coefficients, seed): the fit is deterministic."""


def class_model(engine_class: str, *, coef_s: dict | None = None, seed: int = 0) -> StepLatencyModel:
    """A model fitted on synthetic steps of ``coef_s``, registered as the model of ``engine_class``. Each call gets
    its own copy of one fit per (coefficients, seed) in the process: a fit of 1,500 steps takes 0.5-1.5 s, and
    tests/test_billing.py's fixture alone asks for three per test (the same three each time)."""
    key = (tuple(sorted((coef_s or {}).items())), seed)
    if key not in _CLASS_FITS:
        _CLASS_FITS[key] = StepLatencyModel().fit(synthetic_trace(1500, coef_s=coef_s, seed=seed, max_batch_size=16))
    model = copy.deepcopy(_CLASS_FITS[key])
    model.engine_fingerprint_ = {"id": engine_class}
    return model


def class_body(engine_class: str, n_steps: int, *, run_id: str, seed: int, slowdown: float = 1.0,
               first_timestamp_s: float = T0_S, coef_s: dict | None = None, shared_prefix_fraction: float = 0.0,
               cached_prompt: bool = False) -> dict:
    """Synthetic steps of a known engine (``coef_s``) of ``engine_class`` as a POST /v1/steps body (columns), times
    scaled by ``slowdown``; with ``shared_prefix_fraction`` > 0 they carry the sharing columns (format v2); with
    ``cached_prompt`` the ``num_cached_prompt_tokens`` fact as the recorder writes it: a request's first slice's
    context (what it found in the KV cache when first scheduled), 0 on its other slices."""
    trace = synthetic_trace(n_steps, coef_s=coef_s, seed=seed, run_id=run_id, max_batch_size=16, shared_prefix_fraction=shared_prefix_fraction)
    columns = trace.to_arrow().to_pydict()
    names = ["run_id", "step_id", "request_id", "tenant", "num_new_tokens", "num_context_tokens", "phase"]
    if trace.has_sharing_columns:
        names += ["num_shared_context_tokens", "effective_context_tokens"]
    kept = {name: columns[name] for name in names}
    kept["step_latency_s"] = [float(t) * slowdown for t in trace.step_latency_s]
    kept["engine_fingerprint"] = [engine_class] * trace.n_slices
    kept["timestamp_s"] = [first_timestamp_s + 0.05 * int(s) for s in trace.step_id]
    if cached_prompt:
        seen: set[str] = set()
        cached = []
        for request_id, context, phase in zip(kept["request_id"], kept["num_context_tokens"], kept["phase"]):
            cached.append(int(context) if request_id not in seen and phase == "prefill" else 0)
            seen.add(request_id)
        kept["num_cached_prompt_tokens"] = cached
    return {"columns": kept}
