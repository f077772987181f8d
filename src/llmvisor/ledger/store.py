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
reads and writes (prices, recorded lines, closed periods) in `llmvisor.ledger.billing_tables`. The other names of
``__all__`` are re-exported from here for callers that import them from ``llmvisor.ledger.store``.
"""

from __future__ import annotations

from llmvisor.ledger.adjustments import AdjustmentStore
from llmvisor.ledger.connection import normalize_url, now_us
from llmvisor.ledger.keys import KeyStore
from llmvisor.ledger.records import AdjustmentRow, LedgerError, StepRecords
from llmvisor.ledger.registry import ModelRegistry
from llmvisor.ledger.steps import StepStore
from llmvisor.ledger.usage import UsageQueries, split_sums
from llmvisor.ledger.windows import WindowStore


class Ledger(StepStore, WindowStore, UsageQueries, ModelRegistry, KeyStore, AdjustmentStore):
    """Durable record of attributed time (per step, per slice, per request per second), with usage queries
    and API keys.

    Parameters
    ----------
    url : SQLAlchemy database URL: ``sqlite:///PATH`` (WAL mode) or ``postgresql+psycopg://USER@HOST/DB``.
    request_totals : keep a row per request of window aggregates (`llmvisor.ledger.connection.LedgerConnection`).
    """


# Imported from here before the split; their homes are above.
__all__ = ["AdjustmentRow", "Ledger", "LedgerError", "StepRecords", "normalize_url", "now_us", "split_sums"]
