"""The accounting service: FastAPI over the ledger.

Ingest (``POST /v1/steps``) and key administration need an admin key; usage reads are open to a tenant key
for its own tenant only. Every request a client can get wrong is answered 4xx with one clear line in
``detail``; the database being unreachable or busy is a 503 to retry. `create_app` only builds the state
and wires the routers (`llmvisor.service.routes`) and the `RequestGuard` middleware.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

import llmvisor
from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger
from llmvisor.service.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_INGEST,
    DEFAULT_MAX_ROWS_PER_REQUEST,
    DEFAULT_MAX_SMALL_BODY_BYTES,
    DEFAULT_MAX_STEPS_PER_REQUEST,
    DEFAULT_MAX_TENANT_LABELS,
    ENV_REQUEST_TOTALS,
    ServiceSettings,
)
from llmvisor.service.gaps import DEFAULT_GAP_ALERT_AFTER_S, DEFAULT_GAP_CHECK_INTERVAL_S, GapMonitor
from llmvisor.service.metrics import DriftSettings, ServiceMetrics
from llmvisor.service.middleware import RequestGuard
from llmvisor.service.registry import DEFAULT_REFRESH_S, ModelRegistry
from llmvisor.service.responses import database_unavailable
from llmvisor.service.routes import adjustments, keys, models, operations, page, prices, runs, steps, usage, windows


async def validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 as one line: ``query parameter 'limit': ...``."""
    parts = []
    for item in error.errors():
        if item.get("type") == "unknown_field":  # StrictBody's: the message names the field and the closest known one
            parts.append(f"request body: {item.get('msg')}")
            continue
        where = ".".join(str(p) for p in item.get("loc", ()) if p not in ("query", "body", "path"))
        parts.append(f"{item.get('loc', ('',))[0]} parameter {where!r}: {item.get('msg')}" if where else item.get("msg"))
    return JSONResponse(status_code=422, content={"detail": "; ".join(parts)})


monitor_log = logging.getLogger("llmvisor.service")
ENV_GAP_ALERT_AFTER_S = "LLMVISOR_GAP_ALERT_AFTER_S"
ENV_GAP_CHECK_INTERVAL_S = "LLMVISOR_GAP_CHECK_INTERVAL_S"


def request_totals_setting() -> bool:
    """``LLMVISOR_REQUEST_TOTALS``: keep a row per request of window aggregates (1, the default) or not (0: at fleet
    scale, where a request's usage is read from the raw-step archive; docs/scale.md)."""
    value = os.environ.get(ENV_REQUEST_TOTALS, "1").strip().lower()
    if value not in ("1", "0"):
        raise LlmvisorError(f"{ENV_REQUEST_TOTALS}={value!r}: give 1 or 0")
    return value == "1"


def seconds_setting(value: float | None, env: str, default: float) -> float:
    """An argument, else the environment variable ``env``, else ``default``; a bad value is one clear line."""
    if value is None:
        text = os.environ.get(env)
        if not text:
            return default
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise LlmvisorError(f"{env} must be a positive number of seconds (got {text!r})")
    return float(value)


async def check_gaps_periodically(monitor: GapMonitor, interval_s: float) -> None:
    """Every ``interval_s``: re-read the runs with gaps (metric, and the alert for gaps past the window)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await run_in_threadpool(monitor.refresh)
        except Exception:  # noqa: BLE001 - a database outage must not end the checks
            monitor_log.warning("llmvisor: the periodic gap check failed; retrying in %g s", interval_s, exc_info=True)


async def database_error(_request: Request, _error: OperationalError) -> JSONResponse:
    return database_unavailable()


def create_app(
    model_path: str | Path,
    db_url: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_small_body_bytes: int = DEFAULT_MAX_SMALL_BODY_BYTES,
    max_steps_per_request: int = DEFAULT_MAX_STEPS_PER_REQUEST,
    max_rows_per_request: int = DEFAULT_MAX_ROWS_PER_REQUEST,
    max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS,
    public_metrics: bool = False,
    gzip_bodies: bool = True,
    max_concurrent_ingest: int = DEFAULT_MAX_CONCURRENT_INGEST,
    fallback_model_path: str | Path | None = None,
    drift: DriftSettings | None = None,
    registry_refresh_s: float = DEFAULT_REFRESH_S,
    gap_alert_after_s: float | None = None,
    gap_check_interval_s: float | None = None,
) -> FastAPI:
    """The service for one latency model and one ledger database.

    ``public_metrics`` serves /metrics without a key (it names every tenant and its usage, so by default
    it needs an admin key, which Prometheus sends with ``authorization: {credentials: ...}``).
    ``max_tenant_labels`` caps the tenants named in /metrics; the rest are counted as ``tenant="other"``.
    ``gzip_bodies=False`` answers a gzip body (``Content-Encoding: gzip``) with 415 (`RequestGuard`).
    The model at ``model_path`` attributes the engine class it was fitted on while the registry has no active
    version of it, and steps without a fingerprint; the one at ``fallback_model_path``, if given, every other
    class without a model (warned once per class); else their steps are stored pending
    (`llmvisor.service.registry`).
    A gap in a run's step ids still open ``gap_alert_after_s`` after a later step arrived is logged as lost
    (default ``LLMVISOR_GAP_ALERT_AFTER_S`` or 600 s); all runs are checked every ``gap_check_interval_s``
    (``LLMVISOR_GAP_CHECK_INTERVAL_S`` or 30 s).
    """
    gap_alert_after_s = seconds_setting(gap_alert_after_s, ENV_GAP_ALERT_AFTER_S, DEFAULT_GAP_ALERT_AFTER_S)
    gap_check_interval_s = seconds_setting(gap_check_interval_s, ENV_GAP_CHECK_INTERVAL_S, DEFAULT_GAP_CHECK_INTERVAL_S)
    settings = ServiceSettings(
        max_body_bytes=max_body_bytes,
        max_small_body_bytes=max_small_body_bytes,
        max_steps_per_request=max_steps_per_request,
        max_rows_per_request=max_rows_per_request,
        max_tenant_labels=max_tenant_labels,
        public_metrics=public_metrics,
        gzip_bodies=gzip_bodies,
        max_concurrent_ingest=max_concurrent_ingest,
    )
    model = StepLatencyModel.from_json(model_path)
    ledger = Ledger(db_url, request_totals=request_totals_setting())
    metrics = ServiceMetrics(max_tenant_labels=max_tenant_labels, drift=drift)
    fallback = StepLatencyModel.from_json(fallback_model_path) if fallback_model_path is not None else None
    registry = ModelRegistry(ledger, model, fallback_model=fallback, refresh_s=registry_refresh_s, metrics=metrics)

    gaps = GapMonitor(ledger, alert_after_s=gap_alert_after_s)
    metrics.registry.register(gaps)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        checker = asyncio.create_task(check_gaps_periodically(gaps, gap_check_interval_s))
        try:
            yield
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checker
            ledger.close()

    app = FastAPI(
        title="llmvisor accounting service",
        version=llmvisor.__version__,
        description="Per-tenant ledger of attributed LLM engine time. See docs/service.md.",
        lifespan=lifespan,
    )
    app.state.ledger = ledger
    app.state.model = model
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.gaps = gaps
    app.state.settings = settings
    app.state.ingest_slots = asyncio.Semaphore(max_concurrent_ingest)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(OperationalError, database_error)
    app.add_middleware(RequestGuard, ledger=ledger, metrics=metrics, settings=settings)
    for router in (steps.router, usage.router, adjustments.router, keys.router, models.router, operations.router, runs.router,
                   windows.router, prices.router, page.router):
        app.include_router(router)
    return app
