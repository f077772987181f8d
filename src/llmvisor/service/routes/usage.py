"""``/v1/usage/*``: attributed time per tenant, per request, the top tenants and the reconciliation totals, each with
the KV memory-time held beside it (trace format 3: block-ns, byte-ns, GiB-seconds; null where not metered)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import BaseModel

from llmvisor.billing.prices import US_PER_HOUR
from llmvisor.service.deps import (
    AdminKey,
    AnyKey,
    LedgerDep,
    NameParam,
    TimeRangeDep,
    check_name,
    scoped_tenant,
    to_datetime,
)
from llmvisor.service.ingest import MAX_STRING_CHARS
from llmvisor.service.schemas import (
    AdapterUsage,
    BucketUsage,
    RequestUsage,
    RequestUsageResponse,
    TenantUsage,
    TenantUsageResponse,
    TopResponse,
    TotalsResponse,
    kv_memory,
)

router = APIRouter(prefix="/v1/usage", tags=["usage"])


def tenant_usage(rows) -> list[TenantUsage]:
    return [
        TenantUsage(tenant=r.tenant, attributed_s=r.attributed_ns / 1e9, attributed_ns=r.attributed_ns,
                    num_slices=r.num_slices, num_new_tokens=r.num_new_tokens, adjusted_ns=r.attributed_ns,
                    **kv_memory(r.kv_block_ns, r.kv_byte_ns))
        for r in rows
    ]


def _kv_sum(values) -> int | None:
    """A sum of KV figures where None (not metered) adds nothing; None when none is metered."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def tenant_buckets(rows) -> list[TenantUsage]:
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
                adjusted_ns=total_ns,
                **kv_memory(_kv_sum(r.kv_block_ns for r in tenant_rows), _kv_sum(r.kv_byte_ns for r in tenant_rows)),
                buckets=[
                    BucketUsage(start=to_datetime(r.bucket_start_us), attributed_s=r.attributed_ns / 1e9,
                                attributed_ns=r.attributed_ns, num_slices=r.num_slices, num_new_tokens=r.num_new_tokens,
                                **kv_memory(r.kv_block_ns, r.kv_byte_ns))
                    for r in tenant_rows
                ],
            )
        )
    return tenants


@router.get("/tenants", response_model=TenantUsageResponse, summary="Attributed time per tenant")
def usage_tenants(
    principal: AnyKey,
    ledger: LedgerDep,
    span: TimeRangeDep,
    bucket: Annotated[Literal["minute", "hour", "day"] | None, Query(description="UTC buckets")] = None,
    tenant: NameParam = None,
    group_by: Annotated[Literal["adapter"] | None, Query(description="adapter: each tenant's usage per LoRA adapter too")] = None,
):
    scoped = scoped_tenant(principal, check_name("tenant", tenant))
    rows = ledger.tenant_usage(span.start_us, span.end_us, bucket, scoped)
    tenants = tenant_usage(rows) if bucket is None else tenant_buckets(rows)
    if group_by == "adapter":
        with_adapters(tenants, ledger.tenant_usage(span.start_us, span.end_us, None, scoped, by_adapter=True))
    with_adjustments(tenants, ledger.adjustment_rows(tenant=scoped), span.start_us, span.end_us)
    with_costs(tenants, ledger, span.start_us, span.end_us, scoped)
    return TenantUsageResponse(start=span.start, end=span.end, bucket=bucket, tenants=tenants)


def with_adapters(tenants: list[TenantUsage], rows) -> None:
    """Each tenant's usage per LoRA adapter (``rows``: `Ledger.tenant_usage` with ``by_adapter``)."""
    by_tenant: dict[str, list[AdapterUsage]] = {}
    for r in rows:
        by_tenant.setdefault(r.tenant, []).append(AdapterUsage(
            lora_adapter=r.lora_name, attributed_s=r.attributed_ns / 1e9, attributed_ns=r.attributed_ns, num_slices=r.num_slices,
            num_new_tokens=r.num_new_tokens, **kv_memory(r.kv_block_ns, r.kv_byte_ns)))
    for usage in tenants:
        usage.adapters = by_tenant.get(usage.tenant, [])


