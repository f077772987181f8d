"""Billing periods, recorded lines and corrections (docs/billing.md, "Periods and corrections").

A billing period is a calendar UTC month. Every export (not a dry run) records the content of each line it emits in
``billing_lines`` (schema 8): quantity, token split, exact amount and cents, under the line's id, which names that
content for good. A charge is recorded as revision 0 the first time; when the ledger later holds more (or less) for
it, late steps or windows for an exported hour, the next export records and emits revision 1, 2, ...: a correction
line of the difference, with an id of its own. Recorded lines are never changed.

Cents are given once per line when it is recorded, carrying the sub-cent remainder forward within its line group
(`llmvisor.billing.charges.line_group`: tenant, kind, class, version, item, currency, billing period): a line's cents
are the group's rounded exact total with it less the cents the group's recorded lines already have
(`llmvisor.billing.prices.carried_cents`), so the group's lines always sum to its exact total rounded once.

``line_exports`` says which lines each format has delivered (a file written, or every body of a push acknowledged).
An export of a range with lines already delivered in its format is refused unless forced, and then it emits only the
lines not yet delivered in that format: the corrections. Closing a period (`close_period`, by hand or by an export
`LLMVISOR_CLOSE_PERIOD_AFTER_S` after the period's end) records its lines as they are then; corrections recorded
after it are billed in the month they are made (FOCUS ChargeClass "Correction").

An export per LoRA adapter (``by_adapter``) records a tenant's adapter lines under keys of their own (its base-model
line keeps the unsplit key, `llmvisor.billing.charges`); exporting a range split after exporting it unsplit (or the
other way round) records the lines that are no longer charged as corrections taking them back, so what the recorded
lines bill in total is the same either way.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

from sqlalchemy.exc import IntegrityError

from llmvisor.billing.charges import ENGINE_TIME, KV_MEMORY, Charge, charges, line_group, month_bounds_us
from llmvisor.billing.prices import PriceBook, carried_cents, token_unit_price
from llmvisor.core.tokens import TOKEN_SPLIT
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import Ledger, billing_tables
from llmvisor.ledger.connection import now_us

CLOSE_AFTER_ENV = "LLMVISOR_CLOSE_PERIOD_AFTER_S"
DEFAULT_CLOSE_AFTER_S = 3 * 86400
"""An export closes a period this long after it ends (unless ``LLMVISOR_CLOSE_PERIOD_AFTER_S`` says otherwise):
long enough for the engines' last deliveries, short enough to invoice early in the next month."""
STRIPE_DEDUPE_S = 86400
"""Stripe deduplicates meter event identifiers for 24 hours only: a re-send after that bills again."""


class PeriodError(LlmvisorError):
    """A period that cannot be closed or exported as asked (one line, exit code 2)."""


def parse_period(text: str) -> tuple[int, int]:
    """``YYYY-MM`` as the month's [start, end) in Unix µs."""
    match = re.fullmatch(r"(\d{4})-(\d{2})", text.strip())
    if not match or not 1 <= int(match[2]) <= 12 or int(match[1]) < 1970:
        raise PeriodError(f"--period: expected a calendar month as YYYY-MM (a UTC month from 1970), got {text!r}")
    start = datetime(int(match[1]), int(match[2]), 1, tzinfo=UTC)
    return month_bounds_us(int(start.timestamp()) * 1_000_000)


