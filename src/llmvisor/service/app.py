"""The accounting service: FastAPI over the ledger.

Ingest (``POST /v1/steps``) and key administration need an admin key; usage reads are open to a tenant key
for its own tenant only. Every request a client can get wrong is answered 4xx with one clear line in
``detail``; the database being unreachable or busy is a 503 to retry.
"""


import math
import time
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Path as PathParam, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import DBAPIError, OperationalError

import llmvisor
from llmvisor.ledger import Ledger, Principal, StepConflictError
from llmvisor.ledger.schema import USAGE_RESOLUTION_US
from llmvisor.ledger.store import now_us
from llmvisor.core.model import StepLatencyModel
from llmvisor.service.ingest import (
    MAX_STRING_CHARS,
    MAX_TIMESTAMP_S,
    PARQUET_MEDIA_TYPE,
    PayloadError,
    prepare_batch,
    read_batch,
)
from llmvisor.service.metrics import ServiceMetrics

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_STEPS_PER_REQUEST = 20_000
DEFAULT_MAX_ROWS_PER_REQUEST = 1_000_000
_MAX_CONFLICTS_LISTED = 1000


# ---------------------------------------------------------------------------------------------------------
# Schemas (for validation of small inputs and for the OpenAPI document)


class TraceRow(BaseModel):
    """One request slice of one step, as in the step-trace format v1 (`docs/trace-format.md`)."""

    model_config = ConfigDict(extra="allow")
    run_id: str
    step_id: int
    step_latency_s: float = Field(gt=0)
    request_id: str
    tenant: str
    num_new_tokens: int = Field(ge=1)
    num_context_tokens: int = Field(ge=0)
    phase: Literal["prefill", "decode"]
    timestamp_s: float | None = Field(None, ge=0, description="step start, Unix seconds; else the time received")


_ROW_SCHEMA = TraceRow.model_json_schema()
STEP_BATCH_SCHEMA = {
    "oneOf": [
        {
            "title": "StepsAsRows",
            "type": "object",
            "required": ["steps"],
            "properties": {
                "steps": {
                    "type": "array",
                    "description": "One list per step holding all of that step's rows.",
                    "items": {"type": "array", "minItems": 1, "items": _ROW_SCHEMA},
                }
            },
        },
        {
            "title": "StepsAsColumns",
            "type": "object",
            "required": ["columns"],
            "properties": {
                "columns": {
                    "type": "object",
                    "description": "The rows of whole steps, one list per column, all of one length (cheaper to validate).",
                    "required": _ROW_SCHEMA["required"],
                    "properties": {
                        name: {"type": "array", "items": {k: v for k, v in prop.items() if k != "title"}}
                        for name, prop in _ROW_SCHEMA["properties"].items()
                    },
                }
            },
        },
    ]
}


class IngestResponse(BaseModel):
    steps_received: int
    steps_inserted: int
    steps_duplicate: int = Field(description="already stored with identical content: acknowledged, not counted again")
    slices_inserted: int
    attributed_ns: int = Field(description="seconds newly attributed by this batch, in integer nanoseconds")


class BucketUsage(BaseModel):
    start: datetime
    attributed_s: float
    attributed_ns: int
    num_slices: int
    num_new_tokens: int


class TenantUsage(BaseModel):
    tenant: str
    attributed_s: float
    attributed_ns: int = Field(description="exact total; attributed_s is this divided by 1e9")
    num_slices: int
    num_new_tokens: int
    buckets: list[BucketUsage] | None = None


class TenantUsageResponse(BaseModel):
    start: datetime | None
    end: datetime | None
    bucket: str | None
    tenants: list[TenantUsage]


class RequestUsage(BaseModel):
    run_id: str
    request_id: str
    tenant: str
    attributed_s: float
    attributed_ns: int
    num_steps: int
    num_new_tokens: int
    first_step_at: datetime
    last_step_at: datetime


class RequestUsageResponse(BaseModel):
    start: datetime | None
    end: datetime | None
    requests: list[RequestUsage]


