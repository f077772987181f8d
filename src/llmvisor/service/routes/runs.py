"""``GET /v1/runs/{run_id}/gaps``: the step ids of a run the ledger never received (admin); ``POST
/v1/runs/{run_id}/end``: the end-of-run record a recorder's delivery process sends when the engine stops, so a lost
tail shows as a gap."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path, Request
from fastapi import Query as QueryParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator

from llmvisor.ledger import RunEndConflictError
from llmvisor.service.deps import AdminKey, IngestKey, LedgerDep, check_name, to_datetime
from llmvisor.service.ingest import MAX_STRING_CHARS
from llmvisor.service.schemas import StrictBody

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
    """The highest step id received (-1: none)."""
    num_missing: int
    num_gaps: int
    gaps: list[GapOut]
    truncated: bool
    state: Literal["open", "ended"]
    """"ended": the recorder's end-of-run record is stored, and the steps after the last one received up to its last
    step are counted missing; "open": none (the engine still runs, or ended without a clean shutdown), not an error."""
    recorded_last_step_id: int | None
    """The end-of-run record's last step id; null while open."""
    recorded_num_steps: int | None
    """How many steps the recorder says it recorded; null while open."""


class RunEndIn(StrictBody):
    """The end-of-run record: what the recorder recorded of the run instance (ids 0..last_step_id)."""

    last_step_id: int = Field(ge=-1, lt=2**63, description="the last step id recorded; -1: the run recorded no step")
    num_steps: int = Field(ge=0, lt=2**63, description="how many steps the recorder recorded")

    @model_validator(mode="after")
    def _ids_from_zero(self) -> RunEndIn:
        if self.num_steps > self.last_step_id + 1:
            raise ValueError(f"num_steps: {self.num_steps} steps cannot have ids 0..{self.last_step_id} (ids are distinct, from 0)")
        return self


class RunEndOut(BaseModel):
    run_id: str
    last_step_id: int
    num_steps: int
    received_at: datetime
    stored: bool
    """False: an identical record was stored before (a re-send)."""
    num_missing: int
    """Steps of the run the ledger misses now, the lost tail included."""


@router.get(
    "/{run_id}/gaps",
    response_model=RunGapsOut,
    summary="Step ids of a run that never arrived (admin)",
    description=(
        "A run instance numbers its steps 0, 1, 2, ...; the ledger keeps the ids it received. A gap is a range of "
        "ids below the highest one received that is not stored: lost, or still in an engine's spool (it fills "
        "when the spool is replayed). Steps after the highest id received are known missing only once the run's "
        "end-of-run record (POST /v1/runs/{run_id}/end, sent by the recorder's delivery process when the engine stops) is stored: "
        "`state` is then \"ended\", else \"open\"."
    ),
    responses={404: {"description": "neither a step of the run nor its end-of-run record is stored"}},
)
def get_run_gaps(
    run_id: Annotated[str, Path(max_length=MAX_STRING_CHARS)],
    _principal: AdminKey,
    ledger: LedgerDep,
    limit: Annotated[int, QueryParam(ge=1, le=MAX_GAPS_LISTED)] = MAX_GAPS_LISTED,
):
    result = ledger.run_gaps(check_name("run_id", run_id))
    if result is None:
        raise HTTPException(404, f"neither a step of run {run_id!r} nor its end-of-run record is stored")
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
        state="ended" if result.ended else "open",
        recorded_last_step_id=None if result.end is None else result.end.last_step_id,
        recorded_num_steps=None if result.end is None else result.end.num_steps,
    )


@router.post(
    "/{run_id}/end",
    response_model=RunEndOut,
    summary="Store a run's end-of-run record",
    description=(
        "Sent by the recorder's delivery process when the engine stops: the run's last step id and how many steps "
        "it recorded (the engine's record, or, where vLLM killed the engine core first, the last step the delivery "
        "process received). Steps after the last one stored, up to that id, then show as a gap (GET "
        "/v1/runs/{run_id}/gaps, llmvisor_steps_missing). Idempotent: an identical re-send answers stored=false; "
        "different values are a 409 (a run ends once). Unknown fields are refused (422)."
    ),
    responses={409: {"description": "the run has an end-of-run record with other values"},
               422: {"description": "a field is unknown, missing or out of range (the message names it)"}},
)
async def post_run_end(
    run_id: Annotated[str, Path(min_length=1, max_length=MAX_STRING_CHARS)],
    body: RunEndIn,
    request: Request,
    _principal: IngestKey,
    ledger: LedgerDep,
):
    run_id = check_name("run_id", run_id)
    try:
        record, stored = await run_in_threadpool(ledger.end_run, run_id, body.last_step_id, body.num_steps)
    except RunEndConflictError as conflict:
        return JSONResponse(status_code=409, content={"detail": str(conflict)})
    gaps = request.app.state.gaps
    if gaps is not None:
        await run_in_threadpool(gaps.observe_runs, [run_id])
    result = await run_in_threadpool(ledger.run_gaps, run_id)
    return RunEndOut(run_id=run_id, last_step_id=record.last_step_id, num_steps=record.num_steps,
                     received_at=to_datetime(record.received_at_us), stored=stored,
                     num_missing=0 if result is None else result.num_missing)
