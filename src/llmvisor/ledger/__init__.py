"""Durable per-tenant ledger of attributed engine time (SQLite or PostgreSQL via SQLAlchemy)."""

from llmvisor import extras

extras.require("llmvisor.ledger", "service", modules=["sqlalchemy"])

from llmvisor.ledger.connection import normalize_url  # noqa: E402
from llmvisor.ledger.keys import Principal  # noqa: E402
from llmvisor.ledger.records import (  # noqa: E402
    AdjustmentRow,
    DuplicateRunError,
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
    Totals,
    UsageRow,
    WindowConflictError,
    WindowOutcome,
)
from llmvisor.ledger.store import Ledger  # noqa: E402
from llmvisor.ledger.usage import BUCKET_US  # noqa: E402

__all__ = [
    "AdjustmentRow",
    "BUCKET_US",
    "DuplicateRunError",
    "IngestOutcome",
    "KeyInfo",
    "Ledger",
    "LedgerError",
    "ModelVersion",
    "Principal",
    "RequestUsageRow",
    "RunEnd",
    "RunEndConflictError",
    "RunGaps",
    "RunHoldings",
    "SliceShare",
    "StepGap",
    "StepConflictError",
    "StepDetail",
    "StepRecords",
    "StoredSteps",
    "Totals",
    "UsageRow",
    "WindowConflictError",
    "WindowOutcome",
    "normalize_url",
]
