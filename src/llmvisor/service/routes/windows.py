"""``POST /v1/windows``: window aggregates attributed at the edge (`llmvisor.metering`), stored per tenant and
request rather than per step; ``GET /v1/windows/held``: what the ledger holds of a run instance, where a delivery
process that replaces one that died resumes."""

from __future__ import annotations

import json
import logging
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError

from llmvisor.errors import unknown_name
from llmvisor.ledger import DuplicateRunError, Ledger, WindowConflictError
from llmvisor.metering import WindowAggregate, WindowError
from llmvisor.service.config import ServiceSettings
from llmvisor.service.deps import AdminKey, IngestKey, LedgerDep, MetricsDep, SettingsDep, check_name
from llmvisor.service.gaps import GapMonitor
from llmvisor.service.ingest import MAX_STRING_CHARS
from llmvisor.service.metrics import ServiceMetrics
from llmvisor.service.responses import database_unavailable, error
from llmvisor.service.routes.steps import MAX_CONFLICTS_LISTED, duplicate_run_response, is_database_outage

WINDOWS_PATH = "/v1/windows"
HELD_PATH = "/v1/windows/held"

router = APIRouter(tags=["windows"])
log = logging.getLogger("llmvisor.service")


class WindowIngestResponse(BaseModel):
    windows_received: int
    windows_inserted: int
    windows_duplicate: int
    steps_covered: int
    attributed_ns: int


class WindowHoldingsResponse(BaseModel):
    run_id: str
    from_step_id: int
    step_ranges: list[tuple[int, int]]
    """Step ids received at or after ``from_step_id``, one by one or in windows: sorted, disjoint ``[first, last]``."""
    num_windows: int
    last_window_end_us: int | None
    """Where the run's last stored window ends (null: none); a later window of the run starts at or after it."""


def read_windows(body: bytes, *, max_windows: int) -> list[WindowAggregate]:
    """The body's aggregates, checked; a `WindowError` names the window and field."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as bad:
        raise WindowError(f"request body: not JSON ({bad})") from None
    items = data.get("windows") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise WindowError('request body: must be {"windows": [...]}')
    extra = unknown_name(data, ("windows",))
    if extra:
        raise WindowError(f"request body: {extra}")
    if len(items) > max_windows:
        raise WindowError(f"request body: {len(items)} windows, at most {max_windows} per request")
    return [WindowAggregate.from_json(item, where=f"windows[{k}]") for k, item in enumerate(items)]


def checked_windows(body: bytes, *, ledger: Ledger, settings: ServiceSettings) -> list[WindowAggregate]:
    """The body's aggregates, each attributed one by a registered model version; a `WindowError` names the field."""
    aggregates = read_windows(body, max_windows=settings.max_steps_per_request)
    for k, w in enumerate(aggregates):
        if not w.pending and not ledger.has_model_version(w.engine_class, w.model_version):
            raise WindowError(f"windows[{k}].model_version: no version {w.model_version} of engine class {w.engine_class!r} is registered")
    return aggregates


def store_windows(aggregates: list[WindowAggregate], *, ledger: Ledger, gaps: GapMonitor | None,
                  metrics: ServiceMetrics | None = None) -> WindowIngestResponse:
    """Store checked aggregates (group commit with the process's other POSTs: `Ledger.ingest_windows`)."""
    outcome = ledger.ingest_windows(aggregates)
    if metrics is not None:
        metrics.record_windows(outcome.stored)
    if gaps is not None and outcome.reshaped_runs:  # a run whose one range just grew has the gaps it had
        try:
            gaps.observe_runs(outcome.reshaped_runs)
        except DBAPIError:
            log.warning("llmvisor: cannot read the gaps of the runs just stored; the periodic check will", exc_info=True)
    return WindowIngestResponse(
        windows_received=len(aggregates), windows_inserted=outcome.inserted, windows_duplicate=outcome.duplicate,
        steps_covered=sum(w.num_steps for w in aggregates), attributed_ns=sum(w.attributed_ns for w in aggregates),
    )


