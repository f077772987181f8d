"""``/v1/adjustments``: corrections of past bills (`llmvisor adjust`), beside the usage they correct."""

from __future__ import annotations

from fastapi import APIRouter

from llmvisor.service.deps import AnyKey, LedgerDep, NameParam, check_name, scoped_tenant, to_datetime
from llmvisor.service.schemas import AdjustmentOut, AdjustmentsResponse

router = APIRouter(prefix="/v1/adjustments", tags=["usage"])


@router.get("", response_model=AdjustmentsResponse, summary="Adjustment entries per tenant and period")
def list_adjustments(principal: AnyKey, ledger: LedgerDep, tenant: NameParam = None, engine_class: NameParam = None):
    """Every adjustment entry (a tenant key: its own), oldest period first. Each names the model versions that
    billed the period and the one that re-attributed it; ``delta_ns`` is re-attributed minus billed (negative: a
    credit). The usage endpoints keep showing what was billed; ``usage/tenants`` adds the adjustments beside it."""
    scoped = scoped_tenant(principal, check_name("tenant", tenant))
    rows = ledger.adjustment_rows(engine_class=check_name("engine_class", engine_class), tenant=scoped)
    return AdjustmentsResponse(adjustments=[
        AdjustmentOut(engine_class=r.engine_class, period_start=to_datetime(r.period_start_us), period_end=to_datetime(r.period_end_us),
                      tenant=r.tenant, from_versions=r.from_versions, to_version=r.to_version, billed_ns=r.billed_ns,
                      reattributed_ns=r.reattributed_ns, delta_ns=r.delta_ns, delta_s=r.delta_ns / 1e9, num_steps=r.num_steps,
                      created_at=to_datetime(r.created_at_us))
        for r in rows
    ])