def month_name(us: int) -> str:
    return datetime.fromtimestamp(us // 1_000_000, tz=UTC).strftime("%Y-%m")


def close_after_s(environ=os.environ) -> int | None:
    """``LLMVISOR_CLOSE_PERIOD_AFTER_S``: whole seconds ≥ 0, or ``off`` (None: periods close only by hand)."""
    raw = environ.get(CLOSE_AFTER_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_CLOSE_AFTER_S
    if raw.strip().lower() == "off":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise PeriodError(f"{CLOSE_AFTER_ENV}: expected whole seconds (0 or more) or 'off', got {raw!r}")
    return value


def _months(start_us: int, end_us: int) -> list[tuple[int, int]]:
    """The billing periods [start_us, end_us) touches."""
    out = [month_bounds_us(start_us)]
    while out[-1][1] < end_us:
        out.append(month_bounds_us(out[-1][1]))
    return out


@dataclass(frozen=True)
class _Recorded:
    """A charge's recorded lines summed: what its exported lines already bill."""

    revision: int  # the highest
    quantity: int
    num_new_tokens: int
    tokens: tuple[int | None, ...]
    exact: Fraction | None


def _sub(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def _row_charge(row, book: PriceBook) -> Charge:
    """A recorded line as a charge (its price: the one in force at its start, as when it was recorded)."""
    price = book.price_at(row.engine_class, row.charge_start_us)
    tokens = tuple(getattr(row, name) for name in TOKEN_SPLIT)
    if row.item == KV_MEMORY:
        unit = None if price is None else price.gib_hour_price
    else:
        unit = None if row.item == ENGINE_TIME or price is None else token_unit_price(price, row.item)
    charge = Charge(row.kind, row.tenant, row.engine_class, row.model_version, row.charge_start_us, row.charge_end_us, 0,
                    row.num_new_tokens, price, None if row.cost is None else Decimal(row.cost), None,
                    from_versions=row.from_versions, item=row.item, tokens=tokens, unit_price=unit,
                    exact_cost=None if row.exact_cost is None else Fraction(row.exact_cost), revision=row.revision,
                    billed_period_start_us=row.billed_period_start_us, kv_block_bytes=row.kv_block_bytes,
                    lora_name=row.lora_name)
    return charge.with_quantity(row.quantity)


def _line_row(c: Charge, period_start_us: int, billed_us: int, created_us: int) -> dict:
    return {"line_id": c.idempotency_id, "line_key": c.line_key, "revision": c.revision, "kind": c.kind, "tenant": c.tenant,
            "engine_class": c.engine_class, "model_version": c.model_version, "from_versions": c.from_versions,
            "item": c.item, "charge_start_us": c.period_start_us, "charge_end_us": c.period_end_us,
            "period_start_us": period_start_us, "billed_period_start_us": billed_us, "quantity": c.quantity,
            "num_new_tokens": c.num_new_tokens, **dict(zip(TOKEN_SPLIT, c.tokens)),
            "currency": None if c.price is None else c.price.currency,
            "exact_cost": None if c.exact_cost is None else str(c.exact_cost),
            "cost": None if c.cost is None else str(c.cost), "created_at_us": created_us,
            "kv_block_bytes": c.kv_block_bytes if c.item == KV_MEMORY else None, "lora_name": c.lora_name}


def _record(conn, current: list[Charge], start_us: int, end_us: int, tenants: set | None, at_us: int, book: PriceBook) -> int:
    """Record, in ``conn``'s transaction, a new revision of every charge of [start_us, end_us) (of ``tenants``)
    whose ledger content differs from its recorded lines (or that has none); returns how many."""
    months = _months(start_us, end_us)
    rows = billing_tables.lines_of_periods(conn, months[0][0], months[-1][1])
    closed = billing_tables.closed_period_starts(conn)
    recorded: dict[str, _Recorded] = {}
    groups: dict[tuple, tuple[Fraction, Decimal]] = {}
    first: dict[str, object] = {}
    for r in rows:
        was = recorded.get(r.line_key)
        tokens = tuple(getattr(r, name) for name in TOKEN_SPLIT)
        exact = None if r.exact_cost is None else Fraction(r.exact_cost)
        if was is None:
            recorded[r.line_key] = _Recorded(r.revision, r.quantity, r.num_new_tokens, tokens, exact)
            first[r.line_key] = r
        else:
            recorded[r.line_key] = _Recorded(
                max(was.revision, r.revision), was.quantity + r.quantity, was.num_new_tokens + r.num_new_tokens,
                tuple(None if a is None or b is None else a + b for a, b in zip(was.tokens, tokens)),
                exact if was.exact is None else was.exact + (exact or 0))
        if r.cost is not None:
            key = (r.kind, r.tenant, r.engine_class, r.model_version, r.item, r.currency, r.period_start_us)
            e, cents = groups.get(key, (Fraction(0), Decimal(0)))
            groups[key] = (e + exact, cents + Decimal(r.cost))
    now_month = month_bounds_us(at_us)[0]
    by_key = {c.line_key: c for c in current}
    gone = [k for k, r in first.items() if k not in by_key and start_us <= r.charge_start_us < end_us
            and (tenants is None or r.tenant in tenants)]
    new = []
    for key in gone:  # recorded, absent from the ledger now: its correction takes it all back
        zero = _row_charge(first[key], book).with_quantity(0)
        new.append(replace(zero, num_new_tokens=0, tokens=tuple(0 for _ in TOKEN_SPLIT),
                           exact_cost=None if zero.exact_cost is None else Fraction(0)))
    out = []
    for c in sorted([*current, *new], key=lambda c: (c.period_start_us, c.kind, c.engine_class, c.model_version, c.tenant,
                                                     c.item, c.lora_name or "")):
        was = recorded.get(c.line_key)
        if was is None:
            line = replace(c, revision=0)
        else:
            quantity, new_tokens = c.quantity - was.quantity, c.num_new_tokens - was.num_new_tokens
            exact = None if c.exact_cost is None else c.exact_cost - (was.exact or 0)
            tokens = tuple(_sub(a, b) for a, b in zip(c.tokens, was.tokens))
            if quantity == 0 and new_tokens == 0 and not exact and not any(tokens):
                continue
            line = replace(c.with_quantity(quantity), revision=was.revision + 1, num_new_tokens=new_tokens, tokens=tokens,
                           exact_cost=exact, allocated_ratio=None)
        period_us = month_bounds_us(c.period_start_us)[0]
        billed_us = period_us
        if c.kind == "adjustment" and c.made_at_us is not None:
            billed_us = max(billed_us, month_bounds_us(c.made_at_us)[0])
        if period_us in closed:  # a closed period's bill is frozen: what is new is billed in the month it is made
            billed_us = max(billed_us, now_month)
        if line.exact_cost is not None:
            group = line_group(line)
            e, cents_before = groups.get(group, (Fraction(0), Decimal(0)))
            cents = carried_cents(e, cents_before, line.exact_cost)
            groups[group] = (e + line.exact_cost, cents_before + cents)
            line = replace(line, cost=cents)
        else:
            line = replace(line, cost=None)
        line = replace(line, billed_period_start_us=billed_us)
        out.append(_line_row(line, period_us, billed_us, at_us))
    if out:
        billing_tables.insert_lines(conn, out)
    return len(out)


@dataclass(frozen=True)
class ExportPlan:
    """What an export emits: its lines in order, how many lines of its range the format already has, how many
    revisions it recorded now."""

    lines: list[Charge]
    already_exported: int
    recorded: int


def plan_export(ledger: Ledger, format_: str, start_us: int, end_us: int, tenants: list[str] | None = None, *,
                force: bool = False, dry_run: bool = False, close_after: int | None = None, by_adapter: bool = False) -> ExportPlan:
    """Close the periods due (``close_after`` seconds after their end), record the range's new revisions, and return
    the lines not yet delivered in ``format_``; refused (`PeriodError`) where some already were, unless ``force``.
    A dry run records and closes nothing (it shows what the export would emit now). ``by_adapter``: usage lines per
    tenant and LoRA adapter (module note)."""
    wanted = None if tenants is None else set(tenants)
    at_us = now_us()
    book = PriceBook.load(ledger)
    current = charges(ledger, start_us, end_us, tenants, by_adapter=by_adapter)
    try:
        with ledger.write_transaction() as conn:
            if close_after is not None:
                for month in _months(start_us, end_us):
                    if month[1] + close_after * 1_000_000 <= at_us:
                        _close(ledger, conn, month, at_us, "export", book, by_adapter=by_adapter)
            recorded = _record(conn, current, start_us, end_us, wanted, at_us, book)
            done = billing_tables.exported_line_ids(conn, format_, start_us, end_us, wanted)
            if done and not force:
                raise PeriodError(
                    f"{len(done)} lines of this period were already exported as {format_}; a receiver deduplicates ids "
                    "only for a while (Stripe: 24 hours), so sending them again could bill them twice (--force sends "
                    "only what was not exported yet: the corrections)")
            ratios = {c.line_key: c.allocated_ratio for c in current}
            order = {c.line_key: k for k, c in enumerate(current)}  # the charges' order (`charges`), revision by revision
            lines = []
            for r in billing_tables.lines_in_range(conn, start_us, end_us, wanted):
                if r.line_id not in done:
                    line = _row_charge(r, book)
                    lines.append(replace(line, allocated_ratio=ratios.get(r.line_key) if r.revision == 0 else None))
            lines.sort(key=lambda c: (c.revision, order.get(c.line_key, len(order)), c.period_start_us, c.line_key))
            plan = ExportPlan(lines, len(done), recorded)
            if dry_run:
                raise _DryRun(plan)
    except _DryRun as dry:
        return replace(dry.plan, recorded=0)
    except IntegrityError:
        raise PeriodError("another export recorded lines of this period at the same moment; run this one again") from None
    return plan


class _DryRun(Exception):  # noqa: N818 - not an error: it rolls a dry run's transaction back
    def __init__(self, plan: ExportPlan):
        self.plan = plan


def mark_exported(ledger: Ledger, format_: str, lines: list[Charge]) -> None:
    """Record that ``lines`` were delivered in ``format_`` (after the file was written or the push acknowledged)."""
    if not lines:
        return
    at_us = now_us()
    ids = [c.idempotency_id for c in lines]
    with ledger.write_transaction() as conn:
        billing_tables.add_line_exports(conn, format_, ids, at_us)


def _close(ledger: Ledger, conn, month: tuple[int, int], at_us: int, by: str, book: PriceBook, *,
           by_adapter: bool = False) -> bool:
    """Close one period in ``conn``'s transaction: record its lines as the ledger has them now (per adapter with
    ``by_adapter``, as the export closing it asks), then mark it closed. False where it already was."""
    if billing_tables.is_period_closed(conn, month[0]):
        return False
    _record(conn, charges(ledger, *month, by_adapter=by_adapter), *month, None, at_us, book)
    count = billing_tables.count_period_lines(conn, month[0])
    billing_tables.insert_closed_period(conn, month, at_us, by, count)
    return True


@dataclass(frozen=True)
class Closed:
    period: str
    closed: bool  # False: it already was
    closed_at_us: int
    num_lines: int


def close_period(ledger: Ledger, month: tuple[int, int]) -> Closed:
    """``llmvisor close-period``: freeze what the period bills (its lines as the ledger has them now); refused
    before the period has ended."""
    at_us = now_us()
    if month[1] > at_us:
        raise PeriodError(f"--period {month_name(month[0])} has not ended (it ends "
                          f"{datetime.fromtimestamp(month[1] / 1e6, tz=UTC):%Y-%m-%dT%H:%M:%SZ}); it cannot be closed yet")
    try:
        with ledger.write_transaction() as conn:
            closed = _close(ledger, conn, month, at_us, "close-period", PriceBook.load(ledger))
            row = billing_tables.closed_period(conn, month[0])
    except IntegrityError:
        raise PeriodError("another process closed or exported this period at the same moment; run this again") from None
    return Closed(month_name(month[0]), closed, row.closed_at_us, row.num_lines)


def closed_period_rows(ledger: Ledger) -> list:
    with ledger.read_transaction() as conn:
        return billing_tables.closed_period_rows(conn)


def recorded_lines(ledger: Ledger, month: tuple[int, int] | None = None) -> list[Charge]:
    """The recorded lines (of one period), as charges."""
    book = PriceBook.load(ledger)
    with ledger.read_transaction() as conn:
        rows = billing_tables.line_rows(conn, None if month is None else month[0])
    return [_row_charge(r, book) for r in rows]


__all__ = ["CLOSE_AFTER_ENV", "DEFAULT_CLOSE_AFTER_S", "STRIPE_DEDUPE_S", "Closed", "ExportPlan", "PeriodError",
           "close_after_s", "close_period", "mark_exported", "parse_period", "plan_export", "recorded_lines"]
