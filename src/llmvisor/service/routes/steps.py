"""``POST /v1/steps`` (ingest a batch) and ``GET /v1/steps/{run_id}/{step_id}`` (one stored step, for audits)."""

from __future__ import annotations

import logging
import time
from typing import Annotated

import numpy as np
from fastapi import APIRouter, HTTPException, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError

from llmvisor.ledger import DuplicateRunError, Ledger, StepConflictError
from llmvisor.ledger.connection import now_us
from llmvisor.service.config import ServiceSettings
from llmvisor.service.deps import (
    AdminKey,
    IngestKey,
    LedgerDep,
    MetricsDep,
    RegistryDep,
    SettingsDep,
    check_name,
    to_datetime,
)
from llmvisor.service.gaps import GapMonitor
from llmvisor.service.ingest import (
    MAX_STRING_CHARS,
    PARQUET_MEDIA_TYPE,
    PayloadError,
    prepare_batch,
    read_batch,
    step_fingerprint_ids,
)
from llmvisor.service.metrics import ServiceMetrics, kv_gib_seconds_of
from llmvisor.service.registry import ModelRegistry
from llmvisor.service.responses import database_unavailable, error
from llmvisor.service.schemas import (
    STEP_BATCH_SCHEMA,
    IngestResponse,
    SliceShareOut,
    StepOut,
)

INGEST_PATH = "/v1/steps"
MAX_CONFLICTS_LISTED = 1000

router = APIRouter(tags=["steps"])
log = logging.getLogger("llmvisor.service")


def duplicate_run_response(duplicate: DuplicateRunError, metrics: ServiceMetrics) -> JSONResponse:
    """409 for a run re-sent under a new run id, naming the run it repeats (``duplicate_of``)."""
    metrics.count_ingest_error("duplicate_run")
    return JSONResponse(status_code=409, content={"detail": str(duplicate), "run_id": duplicate.run_id,
                                                  "duplicate_of": duplicate.other_run_id})


def is_database_outage(error: DBAPIError) -> bool:
    """An unreachable or busy database (retry) rather than a bug: OperationalError or a dropped connection."""
    return isinstance(error, OperationalError) or error.connection_invalidated


# Batches from several connections run in parallel threads: one can be parsed (pyarrow and numpy release
# the GIL) while another waits on the database, which serialises only the write itself.
def ingest_body(
    body: bytes, content_type: str | None, *, registry: ModelRegistry, ledger: Ledger, metrics: ServiceMetrics, settings: ServiceSettings,
    gaps: GapMonitor | None = None,
) -> IngestResponse:
    started_s = time.perf_counter()
    trace = read_batch(
        body,
        max_steps=settings.max_steps_per_request,
        max_rows=settings.max_rows_per_request,
        max_decoded_bytes=settings.max_body_bytes,
        content_type=content_type,
    )
    if trace.n_steps == 0:
        return IngestResponse(steps_received=0, steps_inserted=0, steps_duplicate=0, slices_inserted=0, attributed_ns=0)
    registry.refresh()
    prepared = prepare_batch(None, trace, received_at_us=now_us(), choose=registry.choose)
    records = prepared.records
    outcome = ledger.ingest(records)
    inserted_steps = np.asarray(outcome.inserted, dtype=bool)
    if gaps is not None and outcome.n_inserted:
        try:
            gaps.observe_runs(records.run_id[inserted_steps].tolist())
        except DBAPIError:  # the steps are stored: answer so; the periodic check reads their gaps again
            log.warning("llmvisor: cannot read the gaps of the runs just stored; the periodic check will", exc_info=True)
    pending = records.pending & inserted_steps
    attributed_steps = inserted_steps & ~records.pending
    inserted_slices = np.repeat(inserted_steps, np.diff(records.step_offsets))
    billed_slices = np.repeat(attributed_steps, np.diff(records.step_offsets))
    attributed_ns = records.attributed_ns[inserted_slices]
    metrics.record_ingest(
        records.tenant[billed_slices],
        records.attributed_ns[billed_slices],
        records.measured_ns[attributed_steps],
        prepared.residual_s[attributed_steps],
        prepared.predicted_step_s[attributed_steps],
        outcome.n_inserted,
        outcome.n_duplicate,
        kv_gib_seconds_of(records, billed_slices),
    )
    metrics.slices_ingested.inc(int(inserted_slices.sum() - billed_slices.sum()))
    if pending.any():
        metrics.pending_steps.inc(int(pending.sum()))
        metrics.pending_measured_seconds.inc(float(records.measured_ns[pending].sum()) / 1e9)
    record_calibration(metrics, registry, trace, prepared, attributed_steps)
    metrics.ingest_batch_seconds.observe(time.perf_counter() - started_s)
    return IngestResponse(
        steps_received=records.n_steps,
        steps_inserted=outcome.n_inserted,
        steps_duplicate=outcome.n_duplicate,
        slices_inserted=int(inserted_slices.sum()),
        attributed_ns=int(attributed_ns.sum()),
        steps_pending=int(pending.sum()),
    )