COST_END_US = (2**62 // US_PER_HOUR) * US_PER_HOUR
"""The end of an open range for costs: a whole hour far beyond any usage (charges need whole-hour bounds)."""


def with_costs(tenants: list[TenantUsage], ledger, start_us: int | None, end_us: int | None, tenant: str | None) -> None:
    """Each tenant's cost per currency (`llmvisor.billing.tenant_costs`) when the ledger has prices and the range's
    bounds are whole hours; a stored price the bill cannot use is the ledger's one-line refusal (409)."""
    from llmvisor.billing import PriceError, list_prices, tenant_costs

    if any(bound is not None and bound % US_PER_HOUR for bound in (start_us, end_us)) or not list_prices(ledger):
        return
    if start_us is not None and end_us is not None and end_us <= start_us:
        return
    try:
        owed = tenant_costs(ledger, start_us or 0, COST_END_US if end_us is None else end_us, None if tenant is None else [tenant])
    except PriceError as error:
        raise HTTPException(409, str(error)) from None
    for usage in tenants:
        if usage.tenant in owed:
            usage.cost = {currency: str(amount) for currency, amount in sorted(owed[usage.tenant].items())}


def with_adjustments(tenants: list[TenantUsage], adjustments, start_us: int | None, end_us: int | None) -> None:
    """Add each tenant's adjustments whose whole period lies in [start_us, end_us) beside its billed usage."""
    inside = [a for a in adjustments if (start_us is None or a.period_start_us >= start_us) and (end_us is None or a.period_end_us <= end_us)]
    by_tenant: dict[str, int] = {}
    for a in inside:
        by_tenant[a.tenant] = by_tenant.get(a.tenant, 0) + a.delta_ns
    for usage in tenants:
        usage.adjustments_ns = by_tenant.pop(usage.tenant, 0)
        usage.adjusted_ns = usage.attributed_ns + usage.adjustments_ns
    for name, delta_ns in sorted(by_tenant.items()):  # a tenant credited or debited with no usage left in the range
        tenants.append(TenantUsage(tenant=name, attributed_s=0.0, attributed_ns=0, num_slices=0, num_new_tokens=0,
                                   adjustments_ns=delta_ns, adjusted_ns=delta_ns))


@router.get(
    "/requests",
    response_model=RequestUsageResponse,
    summary="Attributed time per request, largest first",
    description=(
        "Requests stored one by one, and requests metered in window aggregates where the service keeps a row per request "
        "(`LLMVISOR_REQUEST_TOTALS=1`, the default; with 0, a large fleet's setting, their usage is read from the archive: "
        "`llmvisor audit --requests N`)."
    ),
    responses={404: {"description": "the request named by run_id and request_id has no usage this key may read"}},
)
def usage_requests(
    principal: AnyKey,
    ledger: LedgerDep,
    span: TimeRangeDep,
    tenant: NameParam = None,
    run_id: NameParam = None,
    request_id: NameParam = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
):
    scoped = scoped_tenant(principal, check_name("tenant", tenant))
    rows = ledger.request_usage(
        span.start_us, span.end_us, scoped, check_name("run_id", run_id), check_name("request_id", request_id), limit, offset
    )
    if not rows and request_id is not None and offset == 0:
        unkept = "" if ledger.request_totals else (
            "; this service keeps no row per request metered in window aggregates (LLMVISOR_REQUEST_TOTALS=0): "
            "read those from the archive (llmvisor audit --requests N)")
        raise HTTPException(404, f"no usage of request {request_id!r} visible to this key in this range{unkept}")
    return RequestUsageResponse(
        start=span.start,
        end=span.end,
        requests=[request_usage_out(r) for r in rows],
    )


ENGINE_SUFFIX = re.compile(r"(?:[-_][0-9]+)?-[0-9a-f]{8}")
"""What vLLM appends to the id its OpenAI server answers with: the prompt's index for completions (``-0``; a
chat completion of several engine inputs: ``_1``), then ``-`` and 8 random hex characters (``assign_request_id``)."""


class CallerRequestUsage(BaseModel):
    """One caller's request: the id it asked for and the engine requests that ran it, summed."""

    request_id: str
    tenant: str
    attributed_s: float
    attributed_ns: int
    num_steps: int
    num_new_tokens: int
    runs: list[str]
    parts: list[RequestUsage]


def request_rows_of(ledger, span, tenant: str | None, request_id: str) -> list:
    """The engine requests of ``request_id``: itself if the ledger has it, else the ids vLLM made of it."""
    rows = ledger.request_usage(span.start_us, span.end_us, tenant, request_id=request_id, limit=10_000)
    if rows:
        return rows
    candidates = ledger.request_usage(span.start_us, span.end_us, tenant, request_id_prefix=request_id, limit=10_000)
    return [r for r in candidates if r.request_id.startswith(request_id) and ENGINE_SUFFIX.fullmatch(r.request_id[len(request_id):])]


def request_usage_out(r) -> RequestUsage:
    return RequestUsage(run_id=r.run_id, request_id=r.request_id, tenant=r.tenant, attributed_s=r.attributed_ns / 1e9,
                        attributed_ns=r.attributed_ns, num_steps=r.num_steps, num_new_tokens=r.num_new_tokens,
                        first_step_at=to_datetime(r.first_timestamp_us), last_step_at=to_datetime(r.last_timestamp_us),
                        **kv_memory(r.kv_block_ns, r.kv_byte_ns), lora_adapter=r.lora_name)


@router.get(
    "/requests/{request_id}",
    response_model=CallerRequestUsage,
    summary="One request's attributed time, by the id the OpenAI server answered with",
    responses={404: {"description": "no request of that id has usage this key may read (yet)"}},
)
def usage_request(
    principal: AnyKey,
    ledger: LedgerDep,
    span: TimeRangeDep,
    request_id: Annotated[str, Path(max_length=MAX_STRING_CHARS)],
):
    """The request's attributed engine time, steps and tokens. ``request_id`` is the engine's id or the
    ``id`` of vLLM's OpenAI answer (``cmpl-…``, ``chatcmpl-…``): the engine ran that as ``<id>-<index>-<8 hex>``,
    and the parts of every prompt of it are summed. A tenant key sees its own tenant's requests only: another
    tenant's id is a 404, as an unknown one is."""
    scoped = scoped_tenant(principal, None)
    rows = request_rows_of(ledger, span, scoped, check_name("request_id", request_id))
    tenants = sorted({r.tenant for r in rows})
    if not rows:
        raise HTTPException(404, f"no usage of request {request_id!r} visible to this key (yet: steps are billed once delivered)")
    if len(tenants) > 1:  # only an admin key can see this: one id used by several tenants
        raise HTTPException(409, f"request {request_id!r} names requests of several tenants ({', '.join(tenants)}); use /v1/usage/requests?tenant=")
    rows = sorted(rows, key=lambda r: (r.run_id, r.request_id))
    total_ns = sum(r.attributed_ns for r in rows)
    return CallerRequestUsage(
        request_id=request_id, tenant=tenants[0], attributed_s=total_ns / 1e9, attributed_ns=total_ns,
        num_steps=sum(r.num_steps for r in rows), num_new_tokens=sum(r.num_new_tokens for r in rows),
        runs=sorted({r.run_id for r in rows}), parts=[request_usage_out(r) for r in rows],
    )


@router.get("/top", response_model=TopResponse, summary="The N tenants with the most attributed time (admin)")
def usage_top(_principal: AdminKey, ledger: LedgerDep, span: TimeRangeDep, n: Annotated[int, Query(ge=1, le=1000)] = 10):
    return TopResponse(start=span.start, end=span.end, tenants=tenant_usage(ledger.top_tenants(n, span.start_us, span.end_us)))


@router.get("/totals", response_model=TotalsResponse, summary="Measured and attributed totals (admin)")
def usage_totals(_principal: AdminKey, ledger: LedgerDep, span: TimeRangeDep):
    totals = ledger.totals(span.start_us, span.end_us)
    return TotalsResponse(
        start=span.start,
        end=span.end,
        num_steps=totals.num_steps,
        measured_s=totals.measured_ns / 1e9,
        measured_ns=totals.measured_ns,
        num_slices=totals.num_slices,
        attributed_s=totals.attributed_ns / 1e9,
        attributed_ns=totals.attributed_ns,
        **kv_memory(totals.kv_block_ns, totals.kv_byte_ns),
        pending_steps=totals.pending_steps,
        pending_measured_ns=totals.pending_measured_ns,
    )


class ClassBucket(BaseModel):
    engine_class: str
    start: datetime
    attributed_s: float
    attributed_ns: int
    num_slices: int
    num_new_tokens: int


class BillingVersion(BaseModel):
    engine_class: str
    model_version: int | None  # None: the service's default model


class ClassUsageResponse(BaseModel):
    start: datetime | None
    end: datetime | None
    bucket: str
    tenant: str | None
    buckets: list[ClassBucket]
    model_versions: list[BillingVersion]


@router.get("/classes", response_model=ClassUsageResponse, summary="Attributed time per engine class and UTC bucket, and the model versions that billed it")
def usage_classes(
    principal: AnyKey,
    ledger: LedgerDep,
    span: TimeRangeDep,
    bucket: Annotated[Literal["minute", "hour", "day"], Query(description="UTC buckets")] = "hour",
    tenant: NameParam = None,
):
    """A tenant key: its own tenant's usage. A request's engine class is its run's; the model versions are those
    of the attributed steps of the runs the tenant used in the range."""
    scoped = scoped_tenant(principal, check_name("tenant", tenant))
    rows = ledger.class_usage(span.start_us, span.end_us, bucket, scoped)
    return ClassUsageResponse(
        start=span.start, end=span.end, bucket=bucket, tenant=scoped,
        buckets=[ClassBucket(engine_class=c, start=to_datetime(b), attributed_s=ns / 1e9, attributed_ns=ns, num_slices=n, num_new_tokens=t)
                 for c, b, ns, n, t, *_split in rows],
        model_versions=[BillingVersion(engine_class=c, model_version=v) for c, v in ledger.billing_versions(span.start_us, span.end_us, scoped)],
    )
