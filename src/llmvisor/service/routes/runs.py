"""``GET /v1/runs/{run_id}/gaps``: the step ids of a run the ledger never received (admin)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import BaseModel

from llmvisor.service.deps import AdminKey, LedgerDep, check_name, to_datetime
from llmvisor.service.ingest import MAX_STRING_CHARS

MAX_GAPS_LISTED = 1000

router = APIRouter(prefix="/v1/runs", tags=["runs"])


class GapOut(BaseModel):
    first_step_id: int
    last_step_id: int
    num_steps: int
    since: datetime
    """When a later step first arrived: the gap has been open since then."""
    age_s: float


class RunGapsOut(BaseModel):
    run_id: str
    engine_class: str
    num_received: int
    last_step_id: int
    num_missing: int
    num_gaps: int
    gaps: list[GapOut]
    truncated: bool


@router.get(
    "/{run_id}/gaps",
    response_model=RunGapsOut,
    summary="Step ids of a run that never arrived (admin)",
    description=(
        "A run instance numbers its steps 0, 1, 2, ...; the ledger keeps the ids it received. A gap is a range of "
        "ids below the highest one received that is not stored: lost, or still in an engine's spool (it fills "
        "when the spool is replayed). Steps after the highest id received cannot be known missing."
    ),
    responses={404: {"description": "no step of the run is stored"}},
)
def get_run_gaps(
    run_id: Annotated[str, Path(max_length=MAX_STRING_CHARS)],
    _principal: AdminKey,
    ledger: LedgerDep,
    limit: Annotated[int, Query(ge=1, le=MAX_GAPS_LISTED)] = MAX_GAPS_LISTED,
):
    result = ledger.run_gaps(check_name("run_id", run_id))
    if result is None:
        raise HTTPException(404, f"no step of run {run_id!r} is stored")
    now_us = time.time_ns() // 1000
    return RunGapsOut(
        run_id=result.run_id,
        engine_class=result.engine_class,
        num_received=result.num_received,
        last_step_id=result.last_step_id,
        num_missing=result.num_missing,
        num_gaps=len(result.gaps),
        gaps=[
            GapOut(first_step_id=g.first_step_id, last_step_id=g.last_step_id, num_steps=g.num_steps,
                   since=to_datetime(g.since_us), age_s=max(0.0, (now_us - g.since_us) / 1e6))
            for g in result.gaps[:limit]
        ],
        truncated=len(result.gaps) > limit,
    )
