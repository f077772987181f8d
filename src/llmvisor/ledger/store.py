"""The ledger store: attributed steps in, usage out, over SQLite (WAL) or PostgreSQL.

`Ledger` is the one object callers use. It is composed of one part per concern, each in its own module and each
built on `llmvisor.ledger.connection.LedgerConnection` (the database, its schema and transactions):

- `llmvisor.ledger.steps.StepStore`: steps stored one by one, pending steps attributed, stored steps read back;
- `llmvisor.ledger.windows.WindowStore`: window aggregates and their group commit;
- `llmvisor.ledger.runs.RunStore` (under both): a run's held step ids, gaps, end-of-run record, duplicate runs;
- `llmvisor.ledger.usage.UsageQueries`: usage per tenant, class and request, totals, step detail;
- `llmvisor.ledger.registry.ModelRegistry`: fitted models per engine class, pending classes;
- `llmvisor.ledger.keys.KeyStore`: API keys;
- `llmvisor.ledger.adjustments.AdjustmentStore`: corrections of past bills.

The values they take and give, and the errors they raise, are in `llmvisor.ledger.records`; the billing tables'
reads and writes (prices, recorded lines, closed periods) in `llmvisor.ledger.billing_tables`. The names below are
re-exported from here for the callers that import them from ``llmvisor.ledger.store``.
"""

from __future__ import annotations

from llmvisor.ledger.adjustments import AdjustmentStore
from llmvisor.ledger.connection import normalize_url, now_us
from llmvisor.ledger.keys import KeyStore
from llmvisor.ledger.records import (
    HELD_ELSEWHERE,
    SHARING_BLOB_COLUMNS,
    AdjustmentRow,
    DuplicateRunError,
    HeldStepsError,
    IngestOutcome,
    KeyInfo,
    LedgerError,
    ModelVersion,
    RequestUsageRow,
    RunEnd,
    RunEndConflictError,
    RunGaps,
    RunHoldings,
    SliceShare,
    StepConflictError,
    StepDetail,
    StepGap,
    StepRecords,
    StoredSteps,
    StoredWindow,
    Totals,
    UsageRow,
    WindowConflictError,
    WindowOutcome,
)
from llmvisor.ledger.registry import ModelRegistry
from llmvisor.ledger.runs import gaps_of_ranges, merge_ranges, range_overlaps, step_id_ranges
from llmvisor.ledger.steps import StepStore
from llmvisor.ledger.usage import BUCKET_US, UsageQueries, split_sums
from llmvisor.ledger.windows import WindowStore


class Ledger(StepStore, WindowStore, UsageQueries, ModelRegistry, KeyStore, AdjustmentStore):
    """Durable record of attributed time (per step, per slice, per request per second), with usage queries
    and API keys.

    Parameters
    ----------
    url : SQLAlchemy database URL: ``sqlite:///PATH`` (WAL mode) or ``postgresql+psycopg://USER@HOST/DB``.
    request_totals : keep a row per request of window aggregates (`llmvisor.ledger.connection.LedgerConnection`).
    """


__all__ = [
    "BUCKET_US",
    "HELD_ELSEWHERE",
    "SHARING_BLOB_COLUMNS",
    "AdjustmentRow",
    "DuplicateRunError",
    "HeldStepsError",
    "IngestOutcome",
    "KeyInfo",
    "Ledger",
    "LedgerError",
    "ModelVersion",
    "RequestUsageRow",
    "RunEnd",
    "RunEndConflictError",
    "RunGaps",
    "RunHoldings",
    "SliceShare",
    "StepConflictError",
    "StepDetail",
    "StepGap",
    "StepRecords",
    "StoredSteps",
    "StoredWindow",
    "Totals",
    "UsageRow",
    "WindowConflictError",
    "WindowOutcome",
    "gaps_of_ranges",
    "merge_ranges",
    "normalize_url",
    "now_us",
    "range_overlaps",
    "split_sums",
    "step_id_ranges",
]