@router.post(
    WINDOWS_PATH,
    response_model=WindowIngestResponse,
    summary="Ingest window aggregates attributed at the edge",
    description=(
        'JSON {"windows": [...]}, each a `WindowAggregate` (per run instance and window: per (tenant, request) attributed '
        "and measured nanoseconds, tokens, steps, the step-id ranges covered, residual statistics, the model version). "
        "Idempotent on (run_id, window_start_us): an identical re-send is a duplicate; a different one is a 409 naming "
        "the windows; the batch is stored whole or not at all. A new run whose first window (covering step 0) has the "
        "content of a stored run's first window, run id aside, is a re-send under a new run id: 409 naming that run "
        "(`duplicate_of`), the rest of the run refused too. The body may be gzip'd (Content-Encoding: gzip), bounded "
        "decoded by the same limit."
    ),
    responses={400: {"description": "a corrupt gzip body"},
               409: {"description": "a window was stored before with different content, or the run repeats a stored "
                            "run under a new run id (`duplicate_of`)"},
               413: {"description": "the body, or what a gzip body decodes to, over the limit"},
               415: {"description": "a Content-Encoding other than gzip (or gzip on a service started with --no-gzip-bodies)"},
               422: {"description": "a window breaks the format (the message names the field)"},
               503: {"description": "database unavailable; retry"}},
)
async def post_windows(request: Request, _principal: IngestKey, ledger: LedgerDep, metrics: MetricsDep, settings: SettingsDep):
    try:
        body = await request.body()
        async with request.app.state.ingest_slots:  # parsing and checking: CPU and memory, at most so many at once
            aggregates = await run_in_threadpool(checked_windows, body, ledger=ledger, settings=settings)
        # Storing waits outside the slots: the POSTs that arrive while one commits are stored together in the next
        # commit (one database connection for all of them), so the more wait, the fewer and larger the commits. Parsed
        # windows stay bounded by the worker threads (anyio's limiter): parsing needs one as storing does. A further
        # bound of 32 parsed POSTs cut the 1,000-engine fleet's covered steps from about 30,000 to 18,000 a second.
        return await run_in_threadpool(store_windows, aggregates, ledger=ledger, gaps=request.app.state.gaps, metrics=metrics)
    except WindowError as bad:
        metrics.count_ingest_error("bad_shape")
        return error(422, str(bad))
    except WindowConflictError as conflict:
        metrics.count_ingest_error("conflict")
        listed = [{"run_id": r, "window_start_us": s} for r, s in conflict.conflicts[:MAX_CONFLICTS_LISTED]]
        return JSONResponse(status_code=409, content={"detail": str(conflict), "conflicting_windows": listed})
    except DuplicateRunError as duplicate:
        return duplicate_run_response(duplicate, metrics)
    except DBAPIError as database_error:
        if not is_database_outage(database_error):
            raise
        metrics.count_ingest_error("database")
        return database_unavailable()


@router.get(
    HELD_PATH,
    response_model=WindowHoldingsResponse,
    summary="What the ledger holds of a run instance (admin): where a replacement delivery process resumes",
    description=(
        "The run's step ids received at or after `from_step_id` (stored one by one or covered by a window) as "
        "sorted, disjoint ranges, its number of windows and where the last one ends. A delivery process that "
        "replaces one that died asks this before it aggregates: it skips the steps listed and starts its first "
        "window at or after `last_window_end_us`, so it never sends a window key the ledger holds with other "
        "content nor a step twice. A run with nothing stored answers empty ranges, 0 windows, null."
    ),
)
def get_held(
    run_id: Annotated[str, Query(min_length=1, max_length=MAX_STRING_CHARS)],
    _principal: AdminKey,
    ledger: LedgerDep,
    from_step_id: Annotated[int, Query(ge=0, lt=2**63)] = 0,
):
    held = ledger.run_holdings(check_name("run_id", run_id), from_step_id)
    return WindowHoldingsResponse(run_id=held.run_id, from_step_id=held.from_step_id, step_ranges=held.step_ranges,
                                  num_windows=held.num_windows, last_window_end_us=held.last_window_end_us)
