"""Adjustments: corrections of past bills, one entry per tenant and period, never a rewrite (`schema.adjustments`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError

from llmvisor.ledger.connection import LedgerConnection
from llmvisor.ledger.records import AdjustmentRow, LedgerError
from llmvisor.ledger.schema import adjustments


class AdjustmentStore(LedgerConnection):
    """Stored adjustments (module note)."""

    def adjustment_rows(self, engine_class: str | None = None, tenant: str | None = None) -> list[AdjustmentRow]:
        """Stored adjustments (of one class, one tenant, or all), oldest period first."""
        query = select(*adjustments.columns)
        if engine_class is not None:
            query = query.where(adjustments.c.engine_class == engine_class)
        if tenant is not None:
            query = query.where(adjustments.c.tenant == tenant)
        query = query.order_by(adjustments.c.period_start_us, adjustments.c.engine_class, adjustments.c.to_version, adjustments.c.tenant)
        with self._read() as conn:
            return [AdjustmentRow(*row) for row in conn.execute(query)]

    def add_adjustments(self, rows: Sequence[AdjustmentRow]) -> None:
        """Store one adjustment's entries (one per tenant) in one transaction; an adjustment already stored
        for the same class, period and version is refused whole (``LedgerError``), so a rerun never counts twice."""
        if not rows:
            return
        try:
            with self.write_transaction() as conn:
                conn.execute(insert(adjustments), [{f.name: getattr(row, f.name) for f in fields(row)} for row in rows])
        except IntegrityError:
            first = rows[0]
            raise LedgerError(
                f"engine class {first.engine_class!r}: the period is already adjusted to model version {first.to_version}; "
                "nothing was written"
            ) from None
