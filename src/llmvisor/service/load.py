"""Sustained ingest throughput of the service on loopback, bounded in steps and time: the measurement of
``llmvisor load`` (the command itself is `llmvisor.cli.load`).

Request bodies are built once from a template (a fresh run id per request), so the figure is the
server's: parsing, validation, attribution, hashing and the database, not the load generator's encoding.
The run id is swapped by a byte replacement of equal length, which leaves a Parquet body a valid file too
(its run_id column is stored uncompressed, without page checksums).
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from llmvisor.client.push import columns_body
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.synthetic import synthetic_trace
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.service.ingest import PARQUET_MEDIA_TYPE
from llmvisor.service.process import ServerProcess

_RUN_PLACEHOLDER = "__LLMVISOR_LOAD_RUN_ID__"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
BODY_FORMS = {"columns": "application/json", "rows": "application/json", "parquet": PARQUET_MEDIA_TYPE}


def _run_id(tag: str, index: int | str) -> str:
    run_id = f"load-{tag}-{index:>07}"
    if len(run_id) != len(_RUN_PLACEHOLDER):
        raise AssertionError("a load run id must be as long as its placeholder")
    return run_id


@dataclass
class LoadResult:
    target: str
    database: str
    steps: int
    slices: int
    elapsed_s: float
    requests: int
    errors: int
    reconciled: bool | None

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "database": self.database,
            "steps": self.steps,
            "slices": self.slices,
            "elapsed_s": self.elapsed_s,
            "steps_per_s": self.steps_per_s,
            "slices_per_s": self.slices / self.elapsed_s if self.elapsed_s > 0 else 0.0,
            "requests": self.requests,
            "failed_posts": self.errors,
            "reconciled": self.reconciled,
        }

    def line(self, batch_size: int, steps_per_request: int, concurrency: int, body: str, step_interval_ms: float) -> str:
        reconciled = {True: "totals reconcile", False: "TOTALS DO NOT RECONCILE", None: "totals not checked"}[self.reconciled]
        return (
            f"{self.target}: {self.steps:,} steps (B={batch_size}) in {self.elapsed_s:.1f} s = "
            f"{self.steps_per_s:,.0f} steps/s ({self.slices / self.elapsed_s:,.0f} slices/s); "
            f"{steps_per_request} steps per POST in the {body} form, steps {step_interval_ms:g} ms apart, {concurrency} connections, "
            f"{self.errors} failed POSTs; {reconciled}"
        )


def step_batch_template(
    steps_per_request: int,
    batch_size: int,
    *,
    body: str = "columns",
    step_interval_s: float = 0.02,
    n_tenants: int = 8,
    seed: int = 0,
) -> bytes:
    """A POST /v1/steps body (``body``: "columns", "rows" or "parquet") of decode steps over a set of
    running requests, one in ten steps with a prefill, ``step_interval_s`` apart (the ledger keeps a row per
    request per second, so steps further apart cost it more rows)."""
    rng = np.random.default_rng(seed)
    start_s = time.time()
    context = rng.integers(64, 4096, size=batch_size)
    tenants = [f"tenant-{i % n_tenants}" for i in range(batch_size)]
    groups = []
    for step in range(steps_per_request):
        prefill_slot = int(rng.integers(batch_size)) if step % 10 == 0 else -1
        latency_s = round(0.012 + 2e-7 * float(context.sum()) / batch_size + (0.03 if prefill_slot >= 0 else 0.0), 6)
        rows = []
        for slot in range(batch_size):
            prefill = slot == prefill_slot
            rows.append(
                {
                    "run_id": _RUN_PLACEHOLDER,
                    "step_id": step,
                    "step_latency_s": latency_s,
                    # the run id in the request ids: every run's content is its own (the same content under
                    # another run id is a re-send, refused by the service)
                    "request_id": f"{_RUN_PLACEHOLDER}-{slot}-{step // 200}",
                    "tenant": tenants[slot],
                    "num_new_tokens": 256 if prefill else 1,
                    "num_context_tokens": int(context[slot]),
                    "phase": "prefill" if prefill else "decode",
                    "timestamp_s": round(start_s + step * step_interval_s, 6),
                }
            )
        context += 1
        groups.append(rows)
    if body == "columns":
        return columns_body(groups)
    if body == "parquet":
        sink = pa.BufferOutputStream()
        table = pa.Table.from_pylist([row for rows in groups for row in rows])
        compression = {name: "none" if name in ("run_id", "request_id") else "zstd" for name in table.column_names}
        pq.write_table(table, sink, compression=compression, write_page_checksum=False)
        return sink.getvalue().to_pybytes()
    return json.dumps({"steps": groups}, separators=(",", ":")).encode()


def run_load(
    url: str,
    api_key: str,
    *,
    target: str,
    database: str,
    total_steps: int,
    batch_size: int,
    steps_per_request: int,
    concurrency: int,
    max_seconds: float,
    body: str = "columns",
    step_interval_s: float = 0.02,
) -> LoadResult:
    """POST pre-built batches from ``concurrency`` threads until ``total_steps`` or ``max_seconds``."""
    template = step_batch_template(steps_per_request, batch_size, body=body, step_interval_s=step_interval_s)
    n_requests = max(1, total_steps // steps_per_request)
    tag = uuid.uuid4().hex[:11]
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": BODY_FORMS[body]}
    next_index = iter(range(n_requests))
    index_lock = threading.Lock()
    done = {"steps": 0, "requests": 0, "errors": 0}
    done_lock = threading.Lock()

    with httpx.Client(base_url=url, headers=headers, timeout=120.0) as warm:
        response = warm.post("/v1/steps", content=template.replace(_RUN_PLACEHOLDER.encode(), _run_id(tag, "warmup").encode()))
        if response.status_code != 200:
            raise LlmvisorError(f"{url}: warm-up batch answered {response.status_code}: {response.text[:300]}")

    deadline = time.monotonic() + max_seconds

    def worker() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=120.0) as client:
            while time.monotonic() < deadline:
                with index_lock:
                    i = next(next_index, None)
                if i is None:
                    return
                content = template.replace(_RUN_PLACEHOLDER.encode(), _run_id(tag, i).encode())
                try:
                    response = client.post("/v1/steps", content=content)
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                with done_lock:
                    if ok:
                        done["steps"] += response.json()["steps_inserted"]
                        done["requests"] += 1
                    else:
                        done["errors"] += 1

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed_s = time.perf_counter() - started

    reconciled = None
    with httpx.Client(base_url=url, headers=headers, timeout=60.0) as client:
        response = client.get("/v1/usage/totals")
        if response.status_code == 200:
            totals = response.json()
            reconciled = totals["attributed_ns"] == totals["measured_ns"]
    return LoadResult(target, database, done["steps"], done["steps"] * batch_size, elapsed_s, done["requests"], done["errors"], reconciled)


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host not in _LOOPBACK_HOSTS and not host.startswith("127."):
        raise LlmvisorError(f"{url}: the load command only targets loopback addresses (127.0.0.0/8, localhost, ::1)")


def load_targets(
    db_targets: list[str],
    *,
    url: str | None = None,
    api_key: str | None = None,
    model_path: Path | None = None,
    total_steps: int,
    batch_size: int,
    steps_per_request: int,
    concurrency: int,
    max_seconds: float,
    body: str = "parquet",
    step_interval_s: float = 0.02,
) -> list[LoadResult]:
    """Run the load against a running service at ``url`` (loopback only), or against a server started on a
    loopback port for each of ``db_targets`` ('sqlite' for a temporary file, or a scratch database URL)."""
    if body not in BODY_FORMS:
        raise LlmvisorError(f"--body {body!r}: choose {', '.join(BODY_FORMS)}")
    options = dict(total_steps=total_steps, batch_size=batch_size, steps_per_request=steps_per_request,
                   step_interval_s=step_interval_s, concurrency=concurrency, max_seconds=max_seconds, body=body)
    if url is not None:
        check_loopback(url)
        if not api_key:
            raise LlmvisorError("--url needs --api-key (an admin key)")
        return [run_load(url, api_key, target=url, database="unknown", **options)]
    results = []
    with tempfile.TemporaryDirectory(prefix="llmvisor-load-") as scratch:
        if model_path is None:
            model_path = Path(scratch) / "model.json"
            StepLatencyModel().fit(synthetic_trace(2000)).to_json(model_path)
        for target in db_targets or ["sqlite"]:
            db_url = f"sqlite:///{scratch}/ledger-{uuid.uuid4().hex[:8]}.db" if target == "sqlite" else target
            ledger = Ledger(db_url)
            try:
                key = ledger.create_key(is_admin=True)
            finally:
                ledger.close()
            with ServerProcess(model_path, db_url, log_path=Path(scratch) / "server.log") as server:
                results.append(run_load(server.url, key, target=f"{ledger.backend} ({ledger.safe_url})", database=ledger.backend, **options))
    return results