class TopResponse(BaseModel):
    start: datetime | None
    end: datetime | None
    tenants: list[TenantUsage]


class TotalsResponse(BaseModel):
    start: datetime | None
    end: datetime | None
    num_steps: int
    measured_s: float
    measured_ns: int
    num_slices: int
    attributed_s: float
    attributed_ns: int = Field(description="equals measured_ns: every measured nanosecond is billed once")


class SliceShareOut(BaseModel):
    request_id: str
    tenant: str
    num_new_tokens: int
    num_context_tokens: int
    phase: str
    attributed_s: float
    attributed_ns: int


class StepOut(BaseModel):
    run_id: str
    step_id: int
    measured_s: float
    measured_ns: int
    predicted_s: float = Field(description="the model's prediction of the whole step")
    started_at: datetime
    ingested_at: datetime
    content_sha256: str = Field(description="hex digest of the step's canonical content (idempotency key)")
    slices: list[SliceShareOut] = Field(description="by request id; attributed_ns sum to measured_ns")


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str | None = Field(None, min_length=1, max_length=MAX_STRING_CHARS)
    admin: bool = False


class KeyCreated(BaseModel):
    key: str = Field(description="shown once; only a hash is stored")
    key_id: str
    tenant: str | None
    is_admin: bool


class KeyDescription(BaseModel):
    key_id: str
    tenant: str | None
    is_admin: bool
    created_at: datetime
    revoked_at: datetime | None


class WhoAmI(BaseModel):
    key_id: str
    tenant: str | None
    is_admin: bool


# ---------------------------------------------------------------------------------------------------------
# Helpers


def _to_datetime(us: int) -> datetime:
    return datetime.fromtimestamp(us / 1e6, tz=timezone.utc)