def record_calibration(metrics: ServiceMetrics, registry: ModelRegistry, trace, prepared, attributed_steps: np.ndarray) -> None:
    """The fingerprint check (each step against the model that attributed it), the per-run and per-class
    residual windows, over the newly stored, attributed steps of a batch."""
    records = prepared.records
    runs = records.run_id[attributed_steps]
    classes = records.engine_class[attributed_steps]
    ids = step_fingerprint_ids(trace)[attributed_steps]
    for engine_class in dict.fromkeys(classes.tolist()):
        mine = classes == engine_class
        model = registry.model_for(engine_class)
        metrics.check_fingerprints(runs[mine], ids[mine], getattr(model, "engine_fingerprint_", None))
    measured_s = records.step_latency_s[attributed_steps]
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = prepared.residual_s[attributed_steps] / measured_s
    metrics.run_residuals.observe(runs, relative)
    metrics.class_drift.observe(classes, relative)


@router.post(
    INGEST_PATH,
    response_model=IngestResponse,
    summary="Ingest a batch of steps",
    description=(
        "Trace rows of whole steps: JSON with one list of rows per step or one list per column, or a trace-format "
        "Parquet file (Content-Type: application/vnd.apache.parquet). Each step is "
        "attributed with the service's model and stored with its slices, the whole batch in one transaction. "
        "Idempotent on (run_id, step_id): an identical re-send (in either form) is acknowledged as a "
        "duplicate; a different one is a 409 naming the steps. A new run whose step 0 (with timestamp_s) has the "
        "content of a stored run's step 0, run id aside, is a re-send under a new run id: 409 naming that run, the "
        "rest of the run refused too. Rows in validation messages are numbered "
        "across the batch (and named steps[i][j] in the row form). The body may be gzip'd (Content-Encoding: gzip), "
        "bounded decoded by the same limit."
    ),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": STEP_BATCH_SCHEMA},
                PARQUET_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
    responses={
        400: {"description": "body is not JSON (or not Parquet, for that content type), or a corrupt gzip stream"},
        409: {"description": "a step was stored before with different content, or the batch's run repeats a stored run "
                            "under a new run id (`duplicate_of` names it)"},
        413: {"description": "body, steps, rows or a Parquet or gzip body's decoded size over the limits"},
        415: {"description": "a Content-Encoding other than gzip (or gzip on a service started with --no-gzip-bodies)"},
        422: {"description": "rows break the trace format"},
        503: {"description": "database unavailable; retry"},
    },
)
async def post_steps(
    request: Request, _principal: IngestKey, registry: RegistryDep, ledger: LedgerDep, metrics: MetricsDep, settings: SettingsDep
):
    try:
        body = await request.body()
        async with request.app.state.ingest_slots:
            return await run_in_threadpool(
                ingest_body, body, request.headers.get("content-type"), registry=registry, ledger=ledger, metrics=metrics, settings=settings,
                gaps=request.app.state.gaps,
            )
    except PayloadError as payload_error:
        metrics.count_ingest_error(payload_error.reason)
        return error(payload_error.status, str(payload_error))
    except StepConflictError as conflict:
        metrics.count_ingest_error("conflict")
        listed = [{"run_id": r, "step_id": s} for r, s in conflict.conflicts[:MAX_CONFLICTS_LISTED]]
        return JSONResponse(status_code=409, content={"detail": str(conflict), "conflicting_steps": listed})
    except DuplicateRunError as duplicate:
        return duplicate_run_response(duplicate, metrics)
    except DBAPIError as database_error:
        if not is_database_outage(database_error):
            raise
        metrics.count_ingest_error("database")
        return database_unavailable()


@router.get(
    "/v1/steps/{run_id}/{step_id}",
    response_model=StepOut,
    summary="One stored step and every slice's share (admin; for audits)",
    responses={404: {"description": "no such step stored"}},
)
def get_step(
    run_id: Annotated[str, Path(max_length=MAX_STRING_CHARS)],
    step_id: Annotated[int, Path(ge=-(2**63), lt=2**63)],
    _principal: AdminKey,
    ledger: LedgerDep,
):
    detail = ledger.step_detail(check_name("run_id", run_id), step_id)
    if detail is None:
        raise HTTPException(404, f"no step {step_id} of run {run_id!r} is stored")
    return StepOut(
        run_id=detail.run_id, step_id=detail.step_id, measured_s=detail.measured_ns / 1e9,
        measured_ns=detail.measured_ns, predicted_s=detail.predicted_s, started_at=to_datetime(detail.timestamp_us),
        engine_class=detail.engine_class, model_version=detail.model_version, pending=detail.pending,
        ingested_at=to_datetime(detail.ingested_at_us), content_sha256=detail.content_sha256.hex(),
        slices=[
            SliceShareOut(request_id=x.request_id, tenant=x.tenant, num_new_tokens=x.num_new_tokens,
                          num_context_tokens=x.num_context_tokens, phase=x.phase,
                          attributed_s=x.attributed_ns / 1e9, attributed_ns=x.attributed_ns, kv_block_ns=x.kv_block_ns)
            for x in detail.slices
        ],
    )