def parse_time_us(name: str, value: str | None) -> int | None:
    """A query time as integer µs since the epoch: ISO 8601 (naive means UTC) or Unix seconds."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        # An unescaped "+" in a URL arrives as a space: "...T15:00:00 00:00" means "+00:00".
        candidates = [value] + ([value[::-1].replace(" ", "+", 1)[::-1]] if " " in value.strip() else [])
        for candidate in candidates:
            try:
                moment = datetime.fromisoformat(candidate.strip())
                break
            except ValueError:
                continue
        else:
            raise HTTPException(422, f"{name}: expected an ISO 8601 time or Unix seconds, got {value!r}")
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        seconds = moment.timestamp()
    if not math.isfinite(seconds) or not 0 <= seconds < MAX_TIMESTAMP_S:
        raise HTTPException(422, f"{name}: {value!r} is out of range (Unix seconds from 0 to {MAX_TIMESTAMP_S:g})")
    return int(round(seconds * 1e6))


def _time_range(start: str | None, end: str | None) -> tuple[int | None, int | None]:
    start_us, end_us = parse_time_us("start", start), parse_time_us("end", end)
    for name, value, us in (("start", start, start_us), ("end", end, end_us)):
        if us is not None and us % USAGE_RESOLUTION_US:
            raise HTTPException(422, f"{name}: usage is kept per second; give a whole second, not {value!r}")
    if start_us is not None and end_us is not None and end_us <= start_us:
        raise HTTPException(422, "end must be after start")
    return start_us, end_us


def _check_name(name: str, value: str | None) -> str | None:
    if value is not None and "\x00" in value:
        raise HTTPException(422, f"{name}: must not contain NUL characters")
    return value


def _scoped_tenant(principal: Principal, tenant: str | None) -> str | None:
    """The tenant a read is limited to: a tenant key reads its own tenant and nothing else."""
    if principal.is_admin:
        return tenant
    if tenant is not None and tenant != principal.tenant:
        raise HTTPException(403, "this key reads its own tenant's usage only")
    return principal.tenant


TimeParam = Annotated[str | None, Query(description="ISO 8601 time or Unix seconds, a whole second; inclusive")]
EndParam = Annotated[str | None, Query(description="ISO 8601 time or Unix seconds, a whole second; exclusive")]
NameParam = Annotated[str | None, Query(max_length=MAX_STRING_CHARS)]


def create_app(
    model_path: str | Path,
    db_url: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_steps_per_request: int = DEFAULT_MAX_STEPS_PER_REQUEST,
    max_rows_per_request: int = DEFAULT_MAX_ROWS_PER_REQUEST,
    public_metrics: bool = False,
) -> FastAPI:
    """The service for one latency model and one ledger database.

    ``public_metrics`` serves /metrics without a key (it names every tenant and its usage, so by default
    it needs an admin key, which Prometheus sends with ``authorization: {credentials: ...}``).
    """
    model = StepLatencyModel.from_json(model_path)
    ledger = Ledger(db_url)
    metrics = ServiceMetrics()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        ledger.close()

    app = FastAPI(
        title="llmvisor accounting service",
        version=llmvisor.__version__,
        description="Per-tenant ledger of attributed LLM engine time. See docs/service.md.",
        lifespan=lifespan,
    )
    app.state.ledger = ledger
    app.state.model = model
    app.state.metrics = metrics

    bearer = HTTPBearer(auto_error=False, description="an llmvisor API key (`llmvisor keys create`)")

    def _principal(credentials: HTTPAuthorizationCredentials | None) -> Principal | None:
        if credentials is None:
            return None
        try:
            return ledger.authenticate(credentials.credentials)
        except OperationalError:
            raise HTTPException(503, "database unavailable; retry", headers={"Retry-After": "1"}) from None

    def _unauthorized() -> HTTPException:
        return HTTPException(401, "missing or invalid API key (Authorization: Bearer <key>)", headers={"WWW-Authenticate": "Bearer"})

    def any_key(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
        principal = _principal(credentials)
        if principal is None:
            raise _unauthorized()
        return principal

    def admin_key(principal: Annotated[Principal, Depends(any_key)]) -> Principal:
        if not principal.is_admin:
            raise HTTPException(403, "this needs an admin key")
        return principal

    def ingest_key(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
        principal = _principal(credentials)
        if principal is None:
            metrics.ingest_errors.labels("unauthorized").inc()
            raise _unauthorized()
        if not principal.is_admin:
            metrics.ingest_errors.labels("forbidden").inc()
            raise HTTPException(403, "ingest needs an admin key")
        return principal

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
        parts = []
        for item in error.errors():
            where = ".".join(str(p) for p in item.get("loc", ()) if p not in ("query", "body", "path"))
            parts.append(f"{item.get('loc', ('',))[0]} parameter {where!r}: {item.get('msg')}" if where else item.get("msg"))
        return JSONResponse(status_code=422, content={"detail": "; ".join(parts)})

    @app.exception_handler(OperationalError)
    async def _database_unavailable(_request: Request, _error: OperationalError) -> JSONResponse:
        return JSONResponse(status_code=503, content={"detail": "database unavailable; retry"}, headers={"Retry-After": "1"})

    # -----------------------------------------------------------------------------------------------------
    # Ingest

    async def _read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise PayloadError(400, "bad_json", "Content-Length is not a number")
            if int(declared) > max_body_bytes:
                raise PayloadError(413, "too_large", f"request body of {declared} bytes, at most {max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise PayloadError(413, "too_large", f"request body over {max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    # Batches from several connections run in parallel threads: one can be parsed (pyarrow and numpy release
    # the GIL) while another waits on the database, which serialises only the write itself.
    def _ingest(body: bytes, content_type: str | None) -> IngestResponse:
        started_s = time.perf_counter()
        trace = read_batch(body, max_steps=max_steps_per_request, max_rows=max_rows_per_request, content_type=content_type)
        if trace.n_steps == 0:
            return IngestResponse(steps_received=0, steps_inserted=0, steps_duplicate=0, slices_inserted=0, attributed_ns=0)
        prepared = prepare_batch(model, trace, received_at_us=now_us())
        records = prepared.records
        outcome = ledger.ingest(records)
        inserted_steps = np.asarray(outcome.inserted, dtype=bool)
        inserted_slices = np.repeat(inserted_steps, np.diff(records.step_offsets))
        attributed_ns = records.attributed_ns[inserted_slices]
        metrics.record_ingest(
            records.tenant[inserted_slices],
            attributed_ns,
            records.measured_ns[inserted_steps],
            prepared.residual_s[inserted_steps],
            prepared.predicted_step_s[inserted_steps],
            outcome.n_inserted,
            outcome.n_duplicate,
        )
        metrics.ingest_batch_seconds.observe(time.perf_counter() - started_s)
        return IngestResponse(
            steps_received=records.n_steps,
            steps_inserted=outcome.n_inserted,
            steps_duplicate=outcome.n_duplicate,
            slices_inserted=int(inserted_slices.sum()),
            attributed_ns=int(attributed_ns.sum()),
        )

    @app.post(
        "/v1/steps",
        response_model=IngestResponse,
        summary="Ingest a batch of steps",
        description=(
            "Trace rows of whole steps: JSON with one list of rows per step or one list per column, or a trace-format "
            "Parquet file (Content-Type: application/vnd.apache.parquet). Each step is "
            "attributed with the service's model and stored with its slices, the whole batch in one transaction. "
            "Idempotent on (run_id, step_id): an identical re-send (in either form) is acknowledged as a "
            "duplicate; a different one is a 409 naming the steps. Rows in validation messages are numbered "
            "across the batch (and named steps[i][j] in the row form)."
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
            400: {"description": "body is not JSON (or not Parquet, for that content type)"},
            409: {"description": "a step was stored before with different content"},
            413: {"description": "body, steps or rows over the limits"},
            422: {"description": "rows break the trace format"},
            503: {"description": "database unavailable; retry"},
        },
    )
    async def post_steps(request: Request, _principal: Annotated[Principal, Depends(ingest_key)]):
        try:
            body = await _read_body(request)
            return await run_in_threadpool(_ingest, body, request.headers.get("content-type"))
        except PayloadError as error:
            metrics.ingest_errors.labels(error.reason).inc()
            return JSONResponse(status_code=error.status, content={"detail": str(error)})
        except StepConflictError as error:
            metrics.ingest_errors.labels("conflict").inc()
            listed = [{"run_id": r, "step_id": s} for r, s in error.conflicts[:_MAX_CONFLICTS_LISTED]]
            return JSONResponse(status_code=409, content={"detail": str(error), "conflicting_steps": listed})
        except (OperationalError, DBAPIError) as error:
            if isinstance(error, DBAPIError) and not (isinstance(error, OperationalError) or error.connection_invalidated):
                raise
            metrics.ingest_errors.labels("database").inc()
            return JSONResponse(status_code=503, content={"detail": "database unavailable; retry"}, headers={"Retry-After": "1"})

    @app.get(
        "/v1/steps/{run_id}/{step_id}",
        response_model=StepOut,
        summary="One stored step and every slice's share (admin; for audits)",
        responses={404: {"description": "no such step stored"}},
    )
    def get_step(
        run_id: Annotated[str, PathParam(max_length=MAX_STRING_CHARS)],
        step_id: Annotated[int, PathParam(ge=-(2**63), lt=2**63)],
        _principal: Annotated[Principal, Depends(admin_key)],
    ):
        detail = ledger.step_detail(_check_name("run_id", run_id), step_id)
        if detail is None:
            raise HTTPException(404, f"no step {step_id} of run {run_id!r} is stored")
        return StepOut(
            run_id=detail.run_id, step_id=detail.step_id, measured_s=detail.measured_ns / 1e9,
            measured_ns=detail.measured_ns, predicted_s=detail.predicted_s, started_at=_to_datetime(detail.timestamp_us),
            ingested_at=_to_datetime(detail.ingested_at_us), content_sha256=detail.content_sha256.hex(),
            slices=[
                SliceShareOut(request_id=x.request_id, tenant=x.tenant, num_new_tokens=x.num_new_tokens,
                              num_context_tokens=x.num_context_tokens, phase=x.phase,
                              attributed_s=x.attributed_ns / 1e9, attributed_ns=x.attributed_ns)
                for x in detail.slices
            ],
        )

    # -----------------------------------------------------------------------------------------------------
    # Usage

    def _tenant_usage(rows) -> list[TenantUsage]:
        return [
            TenantUsage(tenant=r.tenant, attributed_s=r.attributed_ns / 1e9, attributed_ns=r.attributed_ns,
                        num_slices=r.num_slices, num_new_tokens=r.num_new_tokens)
            for r in rows
        ]

    @app.get("/v1/usage/tenants", response_model=TenantUsageResponse, summary="Attributed time per tenant")
    def usage_tenants(
        principal: Annotated[Principal, Depends(any_key)],
        start: TimeParam = None,
        end: EndParam = None,
        bucket: Annotated[Literal["minute", "hour", "day"] | None, Query(description="UTC buckets")] = None,
        tenant: NameParam = None,
    ):
        start_us, end_us = _time_range(start, end)
        scoped = _scoped_tenant(principal, _check_name("tenant", tenant))
        rows = ledger.tenant_usage(start_us, end_us, bucket, scoped)
        if bucket is None:
            tenants = _tenant_usage(rows)
        else:
            by_tenant: dict[str, list] = {}
            for row in rows:
                by_tenant.setdefault(row.tenant, []).append(row)
            tenants = []
            for name, tenant_rows in by_tenant.items():
                total_ns = sum(r.attributed_ns for r in tenant_rows)
                tenants.append(
                    TenantUsage(
                        tenant=name,
                        attributed_s=total_ns / 1e9,
                        attributed_ns=total_ns,
                        num_slices=sum(r.num_slices for r in tenant_rows),
                        num_new_tokens=sum(r.num_new_tokens for r in tenant_rows),
                        buckets=[
                            BucketUsage(start=_to_datetime(r.bucket_start_us), attributed_s=r.attributed_ns / 1e9,
                                        attributed_ns=r.attributed_ns, num_slices=r.num_slices, num_new_tokens=r.num_new_tokens)
                            for r in tenant_rows
                        ],
                    )
                )
        return TenantUsageResponse(
            start=None if start_us is None else _to_datetime(start_us),
            end=None if end_us is None else _to_datetime(end_us),
            bucket=bucket,
            tenants=tenants,
        )

    @app.get(
        "/v1/usage/requests",
        response_model=RequestUsageResponse,
        summary="Attributed time per request, largest first",
        responses={404: {"description": "the request named by run_id and request_id has no usage this key may read"}},
    )
    def usage_requests(
        principal: Annotated[Principal, Depends(any_key)],
        start: TimeParam = None,
        end: EndParam = None,
        tenant: NameParam = None,
        run_id: NameParam = None,
        request_id: NameParam = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
        offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
    ):
        start_us, end_us = _time_range(start, end)
        scoped = _scoped_tenant(principal, _check_name("tenant", tenant))
        rows = ledger.request_usage(
            start_us, end_us, scoped, _check_name("run_id", run_id), _check_name("request_id", request_id), limit, offset
        )
        if not rows and request_id is not None and offset == 0:
            raise HTTPException(404, f"no usage of request {request_id!r} visible to this key in this range")
        return RequestUsageResponse(
            start=None if start_us is None else _to_datetime(start_us),
            end=None if end_us is None else _to_datetime(end_us),
            requests=[
                RequestUsage(run_id=r.run_id, request_id=r.request_id, tenant=r.tenant, attributed_s=r.attributed_ns / 1e9,
                             attributed_ns=r.attributed_ns, num_steps=r.num_steps, num_new_tokens=r.num_new_tokens,
                             first_step_at=_to_datetime(r.first_timestamp_us), last_step_at=_to_datetime(r.last_timestamp_us))
                for r in rows
            ],
        )

    @app.get("/v1/usage/top", response_model=TopResponse, summary="The N tenants with the most attributed time (admin)")
    def usage_top(
        _principal: Annotated[Principal, Depends(admin_key)],
        n: Annotated[int, Query(ge=1, le=1000)] = 10,
        start: TimeParam = None,
        end: EndParam = None,
    ):
        start_us, end_us = _time_range(start, end)
        return TopResponse(
            start=None if start_us is None else _to_datetime(start_us),
            end=None if end_us is None else _to_datetime(end_us),
            tenants=_tenant_usage(ledger.top_tenants(n, start_us, end_us)),
        )

    @app.get("/v1/usage/totals", response_model=TotalsResponse, summary="Measured and attributed totals (admin)")
    def usage_totals(_principal: Annotated[Principal, Depends(admin_key)], start: TimeParam = None, end: EndParam = None):
        start_us, end_us = _time_range(start, end)
        totals = ledger.totals(start_us, end_us)
        return TotalsResponse(
            start=None if start_us is None else _to_datetime(start_us),
            end=None if end_us is None else _to_datetime(end_us),
            num_steps=totals.num_steps,
            measured_s=totals.measured_ns / 1e9,
            measured_ns=totals.measured_ns,
            num_slices=totals.num_slices,
            attributed_s=totals.attributed_ns / 1e9,
            attributed_ns=totals.attributed_ns,
        )

    # -----------------------------------------------------------------------------------------------------
    # Keys

    @app.get("/v1/whoami", response_model=WhoAmI, summary="The key's identity")
    def whoami(principal: Annotated[Principal, Depends(any_key)]):
        return WhoAmI(key_id=principal.key_id, tenant=principal.tenant, is_admin=principal.is_admin)

    @app.post("/v1/keys", response_model=KeyCreated, status_code=201, summary="Create a key (admin)")
    def create_key(body: KeyCreate, _principal: Annotated[Principal, Depends(admin_key)]):
        if body.admin == (body.tenant is not None):
            raise HTTPException(422, 'give either {"tenant": "T"} for a tenant key or {"admin": true}')
        _check_name("tenant", body.tenant)
        key = ledger.create_key(body.tenant, is_admin=body.admin)
        return KeyCreated(key=key, key_id=key.split("_")[1], tenant=body.tenant, is_admin=body.admin)

    @app.get("/v1/keys", response_model=list[KeyDescription], summary="List keys (admin; secrets are never shown)")
    def list_keys(_principal: Annotated[Principal, Depends(admin_key)]):
        return [
            KeyDescription(key_id=k.key_id, tenant=k.tenant, is_admin=k.is_admin, created_at=_to_datetime(k.created_at_us),
                           revoked_at=None if k.revoked_at_us is None else _to_datetime(k.revoked_at_us))
            for k in ledger.list_keys()
        ]

    @app.delete("/v1/keys/{key_id}", status_code=204, summary="Revoke a key (admin)")
    def revoke_key(key_id: Annotated[str, PathParam(max_length=64)], _principal: Annotated[Principal, Depends(admin_key)]):
        if not ledger.revoke_key(_check_name("key_id", key_id)):
            raise HTTPException(404, f"no active key {key_id!r}")
        return Response(status_code=204)

    # -----------------------------------------------------------------------------------------------------
    # Operations

    def _metrics_key(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if public_metrics:
            return
        principal = _principal(credentials)
        if principal is None:
            raise _unauthorized()
        if not principal.is_admin:
            raise HTTPException(403, "/metrics names every tenant; it needs an admin key")

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    def prometheus_metrics(_auth: Annotated[None, Depends(_metrics_key)]):
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", summary="Liveness and database reachability")
    def healthz():
        if not ledger.ping():
            return JSONResponse(status_code=503, content={"status": "database unavailable"})
        return {"status": "ok"}

    return app
